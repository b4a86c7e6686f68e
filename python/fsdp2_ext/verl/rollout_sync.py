"""VERL's vLLM rollout, patched so the adapter-only sync loads on the vLLM that serves Qwen4Exp and
is checked at every sync ([Note: every adapter sync checked], ``fsdp2_ext.vllm.adapter_sync``).

The modules patched here import vLLM, so their patches wait for VERL to import them ([Note:
patches that wait for their module], ``fsdp2_ext.common.patching.when_imported``), in whichever process
does: the trainer ranks (``ServerAdapter``), the server actor (``vLLMHttpServer``), the vLLM
workers (``VLLMHijack``, ``vLLMColocateWorkerExtension``), all of which import VERL and so its
external modules. What is replaced (verl 0.9.1, vLLM 0.32):

- ``verl.utils.vllm.utils.VLLMHijack.hijack``: installs ``fsdp2_ext.vllm.vllm_lora``'s loader in
  place of VERL's ``hijack__load_adapter`` ([Note: a tensor adapter loaded as vLLM loads a file]);
- ``vLLMColocateWorkerExtension.update_weights_from_ipc``: VERL's, then the worker's report
  ([Note: what a worker proves after a sync]) returned for an adapter sync;
- ``vLLMHttpServer.collective_rpc``: returns what the workers returned (VERL's drops it);
  ``vLLMHttpServer.generate``: refuses to generate without the adapter when the model has one;
- ``ServerAdapter.update_weights``: fingerprints what is sent, collects the reports, agrees on the
  verdict on every trainer rank, logs and records the sync (``adapter_sync_step<N>`` records).

A sync that is not adapter-only (a base sync, a merged adapter, a model without LoRA) runs
VERL's code unchanged.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext.common import log
from fsdp2_ext.common.patching import PatchSet, when_imported
from fsdp2_ext.common.run_report import write_record
from fsdp2_ext.vllm.adapter_sync import (
    WORK_PASSES,
    AdapterSync,
    check_mode,
    line,
    stop_or_warn,
    summary,
    verdict,
)

__all__ = ["VLLM_MODULES", "install"]

VLLM_UTILS = "verl.utils.vllm.utils"
WORKER_EXTENSION = "verl.workers.rollout.vllm_rollout.utils"
HTTP_SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server"
SERVER_ADAPTER = "verl.workers.rollout.vllm_rollout.vllm_rollout"
VLLM_MODULES = (VLLM_UTILS, WORKER_EXTENSION, HTTP_SERVER, SERVER_ADAPTER)
_PATCHES = {module: PatchSet() for module in VLLM_MODULES}

_gather_seconds = 0.0  # the last collect_lora_params in this process (timed by the shim's)


def record_gather(seconds: float) -> None:
    global _gather_seconds
    _gather_seconds = seconds


def _original(module: str, name: str):
    return _PATCHES[module].original(module, name)


def _is_adapter_sync(peft_config, base_sync_done) -> bool:
    return bool(peft_config) and bool(base_sync_done)


# -- the vLLM workers ------------------------------------------------------------------------


@_PATCHES[VLLM_UTILS].replaces(VLLM_UTILS, "VLLMHijack.hijack")
def hijack() -> None:
    """VERL's ``VLLMHijack.hijack`` with fsdp2_ext's loader: vLLM's own ``_load_adapter`` for
    file requests, ``load_tensor_adapter`` for VERL's tensor requests."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    from fsdp2_ext.vllm.vllm_lora import load_tensor_adapter

    vllm_load = WorkerLoRAManager._load_adapter  # vLLM's own (VERL set its on the LRU subclass)

    def _load_adapter(self, lora_request):
        return load_tensor_adapter(self, lora_request, vllm_load)

    _load_adapter.__fsdp2_ext__ = True
    LRUCacheWorkerLoRAManager._load_adapter = _load_adapter


_LOAD_ERROR = "_fsdp2_ext_load_error"


@_PATCHES[WORKER_EXTENSION].replaces(
    WORKER_EXTENSION, "vLLMColocateWorkerExtension.update_weights_from_ipc"
)
def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False):
    """VERL's, then (an adapter sync) what this worker holds, for the trainer to compare."""
    setattr(self, _LOAD_ERROR, None)
    _original(WORKER_EXTENSION, "vLLMColocateWorkerExtension.update_weights_from_ipc")(
        self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm
    )
    if not _is_adapter_sync(peft_config, base_sync_done):
        return None
    from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID

    from fsdp2_ext.vllm.vllm_lora import worker_report

    report = worker_report(self, VLLM_LORA_INT_ID)
    error = getattr(self, _LOAD_ERROR, None)
    if error is not None:  # what follows from it (nothing loaded, nothing registered) said once
        report["problems"] = [f"the adapter did not load: {error}"]
    return report


