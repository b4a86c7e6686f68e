"""Meta-to-sharded initialisation: a model plus a full state -> an exact FSDP2 model.

``init_sharded`` runs, in order:

1. register no-placement parameters; record alias groups (merged over ranks) and snapshot the
   non-persistent buffers with their dtypes;
2. convert to meta keeping aliases, leaving no-placement parameters on CPU;
3. ``fully_shard`` the non-overlapping wrap targets, then the root, with the no-placement set as
   ``ignored_params``; a tied group split over two units is refused before anything is sharded;
4. fill every rank's padded local shard (C++): rank 0 scatters buckets of per-rank rows, or every
   rank copies its rows from a full state it can see; the shards are swapped into FSDP2's own
   parameters in place, see [Note: shard padding] and [Note: alias restoration order];
5. restore non-persistent buffers on the device with their dtype; load persistent buffers and the
   no-placement tables (replicated, CPU);
6. verify: nothing left on meta, every alias group one object, shapes and dtypes as declared.

It never calls ``Module.to`` on the model. On a 2-D (replicate, shard) mesh (HSDP, VERL's
``("ddp", "fsdp")``) the load runs over the shard group and the replicas are filled as
[Note: HSDP loads] (``replica_broadcast.py``) says.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext._fsdp2_ext import Placement, TargetSpec
from fsdp2_ext.checkpoint.model_checkpoint import AllowMissing, ModelCheckpoint
from fsdp2_ext.common import log
from fsdp2_ext.common.collector import collection_paused
from fsdp2_ext.common.distributed import gather_objects, host_id
from fsdp2_ext.common.fsdp2_internals import adopt_padded_shard, fsdp_params_by_fqn
from fsdp2_ext.common.stopwatch import Stopwatch
from fsdp2_ext.init import hub_kernels
from fsdp2_ext.init.model_checkpoint_load import CheckpointLoad, initialise_missing
from fsdp2_ext.init.replica_broadcast import broadcast_to_replicas
from fsdp2_ext.init.state_load import LocalLoad, Rank0Load, state_lists
from fsdp2_ext.model.aliases import (
    AliasMap,
    check_aliases,
    get_tensor,
    record_aliases,
    restore_non_persistent_buffers,
    set_tensor,
    share_non_persistent_buffers,
    snapshot_non_persistent_buffers,
    to_meta_preserving_aliases,
)
from fsdp2_ext.model.no_placement import register_no_placement_params
from fsdp2_ext.model.wrap_targets import WrapReport, explain_wrap_targets
from fsdp2_ext.tables.host_shared import HostShareReport
from fsdp2_ext.tables.table_placement import (
    host_shared_directory,
    place_tables,
    shared_directory_problem,
    views_equal_to_rank0,
)

SHARD0, REPLICATE = Placement.SHARD0, Placement.REPLICATE

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "describe_mesh",
    "PreparedModel",
    "ShardedInitReport",
    "fill_sharded",
    "fsdp_params_by_fqn",
    "init_sharded",
    "prepare_sharded",
    "prepared_state",
]

# The core's defaults (include/fsdp2_ext/defaults.h), stated once there.
DEFAULT_BUCKET_BYTES = _fsdp2_ext.DEFAULTS["bucket_bytes"]


@dataclass
class ShardedInitReport:
    wrap: WrapReport
    tied_groups: list[list[str]]
    non_persistent_buffers: list[str]
    no_placement_fqns: list[str]
    local_shard_bytes: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    host_share: HostShareReport | None = None
    checkpoint_kinds: dict[str, int] = field(default_factory=dict)  # ModelCheckpoint.kinds()


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(m): path for path, m in model.named_modules(remove_duplicate=False)}


def _check_ties_within_one_unit(
    model: nn.Module, aliases: AliasMap, units: list[nn.Module]
) -> None:
    """A tied group must live in one FSDP unit (FSDP2 keeps ties only within one call)."""
    unit_paths = sorted(
        (path for path, m in model.named_modules() if any(m is u for u in units)),
        key=len,
        reverse=True,
    )

    def unit_of(fqn: str) -> str:
        for path in unit_paths:
            if fqn.startswith(path + "."):
                return path
        return "<root>"

    for group in aliases.tied_parameter_groups:
        owners = {unit_of(fqn) for fqn in group}
        if len(owners) > 1:
            raise ValueError(
                f"tied parameters {group} would be sharded by different FSDP units {sorted(owners)}; "
                "pass tied=True (or leave it to the config) so embed/head stay in the root unit, or "
                "remove those modules from layer_class_names"
            )


def _drop_units_without_managed_params(wrap: WrapReport, ignored: set[nn.Parameter]) -> None:
    """A candidate whose parameters are all no-placement (the frozen table's own nn.Embedding)
    would be an FSDP unit with nothing to shard: it is reported as skipped instead."""
    ignored_ids = {id(p) for p in ignored}
    kept_modules, kept_selected = [], []
    for module, (path, reason) in zip(wrap.modules, wrap.selected):
        params = list(module.parameters())
        if params and all(id(p) in ignored_ids for p in params):
            wrap.skipped.append((path, reason, "<only no-placement parameters>"))
        else:
            kept_modules.append(module)
            kept_selected.append((path, reason))
    wrap.modules, wrap.selected = kept_modules, kept_selected


def init_sharded(
    model: nn.Module,
    full_state: Mapping[str, torch.Tensor] | None,
    *,
    mesh: DeviceMesh,
    layer_class_names: Iterable[str] | None = None,
    tied: bool | None = None,
    source: Literal["rank0", "local", "checkpoint"] = "rank0",
    checkpoint: str | os.PathLike | ModelCheckpoint | None = None,
    allow_missing: AllowMissing = False,
    fsdp_kwargs: dict[str, Any] | None = None,
    cpu_group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    host_shared_dir: str | None = None,
    timeout_s: float | None = None,
) -> ShardedInitReport:
    """Shards ``model`` with FSDP2 and fills it exactly from ``full_state``.

    ``prepare_sharded`` (steps 1-3) followed by ``fill_sharded`` (steps 4-6); the two halves are
    public for callers whose own flow separates them (VERL's ``apply_fsdp2`` then
    ``fsdp2_load_full_state_dict``).

    Args:
        model: built on rank 0's CPU and/or on meta (``init_empty_weights``) elsewhere.
        full_state: ``source="rank0"``: the state dict on rank 0 (CPU), ``None`` elsewhere
            (``None`` on rank 0 too: its model's own ``state_dict()``, taken before meta);
            ``source="local"``: a full state every rank can read (e.g. mapped safetensors);
            ``source="checkpoint"``: rank 0's values of what the checkpoint lacks (``None``: rank
            0's own, from its model), ``None`` elsewhere.
        source: where the values come from: "rank0", "local", or "checkpoint": every rank copies
            its own rows straight from ``checkpoint`` (see ``fsdp2_ext.init.model_checkpoint_load``).
        checkpoint: the Transformers checkpoint directory the values come from (or a
            ``ModelCheckpoint`` opened on the model before ``fully_shard``): required with
            ``source="checkpoint"``; with ``source="rank0"`` (rank 0's model built from it) it
            decides ties and what may be missing, as for a checkpoint load. Ties follow it as
            ``from_pretrained`` decides them ([Note: checkpoint ties]).
        allow_missing: with ``checkpoint``, the parameters the checkpoint may lack
            (``True``, or FQN / checkpoint-name patterns): rank 0 initialises them with the
            model's ``_init_weights``, with a WARNING each. Anything else missing refuses the load
            on every rank ([Note: missing tensors]); adapters never need it.
        mesh: a 1-D device mesh to shard over (its group carries the data), or a 2-D
            (replicate, shard) mesh for HSDP (VERL's ``("ddp", "fsdp")``; [Note: HSDP loads]).
        layer_class_names, tied: wrap-target selection, see ``select_wrap_targets``.
        fsdp_kwargs: extra ``fully_shard`` keywords (``mp_policy``, ``offload_policy``,
            ``reshard_after_forward``); ``mesh`` and ``ignored_params`` are set here.
        cpu_group: group for CPU tensors (no-placement tables); default: the mesh group when the
            mesh is on CPU and 1-D, else the default group (initialise it with
            "cpu:gloo,cuda:nccl"; on a 2-D mesh it must span every rank of the mesh).
        bucket_bytes: bound of one transfer bucket summed over ranks (rank 0 stages two).
        host_shared_dir: map one file-backed copy of each no-placement table per host from this
            node-local directory (default: ``$VERL_NO_PLACEMENT_MMAP_DIR``; unset: every rank keeps
            its own CPU copy). See ``fsdp2_ext.tables.host_shared``.
        timeout_s: the floor of every wait on another rank (None: ``$FSDP2_EXT_WAIT_FLOOR_S``,
            else 60 s; [Note: wait knobs]), plus the work the awaited ranks have in front of them
            at the bandwidth floor (``$FSDP2_EXT_MIN_BANDWIDTH_MIB_S``, else 64 MiB/s): a rank
            that died or stopped makes the others raise, naming it, within that bound instead of
            the process group's timeout ([Note: bounded waits]).
    """
    _check_source(source, checkpoint)
    if full_state is None and source != "local" and _holds_rank0(mesh):
        full_state = model.state_dict()  # taken before anything becomes meta
    prepared = prepare_sharded(
        model,
        mesh=mesh,
        layer_class_names=layer_class_names,
        tied=tied,
        fsdp_kwargs=fsdp_kwargs,
        cpu_group=cpu_group,
        checkpoint=checkpoint,
        allow_missing=allow_missing,
    )
    return fill_sharded(
        model,
        full_state,
        prepared=prepared,
        source=source,
        bucket_bytes=bucket_bytes,
        host_shared_dir=host_shared_dir,
        timeout_s=timeout_s,
    )


def describe_mesh(mesh: DeviceMesh) -> str:
    """``2-D mesh ('ddp', 'fsdp') of (2, 2)``: what an error names of a mesh."""
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else "(unnamed)"
    return f"{mesh.ndim}-D mesh {names} of {tuple(mesh.mesh.shape)}"


def _holds_rank0(mesh: DeviceMesh) -> bool:
    """Rank 0 of the mesh: coordinate 0 on every dimension (on a 2-D mesh, rank 0 of the
    leading replica), the rank that holds rank 0's values."""
    coordinate = mesh.get_coordinate()
    return coordinate is not None and not any(coordinate)


def _shard_and_replicate_groups(mesh: DeviceMesh):
    """(shard group, replicate group or None): FSDP2 shards over a mesh's last dimension and
    replicates over the first of a 2-D one (HSDP); any other shape is refused, naming it."""
    if mesh.ndim == 1:
        return mesh.get_group(), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(
        f"init_sharded: a {describe_mesh(mesh)}; pass a 1-D "
        "shard mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP, e.g. VERL's ('ddp', 'fsdp'))"
    )


def _check_source(source: str, checkpoint) -> None:
    if source not in ("rank0", "local", "checkpoint"):
        raise ValueError(
            f"init_sharded: source must be 'rank0', 'local' or 'checkpoint', got {source!r}"
        )
    if source == "checkpoint" and checkpoint is None:
        raise ValueError("init_sharded: source='checkpoint' needs checkpoint=<directory>")
    if source == "local" and checkpoint is not None:
        raise ValueError(
            "init_sharded: source='local' loads the full state you pass; drop checkpoint= (or "
            "use source='checkpoint' to load from it)"
        )


@dataclass
class PreparedModel:
    """What ``prepare_sharded`` learnt before the model went to meta; ``fill_sharded`` needs it."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    device: torch.device
    registrations: list
    aliases: AliasMap
    buffers: dict[str, torch.Tensor]
    wrap: WrapReport
    stage_seconds: dict[str, float]
    checkpoint: ModelCheckpoint | None = None
    initialised: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: new values
    missing_problem: str = ""  # what the checkpoint lacks unallowed ([Note: missing tensors])
    init_source: str | None = None  # what fill_sharded loads from when not told
    replicate_group: dist.ProcessGroup | None = None  # HSDP's ``ddp`` group; None on a 1-D mesh
    # rank 0's hub-kernels choice, agreed; None: no PreTrainedModel
    hub_kernels: hub_kernels.KernelsChoice | None = None

    @property
    def leads_replicas(self) -> bool:
        """This rank's replica loads from rank 0 (every rank of a 1-D mesh; [Note: HSDP loads])."""
        return self.replicate_group is None or dist.get_rank(self.replicate_group) == 0

    @property
    def holds_rank0(self) -> bool:
        """The rank with rank 0's values: shard rank 0 of the leading replica."""
        return _holds_rank0(self.mesh)

    @property
    def compute_device_type(self) -> str:
        """Where the forward runs: the mesh's device type, also where ``CPUOffloadPolicy`` keeps
        the shards (``device``) on the CPU and FSDP2 moves them to the accelerator to compute."""
        return self.mesh.device_type


_PREPARED_ATTRIBUTE = "_fsdp2_ext_prepared"


@collection_paused()  # [Note: the collector paused during an init]
def prepare_sharded(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    layer_class_names: Iterable[str] | None = None,
    tied: bool | None = None,
    fsdp_kwargs: dict[str, Any] | None = None,
    cpu_group: dist.ProcessGroup | None = None,
    fully_shard_fn: Callable[..., Any] = fully_shard,
    checkpoint: str | os.PathLike | ModelCheckpoint | None = None,
    allow_missing: AllowMissing = False,
    init_source: Literal["rank0", "local", "checkpoint"] | None = None,
) -> PreparedModel:
    """Steps 1-3: registrations, aliases and buffers recorded, meta conversion, ``fully_shard``.

    The model holds no values afterwards (shards on meta) until ``fill_sharded``; the result is
    also kept on the model for a later ``fill_sharded(model, ...)`` without ``prepared``.
    ``fully_shard_fn`` replaces ``fully_shard`` for callers that wrap it (VERL patches FSDPModule
    around each call). With ``checkpoint`` (the directory the model's values come from), ties are
    made as ``from_pretrained`` makes them for it, what it lacks is judged by ``allow_missing``
    and, on rank 0, initialised ([Note: missing tensors]). ``init_source``: what a later
    ``fill_sharded`` loads from when it is not told (recorded with the rest).
    """
    group, replicate_group = _shard_and_replicate_groups(mesh)
    fsdp_kwargs = dict(fsdp_kwargs or {})
    for reserved in ("mesh", "ignored_params"):
        if reserved in fsdp_kwargs:
            raise ValueError(
                f"init_sharded: do not pass '{reserved}' in fsdp_kwargs; it is set here"
            )
    offloaded = isinstance(fsdp_kwargs.get("offload_policy"), CPUOffloadPolicy)
    device = (
        torch.device("cpu")
        if offloaded or mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.accelerator.current_device_index())
    )
    if offloaded and mesh.device_type != "cpu":
        # The shards are built on the CPU and travel over the mesh's own group.
        try:
            for carrier in (group, replicate_group or group):
                carrier._get_backend(torch.device("cpu"))
        except RuntimeError as error:
            raise ValueError(
                f"init_sharded: CPUOffloadPolicy on a {mesh.device_type} mesh moves CPU shards over "
                "the mesh's group, which has no CPU backend; initialise the process group with "
                f'backend="cpu:gloo,{mesh.device_type}:nccl" (VERL does) ({error})'
            ) from error
    if cpu_group is None and replicate_group is not None and mesh.size() != dist.get_world_size():
        raise ValueError(
            f"init_sharded: a 2-D mesh of {mesh.size()} ranks in a world of "
            f"{dist.get_world_size()}: pass cpu_group=, a group of exactly the mesh's ranks (the "
            "verdicts, buffers and tables of an HSDP load span every rank of the mesh)"
        )
    if cpu_group is None:  # the verdicts, buffers and tables span every rank of the mesh
        cpu_group = group if mesh.device_type == "cpu" and mesh.ndim == 1 else dist.group.WORLD
    log.set_log_rank(dist.get_rank())
    stages: dict[str, float] = {}
    watch = Stopwatch(stages)

    # 0. The checkpoint: ties as from_pretrained makes them, what it lacks judged and initialised.
    initialised: dict[str, torch.Tensor] = {}
    missing_problem = ""
    if checkpoint is not None:
        if not isinstance(checkpoint, ModelCheckpoint):
            checkpoint = ModelCheckpoint.open(model, checkpoint)
        checkpoint.apply_ties(model)
        missing_problem = checkpoint.missing_verdict(model, allow_missing)
        if _holds_rank0(mesh) and not missing_problem:
            names = initialise_missing(model, checkpoint, allow_missing)
            initialised = {n: get_tensor(model, n) for n in names}
        watch.lap("checkpoint")

    # 1. Registrations, aliases, non-persistent buffers.
    registrations = register_no_placement_params(model)
    # merged over every rank of the mesh: on HSDP the other replicas' ranks never see rank 0's
    aliases = record_aliases(model, group=group if replicate_group is None else cpu_group)
    buffers = share_non_persistent_buffers(snapshot_non_persistent_buffers(model), cpu_group)
    # [Note: hub kernels once the weights are real]: rank 0's choice, agreed before values move
    kernels = hub_kernels.agree(model, cpu_group, _fsdp2_ext.wait_floor_s())
    watch.lap("record")

    # 2. Meta, aliases kept; no-placement tables untouched.
    to_meta_preserving_aliases(model, aliases, keep={r.param for r in registrations})
    watch.lap("to_meta")

    # 3. fully_shard: wrap targets first, then the root.
    wrap = explain_wrap_targets(model, layer_class_names, tied=tied)
    ignored = {r.param for r in registrations}
    _drop_units_without_managed_params(wrap, ignored)
    _check_ties_within_one_unit(model, aliases, wrap.modules)
    for module in wrap.modules:
        fully_shard_fn(module, mesh=mesh, ignored_params=ignored, **fsdp_kwargs)
    fully_shard_fn(model, mesh=mesh, ignored_params=ignored, **fsdp_kwargs)
    watch.lap("fully_shard")
    prepared = PreparedModel(
        mesh,
        group,
        cpu_group,
        device,
        registrations,
        aliases,
        buffers,
        wrap,
        stages,
        checkpoint=checkpoint,
        initialised=initialised,
        missing_problem=missing_problem,
        init_source=init_source,
        replicate_group=replicate_group,
        hub_kernels=kernels,
    )
    vars(model)[_PREPARED_ATTRIBUTE] = prepared
    return prepared


def prepared_state(model: nn.Module) -> PreparedModel | None:
    """What ``prepare_sharded`` recorded on ``model`` (None: not prepared, or already filled)."""
    return vars(model).get(_PREPARED_ATTRIBUTE)


def fill_sharded(
    model: nn.Module,
    full_state: Mapping[str, torch.Tensor] | None,
    *,
    prepared: PreparedModel | None = None,
    source: Literal["rank0", "local", "checkpoint"] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    host_shared_dir: str | None = None,
    timeout_s: float | None = None,
) -> ShardedInitReport:
    """Steps 4-6 on a model that ``prepare_sharded`` left on meta, in this order:

    1. the targets: every FSDP2 shard and replicated buffer (one per alias group), every table;
    2. the load plan of the init source (``source``, default: the one given to
       ``prepare_sharded``, else ``rank0``): ``Rank0Load``, ``LocalLoad`` or ``CheckpointLoad``;
    3. one verdict on every rank: what the checkpoint lacks, each rank's plan, whether every
       host's copy of the checkpoint is the same ([Note: checkpoint fingerprint]), the
       host-shared directory; a ValueError on every rank if anything is wrong, before any data
       moves (where tables may be views, the directory is judged after step 4, for the tables
       that are no views);
    4. the tables that become views of the checkpoint, agreed over every rank: from the
       checkpoint, each table every rank can view (``CheckpointLoad.agree_views``); in the rank-0
       path, each whose bytes rank 0's value equals (``table_placement.views_equal_to_rank0``);
    5. the load: each rank's padded rows adopted into FSDP2's own parameters, replicas bound;
    6. the tables placed (``table_placement.place_tables``), non-persistent buffers restored;
    7. verified: nothing on meta, every alias group one object;
    8. Transformers' hub kernels as rank 0's ``from_pretrained`` chose them, on every rank, on
       the shards' device ([Note: hub kernels once the weights are real]).
    """
    prepared = _take_prepared(model, prepared)
    source = source or prepared.init_source or "rank0"
    _check_source(source, prepared.checkpoint)
    timeout_s = _fsdp2_ext.wait_floor_s() if timeout_s is None else timeout_s
    group, cpu_group, device = prepared.group, prepared.cpu_group, prepared.device
    rank = dist.get_rank(group)
    watch = Stopwatch(prepared.stage_seconds)

    targets = _Targets.of(model, prepared)
    host_shared_dir = host_shared_directory(host_shared_dir)
    # The host-shared directory must hold only the tables that will not be views, known once the
    # views are agreed, still before data moves.
    views_first = source in ("rank0", "checkpoint") and bool(targets.tables)
    plan, verdict = _plan_and_verdict(
        prepared, targets, source, full_state, rank, None if views_first else host_shared_dir
    )
    verdict = _agree_first_verdict(prepared, plan, verdict, timeout_s)
    if verdict:
        raise ValueError(f"init_sharded: {verdict}")
    watch.lap("plan_and_verdict")
    if views_first:
        if source == "checkpoint":
            plan.agree_views(cpu_group, timeout_s)
            table_values = plan.table_values()
        else:
            table_values = views_equal_to_rank0(
                targets.tables, plan.table_values(), prepared.checkpoint, group=cpu_group,
                timeout_s=timeout_s,
            )  # fmt: skip
        unviewed = [r for r in prepared.registrations if r.fqn not in table_values.views]
        problem = shared_directory_problem(host_shared_dir, unviewed)
        problem = _fsdp2_ext.agree_on_verdict(
            cpu_group,
            f"rank {dist.get_rank()}: {problem}" if problem else "",
            torch.device("cpu"),
            timeout_s,
            stage="init_sharded: the host-shared directory",
        )
        if problem:
            raise ValueError(f"init_sharded: {problem}")
        watch.lap("table_views")
    else:
        table_values = plan.table_values()

    if source == "checkpoint":
        loaded, received, sent = plan.load(
            group, device=device, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
            verdict_group=cpu_group,
        )  # fmt: skip
    else:
        loaded, received, sent = plan.load(
            group, device=device, bucket_bytes=bucket_bytes, timeout_s=timeout_s
        )
    # What the next wait allows for: the rows each rank copied since the load's last collective
    # (the local source's copies; the others end in a transfer or the "rows read" agreement).
    after_load = sum(t.nbytes for t in loaded) if source == "local" else 0
    watch.lap("load")
    if prepared.replicate_group is not None:  # [Note: HSDP loads]
        more_received, more_sent = broadcast_to_replicas(
            [loaded[i] for i in plan.replica_indices()], group=prepared.replicate_group,
            bucket_bytes=bucket_bytes, timeout_s=timeout_s,
            lead_bytes=dist.get_world_size(group) * sum(t.nbytes for t in loaded),
        )  # fmt: skip
        received, sent = received + more_received, sent + more_sent
        watch.lap("replicas")
    prepared.stage_seconds.update(plan.load_seconds)
    local_bytes = targets.adopt(model, loaded)
    watch.lap("adopt")

    host_share = place_tables(
        prepared.registrations,
        table_values,
        group=cpu_group,
        directory=host_shared_dir,
        bucket_bytes=bucket_bytes,
        timeout_s=timeout_s,
        lead_bytes=after_load,
    )
    restore_non_persistent_buffers(model, prepared.buffers, device)
    watch.lap("tables_and_buffers")

    _verify(model, prepared.aliases)
    watch.lap("verify")
    # [Note: hub kernels once the weights are real]; on the compute device, not the offload one
    hub_kernels.apply(model, prepared.hub_kernels, prepared.compute_device_type)
    watch.lap("hub_kernels")
    checkpoint = prepared.checkpoint
    report = ShardedInitReport(
        wrap=prepared.wrap,
        tied_groups=prepared.aliases.tied_parameter_groups,
        non_persistent_buffers=sorted(prepared.buffers),
        no_placement_fqns=sorted(r.fqn for r in prepared.registrations),
        local_shard_bytes=local_bytes,
        bytes_received=received,
        bytes_sent=sent,
        stage_seconds=prepared.stage_seconds,
        host_share=host_share,
        checkpoint_kinds=checkpoint.kinds() if checkpoint is not None else {},
    )
    log.debug(f"init_sharded stages: {prepared.stage_seconds}")
    return report


def _take_prepared(model: nn.Module, prepared: PreparedModel | None) -> PreparedModel:
    """The prepared state (given, or recorded on the model), removed from the model."""
    recorded = vars(model).pop(_PREPARED_ATTRIBUTE, None)
    prepared = prepared or recorded
    if prepared is None:
        raise ValueError(
            "fill_sharded: the model was not prepared; call prepare_sharded(model, mesh=...) "
            "first, or init_sharded for both steps"
        )
    return prepared


@dataclass
class _Targets:
    """Every tensor a fill produces: FSDP2 shards and replicated buffers, and the tables."""

    shards_and_replicas: list[TargetSpec]
    tables: list[TargetSpec]
    fsdp_params: dict[str, Any]  # canonical FQN -> FSDPParam
    group_of: dict[str, list[str]]  # canonical FQN -> its alias group
    canonical: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module, prepared: PreparedModel) -> _Targets:
        aliases, buffers = prepared.aliases, prepared.buffers
        canonical = aliases.canonical()
        group_of = {g[0]: g for g in aliases.parameter_groups + aliases.buffer_groups}
        fsdp_params = {canonical.get(f, f): p for f, p in fsdp_params_by_fqn(model).items()}
        replicated = [g[0] for g in aliases.buffer_groups if not set(buffers).intersection(g)]

        def target(fqn: str, like: torch.Tensor, placement: Placement) -> TargetSpec:
            return TargetSpec(fqn, like, placement, aliases=group_of.get(fqn, [fqn])[1:])

        shards = [
            target(f, torch.empty(p._orig_size, dtype=p.sharded_param.dtype, device="meta"), SHARD0)
            for f, p in fsdp_params.items()
        ]
        replicas = [target(f, get_tensor(model, f), REPLICATE) for f in replicated]
        tables = [target(r.fqn, r.param, REPLICATE) for r in prepared.registrations]
        return cls(shards + replicas, tables, fsdp_params, group_of, canonical)

    def adopt(self, model: nn.Module, loaded: list[torch.Tensor]) -> int:
        """Puts each loaded tensor in place; returns this rank's shard bytes."""
        local_bytes = 0
        for spec, tensor in zip(self.shards_and_replicas, loaded):
            if spec.placement == SHARD0:
                adopt_padded_shard(self.fsdp_params[spec.fqn], tensor)
                local_bytes += tensor.nbytes
            else:
                for alias in self.group_of.get(spec.fqn, [spec.fqn]):
                    set_tensor(model, alias, tensor)
        return local_bytes


def _plan_and_verdict(prepared, targets: _Targets, source, full_state, rank, host_shared_dir):
    """The init source's load plan and this rank's verdict on it ("" = fine). A rank that fails
    here still reaches the verdict with its reason, or its peers would wait for it there."""
    if prepared.missing_problem:  # the same on every rank
        return None, prepared.missing_problem
    registrations = prepared.registrations
    leads, holds_rank0 = prepared.leads_replicas, prepared.holds_rank0
    try:
        if source == "checkpoint":
            state = dict(zip(*state_lists(full_state))) if holds_rank0 else None
            if state is not None:
                state.update(prepared.initialised)
            world = dist.get_world_size(prepared.group)
            plan = CheckpointLoad.plan(
                prepared.checkpoint, targets.shards_and_replicas, targets.tables, registrations,
                state, rank, world, leads=leads,
            )  # fmt: skip
        else:
            kind = Rank0Load if source == "rank0" else LocalLoad
            plan = kind.plan(
                targets.shards_and_replicas, targets.tables, registrations, targets.canonical,
                full_state, holds_state=source == "local" or holds_rank0, leads=leads,
            )  # fmt: skip
        verdict = plan.verdict()
    except Exception as error:
        where = f"rank {dist.get_rank()}"  # the global rank: HSDP has one shard rank per replica
        return None, f"{where}: the full state is unusable: {type(error).__name__}: {error}"
    if not verdict:
        problem = shared_directory_problem(host_shared_dir, plan.tables_to_share())
        verdict = f"rank {dist.get_rank()}: {problem}" if problem else ""
    return plan, verdict


def _agree_first_verdict(prepared: PreparedModel, plan, verdict: str, timeout_s: float) -> str:
    """The load's first agreement, over the CPU group: every rank's verdict, and with a checkpoint
    whether every host's copy is rank 0's ([Note: checkpoint fingerprint]). The first wait allows
    for what rank 0 built while the others came (``CheckpointLoad.verdict_bytes``)."""
    cpu_group, checkpoint = prepared.cpu_group, prepared.checkpoint
    allow = plan.verdict_bytes() if isinstance(plan, CheckpointLoad) else 0
    allows_for = "rank 0 building the converted and missing tensors"
    if checkpoint is not None:
        try:
            fingerprint = checkpoint.fingerprint()
        except OSError as error:
            fingerprint = ""
            verdict = (
                verdict or f"rank {dist.get_rank()}: cannot read {checkpoint.directory}: {error}"
            )
        copies = gather_objects(
            (host_id(), fingerprint), cpu_group, "comparing the checkpoint's copies", timeout_s,
            allow, allows_for,
        )  # fmt: skip
        allow = 0  # every rank has arrived
        verdict = verdict or _copies_verdict(checkpoint.directory, copies)
    return _fsdp2_ext.agree_on_verdict(
        cpu_group, verdict, torch.device("cpu"), timeout_s, allow_bytes=allow,
        allows_for=allows_for, stage="init_sharded: the load's verdict",
    )  # fmt: skip


def _copies_verdict(directory: str, copies: list[tuple[str, str]]) -> str:
    """ "" when every rank's copy of the checkpoint has rank 0's fingerprint, else the refusal
    naming the hosts whose copy differs (the same text on every rank)."""
    reference = copies[0][1]
    differ = sorted({host for host, fingerprint in copies if fingerprint != reference})
    if not differ:
        return ""
    return (
        f"the copies of checkpoint {directory} differ between hosts: the copy on "
        f"{', '.join(differ)} is not the one on {copies[0][0]} (rank 0's; fingerprints of names, "
        "sizes, headers and sampled bytes); give every host the same files (copy them again, or "
        "point model.path at one shared copy)"
    )


def _verify(model: nn.Module, aliases: AliasMap) -> None:
    on_meta = [n for n, t in model.named_parameters() if t.is_meta]
    on_meta += [n for n, t in model.named_buffers() if t.is_meta]
    if on_meta:
        raise RuntimeError(f"init_sharded left tensors on meta: {on_meta[:5]}")
    check_aliases(model, aliases)
