"""Where the frozen no-placement tables live: the one placement policy, for every process.

    place_tables(registrations, TableValues(views, values, values_on="rank0"), group=..., ...)

In order of preference, each table becomes:

1. a read-only view of the model checkpoint file, when the checkpoint stores it as the model needs
   it ([Note: zero-copy tables]): no copy, the page cache's one per host;
2. else, with a host-shared directory (``VERL_NO_PLACEMENT_MMAP_DIR``) and a process group, a view
   of one file-backed copy per host (``fsdp2_ext.tables.host_shared``);
3. else, with a process group, every rank's own copy: rank 0's values broadcast, or each rank's
   when every rank holds them (``values_on="every rank"``);
4. else (a process of its own, the ``hf`` rollout server) the table it already holds.

The registered parameter objects stay the same objects throughout (``swap_tensors``). The trainer's
sharded init calls ``place_tables``; the rollout servers call ``view_tables_from_checkpoint``,
which is ``place_tables`` without a group. The rank-0 path takes views too, where rank 0's values
are the checkpoint's bytes (``views_equal_to_rank0``, [Note: rank-0 tables from the checkpoint]).

[Note: rank-0 tables from the checkpoint]
In the rank-0 path (rank 0 built the model from ``model.path``, which every rank opened for ties),
a table that ``table_view`` accepts on every rank becomes that view on every rank, as in the
checkpoint path, but only when rank 0's value is the view's bytes: rank 0 compares them (at about
the copy rate) before it drops its own copy. Whatever built rank 0's model (a dtype cast, a
conversion, a user's change) is thereby honoured: a table whose bytes differ, or that some rank
cannot view, keeps the placement below (logged with the reason, rank 0's values sent). This
replaces rank 0's broadcast or host-shared file write (for the 95 GiB table, a second host-wide
copy) by the page cache's one. The views are agreed before any data moves, so the host-shared
directory (``VERL_NO_PLACEMENT_MMAP_DIR``) is judged for the other tables only, as in the
checkpoint path: when every table is a view, no file is written and the directory is not judged.
Ranks on other hosts map their own host's file at ``model.path``, which they trust to hold the
same bytes as in the checkpoint path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext.checkpoint.model_checkpoint import ModelCheckpoint
from fsdp2_ext.common import log
from fsdp2_ext.model.no_placement import NoPlacementParam, find_no_placement_params
from fsdp2_ext.tables.host_shared import (
    ENV_DIRECTORY,
    HostShareReport,
    Pieces,
    share_tables_on_host,
    shared_file_bytes,
)

__all__ = [
    "TableValues",
    "host_shared_directory",
    "meta_like",
    "place_tables",
    "shared_directory_problem",
    "table_view",
    "view_tables_from_checkpoint",
    "views_equal_to_rank0",
]


@dataclass
class TableValues:
    """Where each table's values come from: ``views`` of the checkpoint file (FQN -> tensor), and
    ``values`` (FQN -> tensor or ``Pieces``) held on rank 0 (``values_on="rank0"``) or on every
    rank (``"every rank"``)."""

    views: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor | Pieces] = field(default_factory=dict)
    values_on: str = "rank0"


def host_shared_directory(explicit: str | None = None) -> str | None:
    """The host-shared directory: the caller's, else ``VERL_NO_PLACEMENT_MMAP_DIR``, else None."""
    return explicit or os.environ.get(ENV_DIRECTORY) or None


def shared_directory_problem(directory: str | None, tables: list[NoPlacementParam]) -> str:
    """Why ``directory`` cannot hold these tables' host-shared files ("" when it can, or when
    there is nothing to share); checked on every rank before any data moves."""
    if not directory or not tables:
        return ""
    return _fsdp2_ext.check_shared_directory(
        directory, shared_file_bytes([t.fqn for t in tables], [t.param for t in tables])
    ).verdict


def table_view(
    checkpoint: ModelCheckpoint, names: list[str], like: torch.Tensor
) -> tuple[torch.Tensor | None, str]:
    """(a view of the mapped checkpoint to use as the table, "") or (None, why not); ``names``
    are the table's FQN and aliases. See [Note: zero-copy tables]."""
    found = checkpoint.tensor_for(names)
    if found is None:
        return None, f"{names[0]} is not in the checkpoint"
    kind, name = found
    if kind != "direct":
        how = checkpoint.converted.get(name) or checkpoint.sliced.get(name)
        return None, f"the checkpoint stores it in pieces ({how})"
    tensor = checkpoint.direct[name]
    if tensor.dtype != like.dtype:
        return None, f"the checkpoint stores {tensor.dtype}, the model needs {like.dtype}"
    if tuple(tensor.shape) != tuple(like.shape):
        return None, f"the checkpoint's shape {tuple(tensor.shape)} is not {tuple(like.shape)}"
    if not tensor.is_contiguous():
        return None, f"it is a strided view of {checkpoint.direct_keys[name]}"
    network = checkpoint.network_filesystem
    if network:
        return None, f"{checkpoint.directory} is on {network}, not a local disk"
    return tensor, ""


def meta_like(target) -> torch.Tensor:
    """A meta tensor with a ``TargetSpec``'s global shape and dtype."""
    return torch.empty(target.shape, dtype=target.dtype, device="meta")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaN payloads included);
    compared eight bytes at a time where the storage allows (about the copy rate; torch.equal on
    bf16 measured 3.5x slower)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    whole = a.numel() // 8 * 8
    try:
        head = torch.equal(a[:whole].view(torch.int64), b[:whole].view(torch.int64))
    except RuntimeError:  # a storage offset not 8-byte aligned: compare bytes
        return torch.equal(a, b)
    return head and torch.equal(a[whole:], b[whole:])


