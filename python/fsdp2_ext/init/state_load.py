"""The load plans of the two full-state init sources: what ``fill_sharded`` does for each.

Every plan answers the same four questions (``model_checkpoint_load.CheckpointLoad`` too, for the
``checkpoint`` init source):

- ``verdict()``: this rank's problems with its inputs ("" = none), before any data moves;
- ``load(group, device=, bucket_bytes=, timeout_s=)``: every target's local tensor (padded
  Shard(0) rows, or a replica), bytes received, bytes sent;
- ``table_values()``: where the no-placement tables' values are (``TableValues``);
- ``tables_to_share()``: the tables that need a host-shared file (not views of the checkpoint);

and after ``load`` its ``load_seconds``: "load.<part>" -> seconds, where a load has parts.

``Rank0Load`` (init source ``rank0``): rank 0 holds the full state and sends each rank its rows
([Note: rank-0 transfer]). ``LocalLoad`` (``local``): every rank sees a full state (a mapped
checkpoint) and copies its own rows.

On a 2-D (HSDP) mesh every plan also says ``replica_indices()``: the targets a replica that does
not lead (``leads=False``: ``ddp`` coordinate above 0) cannot load itself and receives from its
leader along ``ddp`` ([Note: HSDP loads] in ``replica_broadcast.py``); its ``load`` leaves them
allocated, to be received in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext._fsdp2_ext import TargetSpec
from fsdp2_ext.model.no_placement import NoPlacementParam
from fsdp2_ext.tables.table_placement import TableValues

__all__ = ["LocalLoad", "Rank0Load", "empty_loaded", "state_lists"]


def empty_loaded(target: TargetSpec, group, device) -> torch.Tensor:
    """An uninitialised tensor shaped as the loaders return ``target`` on this rank of ``group``:
    its padded Shard(0) rows, or the whole of a replicated one."""
    import torch.distributed as dist

    shape = list(target.shape)
    if target.placement == _fsdp2_ext.Placement.SHARD0:
        split = _fsdp2_ext.shard_rows(shape[0], dist.get_world_size(group), dist.get_rank(group))
        shape[0] = split.padded_rows
    return torch.empty(shape, dtype=target.dtype, device=device)


def state_lists(state: Mapping[str, torch.Tensor] | None) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of a full state; TypeError naming the first entry that is not a dense
    tensor under a string name."""
    if state is None:
        return [], []
    if not isinstance(state, Mapping):
        raise TypeError(
            f"full_state must be a mapping of name -> tensor, got {type(state).__name__}"
        )
    names = list(state.keys())
    tensors = [state[name] for name in names]
    for name, tensor in zip(names, tensors):
        if not isinstance(name, str):
            raise TypeError(f"full_state has a key {name!r} that is not a string")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"full_state[{name!r}] is {type(tensor).__name__}, not a tensor")
        if tensor.layout != torch.strided:
            raise TypeError(
                f"full_state[{name!r}] has layout {tensor.layout}; pass a dense tensor "
                "(.to_dense())"
            )
    return names, tensors


@dataclass
class Rank0Load:
    """Init source ``rank0``: rank 0's full state, each rank sent its rows."""

    targets: list[TargetSpec]
    tables: list[TargetSpec]
    registrations: list[NoPlacementParam]
    canonical: dict[str, str]  # alias FQN -> the name its group is loaded under
    names: list[str]
    tensors: list[torch.Tensor]
    holds_state: bool  # this rank has the full state (rank 0; every rank for ``local``)
    leads: bool = True  # this rank's replica loads from rank 0 (always, on a 1-D mesh)
    load_seconds: dict[str, float] = field(default_factory=dict)  # one C++ call: no parts

    loader = staticmethod(_fsdp2_ext.load_from_rank0)
    values_on = "rank0"
    every_replica_reads = False  # only rank 0 holds the values ([Note: HSDP loads])

    @classmethod
    def plan(
        cls, targets, tables, registrations, canonical, full_state, *, holds_state: bool,
        leads: bool = True,
    ):  # fmt: skip
        names, tensors = state_lists(full_state if holds_state else None)
        leads = leads or cls.every_replica_reads
        return cls(targets, tables, registrations, canonical, names, tensors, holds_state, leads)

    def replica_indices(self) -> list[int]:
        """Every target: only rank 0 has the values, and only the leading replica hears it."""
        return list(range(len(self.targets)))

    def verdict(self) -> str:
        if not self.holds_state:
            return ""
        return _fsdp2_ext.describe_state_mismatch(
            self.targets + self.tables, self.names, self.tensors
        )

    def _is_table(self, name: str) -> bool:
        return self.canonical.get(name, name) in {t.fqn for t in self.tables}

    def load(self, group, *, device, bucket_bytes: int, timeout_s: float):
        if not self.leads:  # received from the leading replica ([Note: HSDP loads])
            return [empty_loaded(t, group, device) for t in self.targets], 0, 0
        kept = [(n, t) for n, t in zip(self.names, self.tensors) if not self._is_table(n)]
        result = self.loader(
            group,
            self.targets,
            [n for n, _ in kept],
            [t for _, t in kept],
            bucket_bytes=bucket_bytes,
            device=device,
            timeout_s=timeout_s,
        )
        return result.tensors, result.bytes_received, result.bytes_sent

    def table_values(self) -> TableValues:
        values = {
            self.canonical.get(n, n): t
            for n, t in zip(self.names, self.tensors)
            if self._is_table(n)
        }
        return TableValues(values=values, values_on=self.values_on)

    def tables_to_share(self) -> list[NoPlacementParam]:
        return list(self.registrations)


class LocalLoad(Rank0Load):
    """Init source ``local``: a full state every rank sees; each copies its own rows."""

    loader = staticmethod(_fsdp2_ext.load_from_local)
    values_on = "every rank"
    every_replica_reads = True

    def replica_indices(self) -> list[int]:
        return []
