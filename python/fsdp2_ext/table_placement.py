"""Where the frozen no-placement tables live: the one placement policy, for every process.

    place_tables(registrations, TableValues(views, values, values_on="rank0"), group=..., ...)

In order of preference, each table becomes:

1. a read-only view of the model checkpoint file, when the checkpoint stores it as the model needs
   it ([Note: zero-copy tables]): no copy, the page cache's one per host;
2. else, with a host-shared directory (``VERL_NO_PLACEMENT_MMAP_DIR``) and a process group, a view
   of one file-backed copy per host (``fsdp2_ext.host_shared``);
3. else, with a process group, every rank's own copy: rank 0's values broadcast, or each rank's
   when every rank holds them (``values_on="every rank"``);
4. else (a process of its own, the ``hf`` rollout server) the table it already holds.

The registered parameter objects stay the same objects throughout (``swap_tensors``). The trainer's
sharded init calls ``place_tables``; the rollout servers call ``view_tables_from_checkpoint``,
which is ``place_tables`` without a group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext import _fsdp2_ext, log
from fsdp2_ext.host_shared import (
    ENV_DIRECTORY,
    HostShareReport,
    Pieces,
    share_tables_on_host,
    shared_file_bytes,
)
from fsdp2_ext.model_checkpoint import NETWORK_FILESYSTEMS, ModelCheckpoint
from fsdp2_ext.no_placement import NoPlacementParam, find_no_placement_params

__all__ = [
    "TableValues",
    "host_shared_directory",
    "place_tables",
    "shared_directory_problem",
    "table_view",
    "view_tables_from_checkpoint",
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
    if checkpoint.filesystem in NETWORK_FILESYSTEMS:
        return None, f"{checkpoint.directory} is on {checkpoint.filesystem}, not a local disk"
    return tensor, ""


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
) -> HostShareReport | None:
    """Places every registered table by the policy above; returns the host-share report when a
    host-shared file was used."""
    for registration in registrations:
        if registration.fqn in values.views:
            _adopt(registration, values.views[registration.fqn])
    rest = [r for r in registrations if r.fqn not in values.views]
    if not rest or group is None:
        return None
    if directory:
        return _share_on_host(rest, values.values, group, directory, timeout_s)
    rank = dist.get_rank(group)
    for registration in rest:
        value = values.values.get(registration.fqn)
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
            group, registration.param.data, chunk_bytes=bucket_bytes, root=0, timeout_s=timeout_s
        )
    return None


def _share_on_host(registrations, values, group, directory, timeout_s) -> HostShareReport:
    """Every rank ends up with the same registered parameter objects, now views of one read-only
    file mapping per host (values from whichever ranks hold them)."""
    # Only the given values count: a rank's own (possibly freshly initialised) table does not, so
    # another host's leader receives rank 0's values instead of writing its own.
    tensors = [values.get(r.fqn, torch.empty_like(r.param, device="meta")) for r in registrations]
    mapped, report = share_tables_on_host(
        [r.fqn for r in registrations], tensors, group=group, directory=directory,
        timeout_s=timeout_s,
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
