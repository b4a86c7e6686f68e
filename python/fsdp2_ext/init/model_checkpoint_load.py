"""Filling a prepared (meta, sharded) model straight from a checkpoint directory.

``prepare_sharded(..., checkpoint=path)`` then ``fill_sharded(..., source="checkpoint")`` plans
every tensor by where the checkpoint has it ([Note: checkpoint key resolution]) and loads:

- ``direct`` and ``sliced`` tensors: every rank copies only its own rows from the mapped files,
  converting the dtype as it copies (no rank holds the full model, nothing is sent);
- ``converted`` tensors and those the checkpoint lacks (``missing``: LoRA adapters, and what
  [Note: missing tensors] lets through): rank 0 builds them (Transformers' conversion; its own
  initialised value) and sends the rows. A missing parameter still on meta on rank 0 (a new head
  of a meta-built model) is first initialised there by ``initialise_missing``: its module is
  materialised and Transformers' ``_init_weights`` runs on it, as ``from_pretrained`` does;
- no-placement tables: see [Note: zero-copy tables].

[Note: zero-copy tables]
A frozen no-placement table that the checkpoint stores as one tensor with the model's dtype and
shape, in a file on a local filesystem, becomes a read-only view of the mapped checkpoint file on
every rank: no temporary file, no copy; the page cache holds the host's one copy, shared by every
process that maps the file (the trainer's ranks and a rollout replica alike). Any other table
(another dtype, concatenated from shards, on a network filesystem) takes the host-shared file path
(``VERL_NO_PLACEMENT_MMAP_DIR``) or, without it, a per-rank copy; the reason is logged. The
decision is agreed over the group table by table (``agree_views``): a table is a view only where
every rank can view it, since a host whose copy is on NFS while another's is on local disk would
otherwise send some ranks into host sharing's collectives and leave the others out. A table
stored in shards (qwen4_exp's ``ngram_embedding.shard_*``), or stored whole but not viewable (in
another dtype, or on a network filesystem), is written into the host-shared file piece by piece
from each host's own mapping of the checkpoint by that host's leader (``host_shared.Pieces``,
converted as it is written): no table crosses the network when every host can read it, and no
rank concatenates it in memory, which for the 95 GiB table would be a second full copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext._fsdp2_ext import Placement, TargetSpec
from fsdp2_ext.checkpoint.model_checkpoint import (
    AllowMissing,
    ModelCheckpoint,
    _hf_model,
    release_pages,
)
from fsdp2_ext.common import log
from fsdp2_ext.common.stopwatch import Stopwatch
from fsdp2_ext.init.state_load import empty_loaded
from fsdp2_ext.tables.host_shared import Pieces
from fsdp2_ext.tables.table_placement import TableValues, meta_like, table_view
from fsdp2_ext.tables.table_service import table_key

__all__ = [
    "CheckpointLoad",
    "adapters_kept_off_meta",
    "initialise_missing",
]


def _first(state: Mapping[str, torch.Tensor] | None, names: list[str]) -> torch.Tensor | None:
    for name in names:
        if state is not None and name in state:
            return state[name]
    return None


@dataclass
class CheckpointLoad:
    """The plan of one checkpoint load: per target, where its values come from."""

    checkpoint: ModelCheckpoint
    targets: list[TargetSpec]
    tables: list[TargetSpec]
    registrations: list  # the tables' registrations, in the order of ``tables``
    rank: int
    world: int
    kinds: list[tuple[str, str]] = field(default_factory=list)  # per target: (kind, source FQN)
    table_kinds: list[tuple[str, str]] = field(default_factory=list)
    rank0_values: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: FQN -> value
    full_state: Mapping[str, torch.Tensor] | None = None  # rank 0's values of what is missing
    load_seconds: dict[str, float] = field(default_factory=dict)  # "load.<kind>" -> seconds
    leads: bool = True  # this rank's replica hears rank 0 ([Note: HSDP loads]; 1-D: always)

    @classmethod
    def plan(
        cls,
        checkpoint: ModelCheckpoint,
        targets: list[TargetSpec],
        tables: list[TargetSpec],
        registrations: list,
        full_state: Mapping[str, torch.Tensor] | None,
        rank: int,
        world: int,
        *,
        leads: bool = True,
    ) -> CheckpointLoad:
        load = cls(
            checkpoint, targets, tables, registrations, rank, world, full_state=full_state,
            leads=leads,
        )  # fmt: skip

        def kind_of(target: TargetSpec):
            return checkpoint.tensor_for([target.fqn, *target.aliases]) or ("missing", target.fqn)

        load.kinds = [kind_of(t) for t in targets]
        load.table_kinds = [kind_of(t) for t in tables]
        return load

    @property
    def holds_rank0(self) -> bool:
        """Rank 0 of the leading replica: global rank 0, the one with rank 0's values."""
        return self.rank == 0 and self.leads

    def replica_indices(self) -> list[int]:
        """What a replica that does not lead receives from its leader: what rank 0 sends (the
        files' rows every replica reads itself)."""
        return self._indices("converted", "missing")

    def _indices(self, *kinds: str) -> list[int]:
        return [i for i, (kind, _) in enumerate(self.kinds) if kind in kinds]

    agreed_views: set[int] | None = None  # the tables every rank views (``agree_views``)

    def zero_copy_reason(self, index: int) -> str:
        """ "" when table ``index`` is a view of the mapped checkpoint, else why not: this rank's
        own reason, or, once ``agree_views`` ran, that another rank cannot view it."""
        kind, name = self.table_kinds[index]
        reason = table_view(self.checkpoint, [name], meta_like(self.tables[index]))[1]
        if not reason and self.agreed_views is not None and index not in self.agreed_views:
            return "another rank cannot view it (its copy of the checkpoint is not on a local disk)"
        return reason

    def agree_views(self, group, timeout_s: float | None) -> None:
        """Which tables every rank of ``group`` can view, agreed (one bounded all-reduce, after
        the load's verdict): a table is a view on every rank or on none."""
        flags = [0 if self.zero_copy_reason(i) else 1 for i in range(len(self.tables))]
        least, _ = _fsdp2_ext.figure_range(
            group, flags or [1], timeout_s, stage="checkpoint load: agreeing on the table views"
        )
        self.agreed_views = {i for i in range(len(self.tables)) if least[i]}

    def verdict_bytes(self) -> int:
        """What rank 0 builds in ``verdict`` before the first agreement (converted and missing
        tensors, cast to the model's dtypes), the same figure on every rank: the others' wait
        allows for it ([Note: bounded waits])."""
        everything = list(zip(self.targets, self.kinds)) + list(zip(self.tables, self.table_kinds))
        total = 0
        for index, (target, (kind, name)) in enumerate(everything):
            is_table = index >= len(self.targets)
            if is_table and kind == "converted" and self.checkpoint.pieces(name) is not None:
                continue  # written piece by piece later, never built here
            if kind in ("converted", "missing"):
                total += meta_like(target).nbytes * 2  # read (at most as large) and cast
        return total

    def rows_bytes(self) -> int:
        """The most bytes any rank copies from the files (its padded rows of every ``direct`` and
        ``sliced`` target, counted in the larger of the stored and the model's dtype)."""
        total = 0
        for target, (kind, name) in zip(self.targets, self.kinds):
            if kind not in ("direct", "sliced"):
                continue
            like = meta_like(target)
            element = like.element_size()
            if kind == "direct":
                element = max(element, self.checkpoint.direct[name].element_size())
            rows = like.shape[0] if like.dim() else 1
            per_row = like.numel() // max(rows, 1) * element
            if target.placement == Placement.SHARD0:
                rows = _fsdp2_ext.shard_rows(like.shape[0], self.world, 0).padded_rows
            total += rows * per_row
        return total

    def verdict(self) -> str:
        """This rank's problems with the plan ("" = none); rank 0 also builds what it sends."""
        problems = []
        direct = self._indices("direct")
        names = [self.targets[i].fqn for i in direct]
        tensors = [self.checkpoint.direct[self.kinds[i][1]] for i in direct]
        for i, (kind, name) in enumerate(self.table_kinds):
            if kind == "direct":
                names.append(self.tables[i].fqn)
                tensors.append(self.checkpoint.direct[name])
        mismatch = _fsdp2_ext.describe_state_mismatch(
            [self.targets[i] for i in direct]
            + [t for t, (k, _) in zip(self.tables, self.table_kinds) if k == "direct"],
            names,
            tensors,
            convert_dtype=True,
        )
        if mismatch:
            problems.append(f"checkpoint {self.checkpoint.directory}: {mismatch}")
        for i in self._indices("sliced"):
            shape = tuple(self.checkpoint.sliced_shape(self.kinds[i][1]))
            if shape != tuple(self.targets[i].shape):
                problems.append(
                    f"checkpoint {self.checkpoint.directory}: {self.targets[i].fqn} merges to "
                    f"{shape}, the model has {tuple(self.targets[i].shape)}"
                )
        if self.holds_rank0:
            problems += self._build_rank0_values()
        return "; ".join(problems)

    def _build_rank0_values(self) -> list[str]:
        without_value = []
        everything = list(zip(self.targets, self.kinds)) + list(zip(self.tables, self.table_kinds))
        for index, (target, (kind, name)) in enumerate(everything):
            fqn, aliases, like = target.fqn, target.aliases, meta_like(target)
            is_table = index >= len(self.targets)
            pieces = self.checkpoint.pieces(name) if is_table and kind == "converted" else None
            if pieces is not None:  # written piece by piece later, never concatenated here
                rows = sum(p.shape[0] for p in pieces)
                if rows != like.shape[0] or any(p.shape[1:] != like.shape[1:] for p in pieces):
                    without_value.append(
                        f"{fqn} (its pieces make {rows} rows, not {like.shape[0]})"
                    )
            elif kind == "converted":
                self.rank0_values[fqn] = self.checkpoint.materialize(name).to(like.dtype)
            elif kind == "missing":
                value = _first(self.full_state, [fqn, *aliases])
                if value is None or value.is_meta:
                    without_value.append(fqn)
                else:
                    self.rank0_values[fqn] = value.to(like.dtype)
        if not without_value:
            return []
        return [
            f"{len(without_value)} tensors are neither in checkpoint {self.checkpoint.directory} "
            f"nor initialised on rank 0 (built on meta): {without_value[:5]}; give rank 0 their "
            "values in the full state, or load from rank 0"
        ]

    def _groups_of(self, indices: list[int], group_bytes: int) -> list[list[int]]:
        groups, current, size = [], [], 0
        for i in indices:
            current.append(i)
            size += self.checkpoint.direct[self.kinds[i][1]].nbytes
            if size >= group_bytes:
                groups.append(current)
                current, size = [], 0
        return groups + ([current] if current else [])

    def load(
        self, group_handle, *, device, bucket_bytes: int, timeout_s: float | None, verdict_group
    ):
        """Loads every target; returns (per-target tensors as the C++ loaders return them,
        bytes received, bytes sent). Every rank copies its rows from the files, then every rank
        of ``verdict_group`` agrees that it did ("rows read", bounded by the floor plus the most
        rows any rank copies): a rank whose read failed is named on every rank, and the ranks
        meet again before rank 0 sends."""
        watch = Stopwatch(self.load_seconds)
        loaded: list[torch.Tensor | None] = [None] * len(self.targets)
        problem = ""
        try:
            received = self._read_rows(loaded, group_handle, device, bucket_bytes, timeout_s, watch)
        except Exception as error:  # every rank must hear of it, or they wait for this one
            problem = f"rank {dist.get_rank()}: reading its rows: {type(error).__name__}: {error}"
        problem = _fsdp2_ext.agree_on_verdict(
            verdict_group, problem, torch.device("cpu"), timeout_s, allow_bytes=self.rows_bytes(),
            allows_for="every rank copying its rows from the checkpoint files",
            stage="checkpoint load: rows read",
        )  # fmt: skip
        if problem:
            raise RuntimeError(f"init_sharded: checkpoint {self.checkpoint.directory}: {problem}")
        sent = 0
        from_rank0 = self._indices("converted", "missing")
        if from_rank0 and not self.leads:  # received from the leading replica
            for i in from_rank0:
                loaded[i] = empty_loaded(self.targets[i], group_handle, device)
        elif from_rank0:
            on_rank0 = self.rank == 0
            result = _fsdp2_ext.load_from_rank0(
                group_handle,
                [self.targets[i] for i in from_rank0],
                [self.targets[i].fqn for i in from_rank0] if on_rank0 else [],
                [self.rank0_values[self.targets[i].fqn] for i in from_rank0] if on_rank0 else [],
                bucket_bytes=bucket_bytes,
                device=device,
                timeout_s=timeout_s,
            )
            for i, tensor in zip(from_rank0, result.tensors):
                loaded[i] = tensor
            received += result.bytes_received
            sent += result.bytes_sent
        watch.lap("load.from_rank0")
        return loaded, received, sent

    def _read_rows(self, loaded, group_handle, device, bucket_bytes, timeout_s, watch) -> int:
        """Every ``direct`` and ``sliced`` target's rows, copied from the files; returns bytes."""
        received = 0
        # In groups of ~bucket_bytes of source, each group's source pages released once copied:
        # the copy needs the mapped rows, not a second resident copy of the checkpoint. No group
        # agrees with the other ranks: the load's one verdict covered them all.
        for group in self._groups_of(self._indices("direct"), bucket_bytes):
            sources = [self.checkpoint.direct[self.kinds[i][1]] for i in group]
            result = _fsdp2_ext.load_from_local(
                group_handle,
                [self.targets[i] for i in group],
                [self.targets[i].fqn for i in group],
                sources,
                bucket_bytes=bucket_bytes,
                device=device,
                timeout_s=timeout_s,
                convert_dtype=True,
                verdict_agreed=True,  # verdict() checked every group's state on every rank
            )
            for i, tensor in zip(group, result.tensors):
                loaded[i] = tensor
            received += result.bytes_received
            for source in sources:
                release_pages(source)
        watch.lap("load.direct")
        for i in self._indices("sliced"):
            loaded[i] = self._sliced_rows(i, device)
            received += loaded[i].nbytes
        watch.lap("load.sliced")
        return received

    def _sliced_rows(self, index: int, device) -> torch.Tensor:
        target = self.targets[index]
        source = self.kinds[index][1]
        shape = target.shape
        if target.placement == Placement.SHARD0:
            split = _fsdp2_ext.shard_rows(shape[0], self.world, self.rank)
            begin, rows, padded = split.row_begin, split.rows, split.padded_rows
        else:
            begin, rows, padded = 0, shape[0], shape[0]
        out = torch.empty((padded, *shape[1:]), dtype=target.dtype)
        self.checkpoint.fill_rows(source, out[:rows], begin)
        out[rows:].zero_()
        return out.to(device)

    def tables_to_share(self) -> list:
        """The registrations of the tables that will not be views of the checkpoint."""
        return [r for i, r in enumerate(self.registrations) if self.zero_copy_reason(i)]

    def _served_key(self, fqn: str, keys: list[str], like: torch.Tensor) -> dict | None:
        """The key the table is served to the rollout under
        ([Note: the trainer's table served to the rollout]); None (logged) if none can be made."""
        try:
            return table_key(self.checkpoint.directory, keys, like.shape, like.dtype)
        except (OSError, ValueError) as error:
            log.warn(f"no-placement table {fqn}: not served to the rollout: {error}")
            return None

    def table_values(self) -> TableValues:
        """Zero-copy views by FQN, and values for the other tables by FQN: every rank for a table
        the checkpoint stores whole or in pieces (``Pieces`` of mapped views, written into the
        host-shared file piece by piece from each host's own mapping), rank 0 for the rest;
        logs why a table is not zero-copy."""
        views, values = {}, {}
        for i, (target, (kind, name)) in enumerate(zip(self.tables, self.table_kinds)):
            fqn, like = target.fqn, meta_like(target)
            reason = self.zero_copy_reason(i)
            if not reason:
                views[fqn] = self.checkpoint.direct[name]
                continue
            if self.holds_rank0:
                log.info(f"no-placement table {fqn} is not a view of the checkpoint: {reason}")
            pieces = self.checkpoint.pieces(name) if kind == "converted" else None
            keys = self.checkpoint.piece_keys(name) if pieces is not None else None
            if kind == "direct":  # stored whole: one piece, converted as it is written
                pieces, keys = [self.checkpoint.direct[name]], [self.checkpoint.direct_keys[name]]
            if pieces is not None:  # every rank sees them: each host's leader writes its file
                values[fqn] = Pieces(pieces, like, self._served_key(fqn, keys, like))
            elif self.holds_rank0:
                if kind == "sliced":
                    values[fqn] = torch.empty(like.shape, dtype=like.dtype)
                    self.checkpoint.fill_rows(name, values[fqn], 0)
                else:
                    values[fqn] = self.rank0_values[fqn]
        return TableValues(views=views, values=values, values_on="rank0")


