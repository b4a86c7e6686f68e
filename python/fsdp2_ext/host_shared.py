"""Host-shared frozen tables: one node-local file-backed copy per host, mapped by every local rank.

Enabled by ``VERL_NO_PLACEMENT_MMAP_DIR`` (node-local disk, same path on every rank of a host).
The protocol, over the caller's CPU (Gloo) group, in order (file mechanics are C++; see
[Note: shm lifetime] in ``include/fsdp2_ext/host_shared_tensor.h``):

1. group ranks by host (hostname, or ``FSDP2_EXT_HOST_ID`` to simulate hosts); the lowest rank of
   each host leads; every rank checks the directory, one verdict for all;
2. leaders create a fresh file exclusively and reserve its bytes; one verdict;
3. leaders fill it: from their own tensors, or received from the source rank straight into the
   file's mapping (a leader of another host); one verdict;
4. leaders publish the manifest; every local rank maps the file read-only;
5. one bounded agreement on the mapping ([Note: bounded waits]; a rank that died is named where
   it can be) proves all have mapped; the leaders unlink the file whatever happened, then every
   rank raises the agreed verdict, if any (after the unlink). Not ``dist.monitored_barrier``: torch 2.11-2.13 refuse
   it unless ``get_backend(group) == "gloo"``, which VERL's ``cpu:gloo,cuda:nccl`` group is not.

Without the variable nothing here runs and each rank keeps its own CPU copy of every table: with
N local ranks that is N copies per host (docs/SPEC.md's 95.37 GiB table on 8 ranks: ~763 GiB of RAM).
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp2_ext import _fsdp2_ext, log

__all__ = ["ENV_DIRECTORY", "ENV_HOST_ID", "HostShareReport", "Pieces", "share_tables_on_host"]

ENV_DIRECTORY = "VERL_NO_PLACEMENT_MMAP_DIR"
ENV_HOST_ID = "FSDP2_EXT_HOST_ID"
_DEFAULTS = _fsdp2_ext.DEFAULTS  # the core's, stated once ([Note: bounded waits])
_CHUNK_BYTES = _DEFAULTS["bucket_bytes"]


@dataclass
class HostShareReport:
    path: str
    host: str
    leader: int
    local_ranks: list[int]
    file_bytes: int
    device: int = 0
    inode: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _host_id() -> str:
    return os.environ.get(ENV_HOST_ID) or socket.gethostname()


def _job_id() -> str:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RAY_JOB_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return "job"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


def _agree(group, verdict: str, what: str, timeout_s: float) -> None:
    verdict = _fsdp2_ext.agree_on_verdict(group, verdict, torch.device("cpu"), timeout_s)
    if verdict:
        raise RuntimeError(f"host-shared tables ({what}): {verdict}")


def _wait(work, group, peer: int | None, what: str, timeout_s: float, nbytes: int = 0) -> None:
    """``work.wait`` within the bound of [Note: bounded waits]; a failure names the peer."""
    bound = timeout_s + nbytes / _DEFAULTS["min_bandwidth_bytes_per_second"]
    try:
        work.wait(timeout=datetime.timedelta(seconds=bound))
    except Exception as error:
        rank = dist.get_rank(group)
        who = f"rank {peer}" if peer is not None else "one of the ranks"
        raise RuntimeError(
            f"rank {rank}: host-shared tables: {what}"
            + (f" with rank {peer}" if peer is not None else "")
            + f" failed within {bound:.0f} s: {error} -- {who} has most likely died or stopped"
        ) from error


def _gather_objects(obj, group, what: str, timeout_s: float) -> list:
    """``all_gather_object`` with bounded waits (pickled bytes, padded to the longest)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    work = dist.all_gather(sizes, torch.tensor([payload.numel()]), group=group, async_op=True)
    _wait(work, group, None, f"{what} (sizes)", timeout_s)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    work = dist.all_gather(gathered, padded, group=group, async_op=True)
    _wait(work, group, None, what, timeout_s, longest * world)
    return [pickle.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, sizes)]


@dataclass
class Pieces:
    """One table given as the pieces that make it, concatenated along dim 0 (e.g. the n-gram
    table's shards in a checkpoint, mapped): written into the shared file piece by piece, so the
    whole table never exists in anonymous memory. ``like`` gives the table's shape and dtype (the
    pieces are converted to it as they are written)."""

    tensors: list[torch.Tensor]
    like: torch.Tensor

    @property
    def is_meta(self) -> bool:
        return any(t.is_meta for t in self.tensors)

    def materialize(self) -> torch.Tensor:
        return torch.cat(self.tensors).to(self.like.dtype)


def _like(tensor) -> torch.Tensor:
    return tensor.like if isinstance(tensor, Pieces) else tensor


