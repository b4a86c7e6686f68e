"""One adapter-only weight sync, as a trainer rank sees it: what it sent, what the rollout's
workers say they hold, how long each part took, and the verdict every trainer rank agrees on.

Side-effect free; no VERL or vLLM import (``fsdp2_ext.verl.rollout_sync`` drives it from VERL's
``ServerAdapter.update_weights``; the workers' side is ``fsdp2_ext.vllm.vllm_lora``).

[Note: every adapter sync checked]
VERL's adapter-only sync has three silent ways to roll out something other than the adapter the
trainer just trained: a key vLLM binds to no module (dropped: no delta), a load that does not take
(the slot keeps an earlier sync's adapter), and generation without the adapter (``vLLMHttpServer.
generate`` serves the base model whenever the adapter is not listed). The check, per sync:

1. each trainer rank fingerprints every tensor it sends ([Note: a tensor's fingerprint]) as VERL's
   sender consumes them;
2. each vLLM worker reports what it received and holds ([Note: what a worker proves after a
   sync]); VERL's ``collective_rpc`` is made to return the reports to the replica's rank 0;
3. ``verdict`` compares, for every worker, the received fingerprints with what its trainer rank
   sent (key by key: missing, extra, different), and takes the workers' own findings;
4. every trainer rank gathers every rank's record (``gather_objects``, bounded: it allows for
   rank 0 waiting on its workers to receive, copy twice, load and check the adapter,
   ``WORK_PASSES`` passes over its bytes) and raises the same error, naming the step, the
   worker, the module or key, unless ``FSDP2_EXT_LORA_SYNC_CHECK=warn`` (then it is logged).

A trainer rank whose sync raised (a worker refused the adapter, a transfer failed) brings its
error to the same agreement, so every rank stops with it instead of waiting at VERL's barrier.
``vLLMHttpServer.generate`` refuses to generate without the adapter once the model has one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from fsdp2_ext.vllm.lora_fingerprint import digest, fingerprint
from fsdp2_ext.vllm.sync_memory import host_bytes

__all__ = [
    "CHECK_ENV",
    "WORK_PASSES",
    "AdapterSync",
    "check_mode",
    "line",
    "stop_or_warn",
    "summary",
    "verdict",
]

CHECK_ENV = "FSDP2_EXT_LORA_SYNC_CHECK"
_MODES = ("error", "warn")
WORK_PASSES = 6  # rank 0's wait on its workers: send, receive, two copies, the load's cast, check


def check_mode() -> str:
    """``error`` (the default: a failed check stops the run) or ``warn``."""
    mode = os.environ.get(CHECK_ENV, "error").strip().lower() or "error"
    if mode not in _MODES:
        raise ValueError(f"{CHECK_ENV}={mode!r}: use one of {', '.join(_MODES)} (default error)")
    return mode


def stop_or_warn(message: str) -> None:
    """A failed check: raised (the default), or logged under ``FSDP2_EXT_LORA_SYNC_CHECK=warn``."""
    message = f"{message}. Set {CHECK_ENV}=warn to only log this"
    if check_mode() == "error":
        raise RuntimeError(message)
    from fsdp2_ext.common import log

    log.warn(message)


@dataclass
class AdapterSync:
    """One trainer rank's record of one adapter sync (pickled into the agreement)."""

    step: int | None
    rank: int
    replica: int
    rollout_rank: int
    sent: dict = field(default_factory=dict)  # key -> fingerprint
    bytes: int = 0
    host_bytes: int = 0  # the host storages under what was sent ([Note: what an adapter sync ...])
    gather_s: float = 0.0
    send_s: float = 0.0
    wait_s: float = 0.0  # from the last tensor sent to the workers' reports
    reports: list | None = None  # the replica's workers' (rank 0 of the replica only)
    error: str = ""  # this rank's own failure during the sync, if any
    _start: float = field(default=0.0, repr=False)

    def sending(self, weights, device=None):
        """``weights`` passed through, each tensor fingerprinted as VERL's sender takes it; on
        ``device`` (the rank's GPU) when given: VERL's adapter is on the host (``collect_lora_
        params``), and a copy to the GPU (which VERL's sender makes of it anyway, into its bucket)
        costs less than the pass over its words on the CPU."""
        self._start = time.monotonic()
        held: list = []
        for name, tensor in weights:
            on = tensor if device is None else tensor.to(device, non_blocking=True)
            self.sent[name] = fingerprint(on)
            self.bytes += tensor.numel() * tensor.element_size()
            held.append(tensor)  # VERL holds them all until the last is sent
            yield name, tensor
        self.host_bytes = host_bytes(held)
        self.send_s = time.monotonic() - self._start
        self._start = time.monotonic()

    def received(self, reports) -> None:
        self.wait_s = time.monotonic() - self._start if self._start else 0.0
        self.reports = list(reports) if reports is not None else None


