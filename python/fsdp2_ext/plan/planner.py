"""Memory planner: what a model costs per GPU and per host under fsdp2_ext, before any launch.

    fsdp2-ext plan path/to/hf_model_dir --world-size 16 --nodes 2 --lora-rank 16 \
        --target-modules q_proj k_proj v_proj o_proj --target-parameters mlp.experts.gate_up_proj

Reads a local HF config (no download), builds the model on meta, and reports: per-GPU shard bytes
(FSDP2's padded Shard(0) layout, exactly what ``init_sharded`` allocates), per-host CPU bytes of
the no-placement tables with and without host sharing, LoRA parameter counts, and the peak memory
during a rank-0 load onto the GPUs (receivers, and rank 0 whose staging is W times larger),
and the bytes of one training checkpoint (VERL's per-rank files, all ranks together) with
``save_lora_only`` (the adapter and its AdamW moments, in the base's dtype) and without it (every shard of the
base too; fsdp2_ext leaves the frozen tables out, VERL alone writes them on every rank), and what
each rank reads and assembles in host memory when a save from another number of GPUs is resumed
at this one ([Note: resharding a resume]). With ``fsdp_size`` below the world size (VERL's HSDP:
a 2-D ``("ddp", "fsdp")`` mesh), every per-GPU figure is the shard group's (the model sharded
over ``fsdp_size`` GPUs, whole on each of the ``world_size / fsdp_size`` replicas) and a save holds
every replica's files. Text table by default, JSON with ``--json``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext._fsdp2_ext import Placement, TargetSpec
from fsdp2_ext.model.no_placement import _declarations

__all__ = ["MemoryPlan", "format_plan", "plan_memory"]

GIB = 1 << 30


@dataclass
class MemoryPlan:
    model_class: str
    world_size: int
    nodes: int
    fsdp_size: int  # the shard group (world_size: plain FSDP; less: HSDP replicas)
    dtype: str
    parameters: int
    sharded_parameters: int
    shard_bytes_per_gpu: int
    replicated_bytes_per_gpu: int = 0  # buffers (rotary inv_freq, ...): whole on every GPU
    no_placement: dict[str, int] = field(default_factory=dict)  # FQN -> bytes
    host_cpu_bytes_unshared: int = 0
    host_cpu_bytes_shared: int = 0
    lora_parameters: int = 0
    lora_bytes_per_gpu: int = 0
    bucket_bytes: int = 0
    peak_gpu_bytes_during_load: int = 0  # a receiving rank
    peak_rank0_gpu_bytes_during_load: int = 0
    peak_rank0_cpu_bytes_during_load: int = 0
    save_bytes_lora_only: int = 0  # one training checkpoint, all ranks: adapter + AdamW moments
    save_bytes_full: int = 0  # ... without save_lora_only: the base's shards as well
    save_bytes_full_verl_alone: int = 0  # ... as VERL alone writes it: every rank's tables too
    # A resume from another world size: each rank's rows of every saved tensor at this world
    # size, read from the mapped files and assembled on the host before they are loaded.
    reshard_rank_bytes_lora_only: int = 0
    reshard_rank_bytes_full: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _lora_shapes(model: nn.Module, rank: int, target_modules, target_parameters) -> list:
    """The shapes of the parameters PEFT's LoRA adds, as VERL adds them (``get_peft_model`` with
    ``LoraConfig(r, target_modules, target_parameters, bias="none")``, VERL's
    ``transformer_impl.py``), built by PEFT itself on a meta copy: every layer kind PEFT knows
    (Linear, fused 3-D expert parameters through ``target_parameters``) counted as PEFT makes it."""
    if rank <= 0 or not (target_modules or target_parameters):
        return []
    # built once per model and arguments: PEFT on a meta copy of a 512-expert model takes seconds,
    # and a plan asks for it three times (the trainer, vLLM's slots, the sync)
    cache = model.__dict__.setdefault("_fsdp2_ext_lora_shapes", {})
    key = repr((rank, target_modules, target_parameters))
    if key not in cache:
        cache[key] = _peft_shapes(model, rank, target_modules, target_parameters)
    return list(cache[key])


def _peft_shapes(model: nn.Module, rank: int, target_modules, target_parameters) -> list:
    import copy

    from peft import LoraConfig, TaskType, get_peft_model

    with torch.device("meta"):
        shadow = copy.deepcopy(model).to("meta")
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM if hasattr(model, "config") else None, r=rank, lora_alpha=2 * rank, bias="none",
        target_modules=_peft_targets(target_modules),
        target_parameters=list(target_parameters) or None,
    )  # fmt: skip
    peft_model = get_peft_model(shadow, config)
    return [tuple(p.shape) for n, p in peft_model.named_parameters() if "lora_" in n]


def _peft_targets(target_modules):
    """PEFT's form: VERL's default ``"all-linear"`` stays the string PEFT matches on."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules or ())
    if names == ["all-linear"]:
        return "all-linear"
    return names or None