def views_equal_to_rank0(
    tables: list,
    values: TableValues,
    checkpoint: ModelCheckpoint | None,
    *,
    group: dist.ProcessGroup,
    timeout_s: float,
) -> TableValues:
    """The rank-0 path's table values with a checkpoint view for each table that every rank can
    view and whose bytes rank 0's value equals ([Note: rank-0 tables from the checkpoint]).
    ``tables``: ``TargetSpec``s (FQN, aliases, shape, dtype), the same list on every rank; one
    agreement per table on ``group``."""
    rank = dist.get_rank(group)
    views, rest = dict(values.views), dict(values.values)
    for table in tables:
        if checkpoint is None:
            view, reason = None, "no checkpoint was opened on this rank"
        else:
            view, reason = table_view(checkpoint, [table.fqn, *table.aliases], meta_like(table))
        if view is not None and rank == 0:
            value = values.values.get(table.fqn)
            if not isinstance(value, torch.Tensor) or not _same_bytes(value, view):
                view, reason = None, "rank 0's value is not the checkpoint's bytes"
        reason = _fsdp2_ext.agree_on_verdict(
            group, f"rank {rank}: {reason}" if view is None else "", torch.device("cpu"), timeout_s,
            allow_bytes=meta_like(table).nbytes, allows_for="rank 0 comparing the table's bytes",
            stage=f"no-placement table {table.fqn}: agreeing on its view",
        )  # fmt: skip
        if reason:
            if rank == 0:
                say = log.info if checkpoint is not None else log.debug
                say(f"no-placement table {table.fqn} is placed from rank 0's value, not a view "
                    f"of the checkpoint: {reason}")  # fmt: skip
            continue
        views[table.fqn] = view
        rest.pop(table.fqn, None)
    return TableValues(views=views, values=rest, values_on=values.values_on)


def _adopt(registration: NoPlacementParam, tensor: torch.Tensor) -> None:
    torch.utils.swap_tensors(registration.param, nn.Parameter(tensor, requires_grad=False))


def place_tables(
    registrations: list[NoPlacementParam],
    values: TableValues,
    *,
    group: dist.ProcessGroup | None,
    directory: str | None,
    bucket_bytes: int,
    timeout_s: float,
    lead_bytes: int = 0,
) -> HostShareReport | None:
    """Places every registered table by the policy above; returns the host-share report when a
    host-shared file was used. ``lead_bytes``: the work other ranks may still do before they
    come here (the same on every rank), allowed for in the first wait ([Note: bounded waits])."""
    for registration in registrations:
        if registration.fqn in values.views:
            _adopt(registration, values.views[registration.fqn])
    rest = [r for r in registrations if r.fqn not in values.views]
    if not rest or group is None:
        return None
    if directory:
        return _share_on_host(rest, values.values, group, directory, timeout_s, lead_bytes)
    rank = dist.get_rank(group)
    for registration in rest:
        value = values.values.get(registration.fqn)
        # The first chunk allows for what rank 0 does before it sends: assembling the table.
        lead = lead_bytes + (registration.param.nbytes if isinstance(value, Pieces) else 0)
        lead_bytes = 0
        if isinstance(value, Pieces):  # a table stored in shards: rank 0 concatenates them
            value = value.materialize() if rank == 0 else None
        if values.values_on == "every rank" or rank == 0:
            param = registration.param
            if param.is_meta or value.data_ptr() != param.data_ptr():
                _adopt(registration, value.contiguous())
            if values.values_on == "every rank":
                continue
        elif registration.param.is_meta:
            _adopt(registration, torch.empty_like(registration.param, device="cpu"))
        _fsdp2_ext.broadcast_in_chunks(
            group, registration.param.data, chunk_bytes=bucket_bytes, root=0, timeout_s=timeout_s,
            lead_bytes=lead,
        )  # fmt: skip
    return None


def _share_on_host(
    registrations, values, group, directory, timeout_s, lead_bytes
) -> HostShareReport:
    """Every rank ends up with the same registered parameter objects, now views of one read-only
    file mapping per host (values from whichever ranks hold them)."""
    # Only the given values count: a rank's own (possibly freshly initialised) table does not, so
    # another host's leader receives rank 0's values instead of writing its own.
    tensors = [values.get(r.fqn, torch.empty_like(r.param, device="meta")) for r in registrations]
    mapped, report = share_tables_on_host(
        [r.fqn for r in registrations], tensors, group=group, directory=directory,
        timeout_s=timeout_s, lead_bytes=lead_bytes, lead_work="every rank copying its rows",
    )  # fmt: skip
    for registration, tensor in zip(registrations, mapped):
        _adopt(registration, tensor)
    return report


def view_tables_from_checkpoint(model: nn.Module, path: str, *, who: str) -> list[NoPlacementParam]:
    """In a process of its own: makes each no-placement table of ``model`` a read-only view of
    the checkpoint at ``path`` where it can be one; returns the tables that keep their own copy
    (each reason logged)."""
    tables = find_no_placement_params(model)
    if not tables:
        return []
    source = ModelCheckpoint.open(model, path, fqns=[t.fqn for t in tables])
    views, remaining = {}, []
    for table in tables:
        view, reason = table_view(source, [table.fqn], table.param)
        if view is None:
            log.info(f"{who}: table {table.fqn} is a private copy, not a view of {path}: {reason}")
            remaining.append(table)
        else:
            views[table.fqn] = view
    place_tables(tables, TableValues(views=views), group=None, directory=None, bucket_bytes=0,
                 timeout_s=0)  # fmt: skip
    return remaining