def _plain(print_: tuple | list) -> tuple:
    """A fingerprint as sent or as it came back through vLLM's serialisation (lists for tuples)."""
    dtype, shape, total, weighted = print_
    return dtype, tuple(shape), total, weighted


def verdict(records: list[AdapterSync]) -> list[str]:
    """Every problem with the sync, from every rank's record; the same list on every rank.

    A replica's worker ``k`` received from the replica's trainer rank with ``rollout_rank == k``
    (VERL's ZMQ handle: the replica and the node-local rank)."""
    problems: list[str] = []
    for record in records:
        if record.error:
            problems.append(f"trainer rank {record.rank}: {record.error}")
    by_rollout = {(r.replica, r.rollout_rank): r for r in records}
    for record in records:
        if record.rollout_rank != 0 or record.error:
            continue
        if record.reports is None:
            problems.append(
                f"replica {record.replica}: its vLLM workers returned no report (the sync check "
                "needs fsdp2_ext's patches in the server and its workers: is "
                "VERL_USE_EXTERNAL_MODULES=fsdp2_ext.verl set in their environment?)"
            )
            continue
        for report in record.reports:
            where = f"replica {record.replica}, vLLM worker {report.get('rank')}"
            if not isinstance(report, dict) or "received" not in report:
                problems.append(f"{where}: no report (got {report!r})")
                continue
            problems += [f"{where}: {problem}" for problem in report["problems"]]
            sender = by_rollout.get((record.replica, report["rank"]))
            if sender is None:
                problems.append(f"{where}: no trainer rank sent to it")
                continue
            if not report["loaded"]:
                continue  # said above; its received fingerprints are not this sync's
            got, sent = report["received"], sender.sent
            for key in sorted(set(sent) - set(got)):
                problems.append(f"{where}: {key} sent by trainer rank {sender.rank}, not received")
            for key in sorted(set(got) - set(sent)):
                problems.append(
                    f"{where}: {key} received, but trainer rank {sender.rank} never sent it"
                )
            for key in sorted(set(got) & set(sent)):
                if _plain(got[key]) != _plain(sent[key]):
                    problems.append(
                        f"{where}: {key} received differs from what trainer rank {sender.rank} "
                        f"sent ({_plain(got[key])} != {_plain(sent[key])})"
                    )
    return problems


def summary(records: list[AdapterSync], problems: list[str], check_s: float) -> dict:
    """The sync's report line and record: tensors, bytes, seconds per part, result."""
    senders = [r for r in records if not r.error]
    reports = [rep for r in records if r.reports for rep in r.reports if isinstance(rep, dict)]
    first = senders[0] if senders else records[0]
    return {
        "step": first.step,
        "tensors": len(first.sent),
        "bytes": first.bytes,
        "host_bytes": [r.host_bytes for r in senders],
        "worker_host_bytes": [rep.get("host_bytes") for rep in reports],
        "digest": digest(first.sent),
        "gather_s": max((r.gather_s for r in records), default=0.0),
        "send_s": max((r.send_s for r in records), default=0.0),
        "load_s": max((rep.get("load_s", 0.0) for rep in reports), default=0.0),
        "wait_s": max((r.wait_s for r in records), default=0.0),
        "check_s": check_s + max((rep.get("check_s", 0.0) for rep in reports), default=0.0),
        "workers": len(reports),
        "slot_checked": [rep.get("slot_checked", 0) for rep in reports],
        "model_only": sorted({m for rep in reports for m in rep.get("model_only", [])}),
        "skipped": sorted({k for rep in reports for k in rep.get("skipped", [])}),
        "result": "exact" if not problems else f"{len(problems)} problem(s)",
        "problems": problems,
    }


def line(record: dict) -> str:
    """One log line for a sync's ``summary``."""
    mib = record["bytes"] / 2**20
    return (
        f"fsdp2_ext: adapter sync at step {record['step']}: {record['tensors']} tensors, "
        f"{mib:.2f} MiB; gather {record['gather_s']:.2f} s, send {record['send_s']:.2f} s, "
        f"load {record['load_s']:.2f} s, check {record['check_s']:.2f} s; "
        f"{record['workers']} vLLM workers, modules checked in their slots {record['slot_checked']}"
        + (
            f", checked in the model only: {len(record['model_only'])}"
            if record["model_only"]
            else ""
        )
        + f": {record['result']}"
    )