@_PATCHES[WORKER_EXTENSION].replaces(
    WORKER_EXTENSION, "vLLMColocateWorkerExtension._update_weights"
)
def _update_weights(self, weights, peft_config, base_sync_done):
    """VERL's; an adapter that fails to load is reported, not raised.

    [Note: a refused adapter must not strand the sender]
    VERL's receiver loads the adapter inside its callback for the last bucket and acknowledges
    that bucket only after the callback returns (``bucketed_weight_transfer.py:299-307``, the ack
    in ``_cleanup``, ``:350-353``); VERL's sender waits for it in a blocking ``recv``
    (``:160-161``) before the trainer rank ever awaits the worker's result. A loader that raises
    there (a refused adapter) would leave every trainer rank blocked forever. The error is kept
    and returned in the worker's report, after the ack, so the trainer ranks agree on it and stop
    with it ([Note: every adapter sync checked])."""
    verl_update = _original(WORKER_EXTENSION, "vLLMColocateWorkerExtension._update_weights")
    if not _is_adapter_sync(peft_config, base_sync_done):
        return verl_update(self, weights, peft_config, base_sync_done)
    try:
        return verl_update(self, weights, peft_config, base_sync_done)
    except Exception as error:
        log.error(
            f"fsdp2_ext: vLLM worker {getattr(self, 'rank', '?')}: adapter load failed: {error}"
        )
        setattr(self, _LOAD_ERROR, f"{type(error).__name__}: {error}")
        return None


# -- the server actor ------------------------------------------------------------------------


@_PATCHES[HTTP_SERVER].replaces(HTTP_SERVER, "vLLMHttpServer.collective_rpc")
async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
    """VERL's ``collective_rpc``, returning the workers' results (VERL's discards them)."""
    return await self.engine.collective_rpc(
        method=method, timeout=timeout, args=args, kwargs=kwargs
    )


@_PATCHES[HTTP_SERVER].replaces(HTTP_SERVER, "vLLMHttpServer.generate")
async def generate(self, *args, **kwargs):
    """VERL's ``generate``; with a LoRA adapter, never without it ([Note: every adapter sync
    checked])."""
    if self.lora_as_adapter:
        from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID

        if VLLM_LORA_INT_ID not in await self.engine.list_loras():
            stop_or_warn(
                f"fsdp2_ext: vLLM replica {self.replica_rank} was asked to generate at step "
                f"{self.global_steps} without the LoRA adapter (id {VLLM_LORA_INT_ID} is not loaded): "
                "VERL would have served the base model. The last adapter sync did not leave it "
                "loaded; see the sync's report"
            )
    return await _original(HTTP_SERVER, "vLLMHttpServer.generate")(self, *args, **kwargs)


# -- the trainer ranks -----------------------------------------------------------------------


@_PATCHES[SERVER_ADAPTER].replaces(SERVER_ADAPTER, "ServerAdapter.update_weights")
async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
    """VERL's ``update_weights``; an adapter-only sync is checked ([Note: every adapter sync
    checked]) and agreed on every trainer rank."""
    verl_update = _original(SERVER_ADAPTER, "ServerAdapter.update_weights")
    adapter = _is_adapter_sync(kwargs.get("peft_config"), kwargs.get("base_sync_done"))
    if wire_format != "named_tensors" or not adapter:
        return await verl_update(self, weights, global_steps=global_steps, wire_format=wire_format,
                                 **kwargs)  # fmt: skip
    rank = dist.get_rank() if dist.is_initialized() else 0
    sync = AdapterSync(global_steps, rank, self.replica_rank, self.rollout_rank,
                       gather_s=_gather_seconds)  # fmt: skip
    futures = []
    execute = self._execute_method

    async def capture(method, *args, **kw):  # the workers' reports: VERL awaits, then drops them
        future = await execute(method, *args, **kw)
        if method == "update_weights_from_ipc" and future is not None:
            futures.append(future)
        return future

    self._execute_method = capture
    try:
        await verl_update(self, sync.sending(weights, _fingerprint_device()),
                          global_steps=global_steps, wire_format=wire_format, **kwargs)  # fmt: skip
        if futures:
            sync.received(await futures[0])
    except Exception as error:  # brought to the agreement: every rank stops with it
        sync.error = f"{type(error).__name__}: {error}"
    finally:
        del self._execute_method
    _agree_and_report(sync)


def _fingerprint_device():
    """The trainer rank's GPU, where it has one ([Note: a tensor's fingerprint]: same result)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _agree_and_report(sync: AdapterSync) -> None:
    from fsdp2_ext.common.distributed import gather_objects

    start = time.monotonic()
    records = [sync]
    if dist.is_initialized() and dist.get_world_size() > 1:
        records = gather_objects(
            sync, None, "adapter sync check", _fsdp2_ext.wait_floor_s(),
            allow_bytes=WORK_PASSES * sync.bytes,
            allows_for=(f"rank 0 of each replica waiting for its vLLM workers to receive, copy, "
                        f"load and check the adapter ({WORK_PASSES} passes over its bytes)"),
        )  # fmt: skip
    problems = verdict(records)
    record = summary(records, problems, time.monotonic() - start)
    if sync.rank == 0:
        log.info(line(record))
        write_record(f"adapter_sync_step{sync.step}", record)
    if problems:
        stop_or_warn(
            f"fsdp2_ext: the adapter sync at step {sync.step} did not leave the rollout holding "
            f"the trainer's adapter: {'; '.join(problems[:20])}"
            + (f" (and {len(problems) - 20} more)" if len(problems) > 20 else "")
        )


def install() -> None:
    """Each patch set installs when VERL imports its module (now, if it has)."""
    check_mode()  # a bad knob fails at import, not at the first sync
    for module, patches in _PATCHES.items():
        when_imported(module, patches.install)