def share_tables_on_host(
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup,
    directory: str,
    source_rank: int = 0,
    timeout_s: float = _DEFAULTS["timeout_s"],
) -> tuple[list[torch.Tensor], HostShareReport]:
    """Maps one host-shared, read-only copy of each tensor on every rank of ``group``.

    ``tensors[i]`` holds the values on ``source_rank`` (and on any rank that has them, e.g. a
    mapped checkpoint; possibly as ``Pieces``); elsewhere it may be on meta and only gives dtype
    and shape. Returns the
    mapped tensors (same order) and a report (file, inode, local ranks).
    """
    start = time.perf_counter()
    rank = dist.get_rank(group)
    has_values = all(not t.is_meta for t in tensors)
    # 1. Hosts and leaders; directory checks on every rank.
    infos = _gather_objects(
        (_host_id(), has_values, os.getpid()), group, "finding hosts", timeout_s
    )
    host = infos[rank][0]
    local_ranks = [r for r, info in enumerate(infos) if info[0] == host]
    leader = local_ranks[0]
    leaders = sorted({min(r for r, i in enumerate(infos) if i[0] == info[0]) for info in infos})
    is_leader = rank == leader
    total = shared_file_bytes(
        names, [_like(t) for t in tensors]
    )  # the file's size, 64 KiB alignment padding included
    check = _fsdp2_ext.check_shared_directory(directory, total if is_leader else 0)
    note = check.note
    _agree(group, check.verdict, "directory check", timeout_s)
    report = HostShareReport(
        path="", host=host, leader=leader, local_ranks=local_ranks, file_bytes=0
    )
    if note and is_leader:
        log.warn(note)
        report.notes.append(note)

    # 2. Leaders create and reserve a fresh file.
    manifest, shared_file = None, None
    verdict = ""
    if is_leader:
        name = (
            f"fsdp2_ext-{_safe(_job_id())}-{_safe(host)}-{os.getpid()}-{secrets.token_hex(8)}.bin"
        )
        try:
            manifest = _fsdp2_ext.SharedManifest.plan(
                os.path.join(directory, name), list(names), [_like(t) for t in tensors]
            )
            shared_file = _fsdp2_ext.SharedFile.create(manifest)
        except Exception as error:  # every rank must hear of it, or they wait in _agree
            manifest = None
            verdict = f"rank {rank} on host {host}: {error}"
    path = manifest.path if manifest else ""
    try:
        _agree(group, verdict, "create", timeout_s)
        # 3. Fill: local values, or received from the source rank into the file's mapping.
        verdict = ""
        try:
            verdict = _fill(
                group, rank, leaders, infos, source_rank, shared_file, tensors, timeout_s
            )
        except Exception as error:  # a leader's failure must reach every rank
            verdict = f"rank {rank} on host {host}: {error}"
        if shared_file is not None:
            shared_file.close()
        _agree(group, verdict, "fill", timeout_s)
        # 4. Publish and map.
        manifests = _gather_objects(
            manifest.to_json() if manifest else None, group, "publishing the manifests", timeout_s
        )
        mine = _fsdp2_ext.SharedManifest.from_json(manifests[leader])
        mapped, verdict = [], ""
        try:
            mapped = _map_manifest(mine)
            stat = os.stat(mine.path)
            report.device, report.inode = stat.st_dev, stat.st_ino
        except Exception as error:
            verdict = f"rank {rank} on host {host}: {error}"
        # 5. Everyone has mapped (or said why not) within the bound; unlinked whatever it says.
        _agree(group, verdict, "map", timeout_s)
    finally:
        if shared_file is not None:
            shared_file.close()
        if is_leader and path:
            try:
                _fsdp2_ext.unlink_shared_file(path)
            except OSError as error:  # never hide the error that brought us here
                log.error(f"could not unlink {path}: {error}")
    report.path = mine.path
    report.file_bytes = mine.file_bytes
    report.seconds = time.perf_counter() - start
    return mapped, report


def shared_file_bytes(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the host-shared file for these tensors (the layout ``SharedManifest.plan`` gives)."""
    return _fsdp2_ext.SharedManifest.plan("", list(names), list(tensors)).file_bytes


def _map_manifest(manifest) -> list[torch.Tensor]:
    return _fsdp2_ext.map_shared_file(manifest)


def _write_pieces(shared_file, index: int, pieces: Pieces) -> None:
    like = pieces.like
    target = shared_file.map_writable(index).view(like.dtype).view(like.shape)
    row = 0
    for piece in pieces.tensors:
        target[row : row + piece.shape[0]].copy_(piece)
        row += piece.shape[0]
    if row != like.shape[0]:
        raise ValueError(f"table entry {index}: the pieces hold {row} rows, not {like.shape[0]}")
    del target  # unmaps; the data is in the file


def _fill(group, rank, leaders, infos, source_rank, shared_file, tensors, timeout_s) -> str:
    """Leaders with values write them; the source rank sends to leaders without values."""
    needs = [leader for leader in leaders if not infos[leader][1]]
    if not infos[source_rank][1] and needs:
        return f"rank {source_rank} (the source) holds no values for the tables"
    for index, tensor in enumerate(tensors):
        if shared_file is not None and infos[rank][1]:
            if isinstance(tensor, Pieces):
                _write_pieces(shared_file, index, tensor)
            else:
                shared_file.write(index, tensor)
        if rank == source_rank and needs:
            tensor = tensor.materialize() if isinstance(tensor, Pieces) else tensor
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            for leader in needs:
                for offset in range(0, flat.numel(), _CHUNK_BYTES):
                    chunk = flat[offset : offset + _CHUNK_BYTES]
                    work = dist.isend(chunk, group_dst=leader, group=group)
                    _wait(work, group, leader, "sending a table", timeout_s, chunk.numel())
        elif rank in needs:
            target = shared_file.map_writable(index)
            for offset in range(0, target.numel(), _CHUNK_BYTES):
                chunk = target[offset : offset + _CHUNK_BYTES]
                work = dist.irecv(chunk, group_src=source_rank, group=group)
                _wait(work, group, source_rank, "receiving a table", timeout_s, chunk.numel())
            del target  # unmaps; the data is in the file
    return ""
