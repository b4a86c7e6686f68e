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
5. one bounded agreement on the mapping proves all have mapped; the leaders unlink the file
   whatever happened, then every rank raises the agreed verdict, if any (after the unlink). Not
   ``dist.monitored_barrier``: torch 2.11-2.13 refuse it unless ``get_backend(group) == "gloo"``,
   which VERL's ``cpu:gloo,cuda:nccl`` group is not.

Every wait is bounded ([Note: bounded waits]): by the floor plus the bytes the awaited ranks must
write, read or send before they can arrive, from what every rank knows after step 1 (which ranks
hold values, every table's size): "create" allows for the leaders reserving the file, "fill" for
the slowest leader's writes and sends (the source's: its own file, assembling ``Pieces`` to send,
every send), and each receiving leader's first chunk of a table for what the source does before
it sends that chunk. A rank that died is named where it can be.

Without the variable nothing here runs and each rank keeps its own CPU copy of every table: with
N local ranks that is N copies per host (docs/SPEC.md's 95.37 GiB table on 8 ranks: ~763 GiB of RAM).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext.common import log
from fsdp2_ext.common.distributed import bounded_wait, gather_objects, host_id
from fsdp2_ext.tables.table_digest import digest_tables
from fsdp2_ext.tables.table_service import serve_tables

__all__ = [
    "ENV_DIRECTORY",
    "HostShareReport",
    "Pieces",
    "share_tables_on_host",
]

ENV_DIRECTORY = "VERL_NO_PLACEMENT_MMAP_DIR"
_STAGE = "host-shared tables"  # what a failed wait names
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
    bytes_received: int = 0  # by this rank, from the source rank (a leader without values)
    bytes_sent: int = 0  # by this rank (the source) to leaders without values
    served: list[str] = field(default_factory=list)  # the leader's: digests of tables it serves


def _job_id() -> str:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RAY_JOB_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return "job"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


def _agree(
    group, verdict: str, what: str, timeout_s: float, allow_bytes: int = 0, allows_for: str = ""
) -> None:
    verdict = _fsdp2_ext.agree_on_verdict(
        group, verdict, torch.device("cpu"), timeout_s, allow_bytes=allow_bytes,
        allows_for=allows_for, stage=f"host-shared tables: {what}",
    )  # fmt: skip
    if verdict:
        raise RuntimeError(f"host-shared tables ({what}): {verdict}")


@dataclass
class Pieces:
    """One table given as the pieces that make it, concatenated along dim 0 (e.g. the n-gram
    table's shards in a checkpoint, mapped): written into the shared file piece by piece, so the
    whole table never exists in anonymous memory. ``like`` gives the table's shape and dtype (the
    pieces are converted to it as they are written)."""

    tensors: list[torch.Tensor]
    like: torch.Tensor
    key: dict | None = None  # what the bytes are (``table_service.table_key``): served if set

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
    timeout_s: float | None = None,
    lead_bytes: int = 0,
    lead_work: str = "",
) -> tuple[list[torch.Tensor], HostShareReport]:
    """Maps one host-shared, read-only copy of each tensor on every rank of ``group``.

    ``tensors[i]`` holds the values on ``source_rank`` (and on any rank that has them, e.g. a
    mapped checkpoint; possibly as ``Pieces``); elsewhere it may be on meta and only gives dtype
    and shape. Returns the
    mapped tensors (same order) and a report (file, inode, local ranks). ``timeout_s``: the floor
    of every wait (None: ``$FSDP2_EXT_WAIT_FLOOR_S`` or 60 s, [Note: wait knobs]);
    ``lead_bytes``: the work (``lead_work``) other ranks may still do before they call this, the
    same on every rank, allowed for in the first wait.
    """
    start = time.perf_counter()
    timeout_s = _fsdp2_ext.wait_floor_s() if timeout_s is None else timeout_s
    rank = dist.get_rank(group)
    has_values = all(not t.is_meta for t in tensors)
    # 1. Hosts and leaders; directory checks on every rank.
    infos = gather_objects(
        (host_id(), has_values, os.getpid()), group, f"{_STAGE}: finding hosts", timeout_s, lead_bytes,
        lead_work,
    )  # fmt: skip
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
    work = _FillWork(infos, leaders, source_rank, [_like(t) for t in tensors])
    try:
        _agree(group, verdict, "create", timeout_s, total, "the leaders reserving their files")
        # 3. Fill: local values, or received from the source rank into the file's mapping.
        verdict = ""
        try:
            verdict = _fill(group, rank, work, shared_file, tensors, timeout_s)
        except Exception as error:  # a leader's failure must reach every rank
            verdict = f"rank {rank} on host {host}: {error}"
        if shared_file is not None:
            shared_file.close()
        _agree(group, verdict, "fill", timeout_s, *work.slowest_leader())
        # 4. Publish and map.
        manifests = gather_objects(
            manifest.to_json() if manifest else None,
            group,
            f"{_STAGE}: publishing the manifests",
            timeout_s,
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
        # 6. The hosts' tables are the same bytes, every one ([Note: hosts agree on every byte of
        # their tables]), before any rank uses its table.
        _agree_on_digests(group, is_leader, host, mapped, timeout_s)
        if is_leader:  # before the unlink: [Note: the trainer's table served to the rollout]
            report.served = serve_tables(mine, [getattr(t, "key", None) for t in tensors])
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
    report.bytes_received, report.bytes_sent = work.bytes_received, work.bytes_sent
    report.seconds = time.perf_counter() - start
    return mapped, report


def _agree_on_digests(group, is_leader: bool, host: str, mapped, timeout_s: float) -> None:
    """Every leader digests its host's tables; every rank raises the same error if they differ."""
    digest = ""
    if is_leader:
        try:
            digest = digest_tables(mapped)
        except Exception as error:  # every rank must hear of it
            digest = f"failed: {error}"
    digests = gather_objects(
        (host, digest if is_leader else None), group, f"{_STAGE}: agreeing on the tables' digests", timeout_s,
        sum(t.nbytes for t in mapped), "each host's leader reading its tables to digest them",
    )  # fmt: skip
    by_digest: dict[str, list[str]] = {}
    ranks: dict[str, list[int]] = {}
    for rank_, (host_, digest_) in enumerate(digests):
        ranks.setdefault(host_, []).append(rank_)
        if digest_ is not None:
            by_digest.setdefault(digest_, []).append(host_)
    if len(by_digest) > 1:
        hosts = "; ".join(
            f"{', '.join(f'{h} (ranks {ranks[h]})' for h in hs)}: {d[:16]}"
            for d, hs in by_digest.items()
        )
        raise RuntimeError(
            f"rank {dist.get_rank(group)}: host-shared tables: the hosts' tables are not the same "
            f"bytes ({hosts}): each host's leader wrote its table from its own copy of the "
            "checkpoint (or state), and those copies differ. Fix: give every host the same "
            "checkpoint files (compare them: sha256sum), or load with FSDP2_EXT_INIT_SOURCE=rank0 "
            "(rank 0 reads the checkpoint and sends its table to the other hosts)"
        )


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


@dataclass
class _FillWork:
    """What each leader writes and sends in the fill, as every rank knows it after "finding hosts"
    (the bounds of [Note: bounded waits] are computed from it)."""

    infos: list
    leaders: list[int]
    source_rank: int
    likes: list[torch.Tensor]
    bytes_received: int = 0
    bytes_sent: int = 0

    @property
    def needs(self) -> list[int]:
        """The leaders without values: they receive from the source rank."""
        return [leader for leader in self.leaders if not self.infos[leader][1]]

    @property
    def _source_passes(self) -> int:
        """How often the source goes over each table before sending it: writing its own host's
        file (when it leads a host and holds values), then reading it to send."""
        writes = self.infos[self.source_rank][1] and self.source_rank in self.leaders
        return (1 if writes else 0) + 1

    def _source_bytes_before(self, index: int, receiver: int) -> int:
        """What the source does before it sends table ``index``'s first chunk to ``receiver``:
        every earlier table written, assembled and sent to everyone, then this one written and
        assembled, and sent to the receivers before ``receiver``."""
        sizes = [t.nbytes for t in self.likes]
        per_table = [size * self._source_passes for size in sizes]
        before = sum(per_table[:index]) + sum(sizes[:index]) * len(self.needs)
        return before + per_table[index] + sizes[index] * self.needs.index(receiver)

    def first_chunk(self, index: int, receiver: int) -> tuple[int, str]:
        return (
            self._source_bytes_before(index, receiver),
            f"rank {self.source_rank} writing, assembling and sending the tables before it",
        )

    def slowest_leader(self) -> tuple[int, str]:
        """The fill's last arrival: the source when it sends (everything it writes, assembles and
        sends), else any leader writing its whole file."""
        total = sum(t.nbytes for t in self.likes)
        if self.needs:
            return (
                total * (self._source_passes + len(self.needs)),
                f"rank {self.source_rank} writing its host's file, reading the tables and sending "
                f"{len(self.needs)} copies of them",
            )
        return total, "each leader writing its host's file"


def _fill(group, rank, work: _FillWork, shared_file, tensors, timeout_s) -> str:
    """Leaders with values write them; the source rank sends to leaders without values."""
    infos, source_rank, needs = work.infos, work.source_rank, work.needs
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
                    work_ = dist.isend(chunk, group_dst=leader, group=group)
                    bounded_wait(
                        work_, group, leader, f"{_STAGE}: sending a table", timeout_s, chunk.numel()
                    )
                    work.bytes_sent += chunk.numel()
        elif rank in needs:
            target = shared_file.map_writable(index)
            lead, lead_work = work.first_chunk(index, rank)
            for offset in range(0, target.numel(), _CHUNK_BYTES):
                chunk = target[offset : offset + _CHUNK_BYTES]
                work_ = dist.irecv(chunk, group_src=source_rank, group=group)
                bounded_wait(
                    work_, group, source_rank, f"{_STAGE}: receiving a table", timeout_s,
                    chunk.numel() + (lead if offset == 0 else 0),
                    lead_work if offset == 0 else "",
                )  # fmt: skip
                work.bytes_received += chunk.numel()
            del target  # unmaps; the data is in the file
    return ""