def plan_memory(
    model: nn.Module,
    *,
    world_size: int,
    nodes: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    lora_rank: int = 0,
    target_modules=(),
    target_parameters=(),
    bucket_bytes: int = _fsdp2_ext.DEFAULTS["bucket_bytes"],
    fsdp_size: int | None = None,
) -> MemoryPlan:
    """Plans ``model`` (any device, meta is fine) for ``world_size`` GPUs on ``nodes`` hosts,
    sharded over groups of ``fsdp_size`` (default, or -1: all of them; less: HSDP)."""
    if world_size <= 0 or nodes <= 0 or world_size % nodes:
        raise ValueError(
            f"world_size ({world_size}) must be a positive multiple of nodes ({nodes})"
        )
    # VERL's create_device_mesh: fsdp_size < 0 or >= world_size is plain FSDP over every GPU
    flat = fsdp_size is None or fsdp_size < 0 or fsdp_size >= world_size
    shard_world = world_size if flat else fsdp_size
    if shard_world == 0 or world_size % shard_world:
        raise ValueError(
            f"fsdp_size ({fsdp_size}) must divide world_size ({world_size}) (or be -1: every "
            "GPU): VERL builds its ('ddp', 'fsdp') mesh of world_size / fsdp_size replicas"
        )
    replicas = world_size // shard_world
    element = torch.empty((), dtype=dtype).element_size()
    names = [fqn for fqn, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    declarations = _declarations(model)
    tables = set()
    if declarations:
        records = [_fsdp2_ext.ParameterRecord(n, False) for n in names]
        matches = _fsdp2_ext.match_no_placement_params(declarations, records)
        tables = {names[m.parameter_index] for m in matches}
    scalars = [fqn for fqn, param in params.items() if param.dim() == 0 and fqn not in tables]
    if scalars:
        raise ValueError(
            f"plan_memory: {scalars[:5]} are scalar (0-d) parameters, which FSDP2's fully_shard "
            "refuses; make each a 1-D tensor of one element"
        )
    # The loader's own plan of a load onto GPUs (no direct buckets there): its padded Shard(0)
    # segments and its staging parts, [Note: rank-0 transfer].
    targets = [
        TargetSpec(fqn, torch.empty(param.shape, dtype=dtype, device="meta"), Placement.SHARD0)
        for fqn, param in params.items()
        if fqn not in tables
    ] + [TargetSpec(fqn, buffer, Placement.REPLICATE) for fqn, buffer in model.named_buffers()]
    load_plan = _fsdp2_ext.ShardingPlan(targets, shard_world, bucket_bytes=bucket_bytes)
    sharded = sum(p.numel() for fqn, p in params.items() if fqn not in tables)
    table_bytes = {fqn: params[fqn].numel() * element for fqn in sorted(tables)}
    per_host = world_size // nodes
    # VERL casts the adapters to the base's dtype (transformer_impl.py, "Casting ... LoRA adapter
    # params ... to match base"); each is a Shard(0) parameter of its own, padded.
    lora_shapes = _lora_shapes(model, lora_rank, target_modules, target_parameters)
    lora = sum(math.prod(shape) for shape in lora_shapes)
    lora_shard = element * sum(
        -(-shape[0] // shard_world) * math.prod(shape[1:]) for shape in lora_shapes
    )
    full_bytes = sum(p.numel() for p in params.values()) * element
    replicated = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    per_rank = load_plan.bytes_per_rank  # shards (padded) and replicated buffers
    shard_bytes = per_rank - replicated
    # Two staging slots ([Note: rank-0 transfer], allocate_slots): rank 0 holds one part per rank
    # in each on the GPU (its own a scratch part, both input and output of its scatter) and one per
    # receiving rank pinned on the host, every other rank one on the GPU. A load into CPU memory
    # stages less (direct buckets). Held against what a load allocates in tests/init/test_transport.py.
    part = load_plan.staging_part_bytes if shard_world > 1 else 0
    rank0_staging = 2 * shard_world * part
    rank0_host_staging = 2 * (shard_world - 1) * part
    # HSDP ([Note: HSDP loads]): after the scatter, one bucket along ddp (at most the shard)
    along_ddp = min(bucket_bytes, per_rank) if replicas > 1 else 0
    # One save (VERL's FSDPCheckpointManager, all ranks): the trainable LoRA parameters and their
    # two AdamW moments, all in the parameters' dtype (torch's AdamW keeps exp_avg/exp_avg_sq
    # like the parameter); without save_lora_only, every base shard too. Every rank writes its
    # file, so each HSDP replica writes the whole state once more.
    lora_save = lora * 3 * element * replicas
    # a frozen base under LoRA; without LoRA the base is trained and AdamW's moments join it
    base_shards = shard_bytes * world_size * (1 if lora_shapes else 3)
    return MemoryPlan(
        model_class=type(model).__name__,
        world_size=world_size,
        nodes=nodes,
        fsdp_size=shard_world,
        dtype=str(dtype).removeprefix("torch."),
        parameters=sum(p.numel() for p in params.values()),
        sharded_parameters=sharded,
        shard_bytes_per_gpu=shard_bytes,
        replicated_bytes_per_gpu=replicated,
        no_placement=table_bytes,
        host_cpu_bytes_unshared=per_host * sum(table_bytes.values()),
        host_cpu_bytes_shared=sum(table_bytes.values()),
        lora_parameters=lora,
        lora_bytes_per_gpu=lora_shard,
        bucket_bytes=bucket_bytes,
        peak_gpu_bytes_during_load=per_rank + max(2 * part, along_ddp),
        peak_rank0_gpu_bytes_during_load=per_rank + max(rank0_staging, along_ddp),
        peak_rank0_cpu_bytes_during_load=full_bytes + replicated + rank0_host_staging,
        save_bytes_lora_only=lora_save,
        save_bytes_full=lora_save + base_shards,
        save_bytes_full_verl_alone=lora_save + base_shards + world_size * sum(table_bytes.values()),
        # at most a padded chunk of each tensor: the adapter and its two moments, and the base's
        # shard where the save holds it (the frozen tables are never in a save); assembled on the
        # host, then held once more on the GPU (DTensor.from_local) until load_state_dict
        # (none on HSDP: a resharded resume is refused there)
        reshard_rank_bytes_lora_only=3 * lora_shard if replicas == 1 else 0,
        reshard_rank_bytes_full=(3 * lora_shard + shard_bytes * (1 if lora_shapes else 3))
        if replicas == 1
        else 0,
    )


def format_plan(plan: MemoryPlan) -> str:
    def gib(value: int) -> str:
        return f"{value / GIB:,.2f} GiB"

    layout = (
        ""
        if plan.fsdp_size == plan.world_size
        else f", HSDP: {plan.world_size // plan.fsdp_size} replicas of fsdp_size {plan.fsdp_size}"
    )
    lines = [
        f"{plan.model_class}: {plan.parameters:,} parameters ({plan.dtype}), "
        f"{plan.world_size} GPUs on {plan.nodes} host(s){layout}",
        f"  per-GPU shard (padded Shard(0))   {gib(plan.shard_bytes_per_gpu)}",
        f"  replicated buffers per GPU        {gib(plan.replicated_bytes_per_gpu)}",
        f"  LoRA parameters                   {plan.lora_parameters:,} "
        f"({gib(plan.lora_bytes_per_gpu)} per GPU, {plan.dtype} as VERL casts them)",
        f"  peak per GPU during load          {gib(plan.peak_gpu_bytes_during_load)}"
        f" (rank 0: {gib(plan.peak_rank0_gpu_bytes_during_load)})",
        f"  peak rank-0 host during load      {gib(plan.peak_rank0_cpu_bytes_during_load)}",
        f"  one training checkpoint           {gib(plan.save_bytes_lora_only)} with "
        f"save_lora_only; {gib(plan.save_bytes_full)} without (VERL alone: "
        f"{gib(plan.save_bytes_full_verl_alone)}, the tables on every rank)",
        f"  resumed from another GPU count    {gib(plan.reshard_rank_bytes_lora_only)} read and "
        f"assembled per rank (host) with save_lora_only; {gib(plan.reshard_rank_bytes_full)} "
        "without; the same again per GPU beside the live state until it is loaded "
        "(DTensor.from_local moves it to the mesh's device)"
        if plan.fsdp_size == plan.world_size
        else "  resumed from another GPU count    refused on an HSDP mesh (resume with the world "
        "size and fsdp_size it was saved with)",
    ]
    if plan.no_placement:
        lines.append("  no-placement tables (stay on CPU):")
        for fqn, size in plan.no_placement.items():
            lines.append(f"    {fqn}  {gib(size)}")
        lines.append(
            f"  per-host CPU for the tables       {gib(plan.host_cpu_bytes_shared)} shared "
            f"(VERL_NO_PLACEMENT_MMAP_DIR) vs {gib(plan.host_cpu_bytes_unshared)} unshared"
        )
    return "\n".join(lines)