@contextlib.contextmanager
def adapters_kept_off_meta() -> Iterator[None]:
    """Modules created with real values in this context are not moved onto meta.

    PEFT initialises a new adapter on the CPU and then moves it to its base layer's device
    (``Module.to``): on a meta base (a model built for a checkpoint load) that discards the values.
    Within this context a ``Module.to`` onto meta leaves a module that holds real parameters where
    it is (a dtype it names is still applied), so rank 0 keeps the adapters' initial values, drawn
    from the same random stream as on a CPU-built model, and sends them: what the checkpoint lacks
    arrives exactly as on the rank-0 path. Meant for ``get_peft_model`` on a meta-built model.
    """
    original = nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        onto_meta = device is not None and device.type == "meta"
        if onto_meta and any(not p.is_meta for p in self.parameters()):
            return original(self, dtype=dtype) if dtype is not None else self
        return original(self, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def initialise_missing(
    model: nn.Module, checkpoint: ModelCheckpoint, allow_missing: AllowMissing = False
) -> list[str]:
    """Rank 0: gives the parameters the checkpoint lacks that may be initialised ([Note: missing
    tensors]) and are still on meta their initial values: each owning module is materialised on
    the CPU and Transformers' ``_init_weights`` runs on it, as ``from_pretrained`` does for missing
    keys. Returns their FQNs. Other parameters of those modules get values too (overwritten by the
    load). PEFT adapters are left alone: their init is PEFT's (see ``adapters_kept_off_meta``).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    on_meta = [
        f
        for f in checkpoint.initialisable(model, allow_missing)
        if f in params and params[f].is_meta
    ]
    if not on_meta:
        return []
    _, hf_model = _hf_model(model)
    for path in sorted({fqn.rpartition(".")[0] for fqn in on_meta}):
        module = model.get_submodule(path)
        module.to_empty(device="cpu", recurse=False)
        hf_model._init_weights(module)
    log.info(
        f"{len(on_meta)} parameters are not in checkpoint {checkpoint.directory}; rank 0 "
        f"initialised them with {type(hf_model).__name__}._init_weights: {on_meta[:5]}"
    )
    return on_meta
