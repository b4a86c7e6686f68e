"""The whole host before a launch: trainer, rollout and Ray, against the host's memory.

    fsdp2-ext plan MODEL_DIR --recipe recipes/qwen38_flash_next_bf16_lora_grpo [--json]

``plan_host`` takes the model (built on meta), its ``MemoryPlan`` (``planner.py``: the trainer's
shards and tables) and the recipe's settings (``recipe_settings.py``: as ``main_ppo`` composes
them), and returns one table per host: each line with its bytes, its formula, where its figure
comes from, whether it is exact, an estimate, an input or unknown, and whether Ray's memory
monitor counts it. The total of the counted lines is held against ``threshold x host memory``.

[Note: what a host holds during a run]
Per host, H = n_gpus_per_node trainer ranks and H inference ranks (VERL's hybrid engine colocates
one of each on every GPU), T the bytes of the frozen tables, S a rank's shard bytes:

- trainer, tables: T once when they are views of a local checkpoint or host-shared
  (``VERL_NO_PLACEMENT_MMAP_DIR``), else H x T (every rank its own copy). Exact (the model).
- trainer, offload: with ``param_offload`` H x S of shards on the host; with
  ``optimizer_offload`` H x the two AdamW moments of a rank's trainable shards. Exact.
- trainer, rank 0's load: with the ``rank0`` init source, rank 0 holds the full model and its
  staging (``MemoryPlan.peak_rank0_cpu_bytes_during_load``) on host 0 during the init only, before
  any rollout sleeps: shown, never added to the steady total. The ``checkpoint`` source has none.
- rollout, weights backup: vLLM sleeps at level 1 by VERL's rule ([Note: VERL's sleep rule, run
  from its source]) and then copies every "weights" allocation of each inference rank into pinned
  host memory for the whole run: its TP shard of the weights (estimate: every tensor of two or
  more dimensions split over TP, vectors whole, in the rollout's dtype; the tables excluded, where
  the serving overlay keeps them is its own), the LoRA slots (vLLM's ``max_loras = 1`` at VERL's
  ``get_vllm_max_lora_rank``, split over TP) and the MTP drafter (estimate: one decoder layer of
  the model per speculative head is not known from the config; one layer, split over TP).
  H x that per host. At level 2 nothing is kept. An input (``--rollout-backup-gib``) replaces the
  estimate where the model's config is not at hand (the spec's 90.30 GiB).
- rollout, pinned rounding: torch's pinned allocator rounds each allocation up to a power of two
  (``CachingHostAllocator.h``: ``roundSize = c10::llvm::PowerOf2Ceil(size)``; vLLM #16663). Each
  backup is one ``torch.empty(size, pin_memory=True)`` per cumem allocation of the weights pool
  (vLLM's ``CuMemAllocator.sleep``), and those allocations are the CUDA caching allocator's
  segments: a tensor of 10 MiB or more its own segment rounded up to 2 MiB, smaller ones packed in
  20 MiB (over 1 MiB) or 2 MiB segments. Estimated from the model's tensors; unknown (below 1x
  the backup) when the backup is an input.
- rollout, the PLE (n-gram) table: vLLM builds Qwen4Exp's tables in every inference rank, each
  rank its rows over the embedding-parallel size, pinned with the engram config's ``cpu_offload``
  (vLLM's default), on the device without it (then in the level-1 backup); one pinned request per
  layer, rounded as above unless the workers' ``PYTORCH_ALLOC_CONF`` sets a threshold below it;
  with ``FSDP2_EXT_PLE_HOST_COPY`` one copy of each row range per host, never rounded
  ([Note: the PLE rows in a host copy]), or none beyond the trainer's when the trainer's tables are
  host-shared, the rollout loads the checkpoint (``load_format`` auto or safetensors) and both
  sides use one dtype ([Note: the trainer's table served to the rollout]).
  Exact, by vLLM's rule ([Note: the rollout's host memory] in ``rollout_memory.py``). With an
  input backup, ``cpu_offload`` decides whether the input holds the rows (off) or not (on).
- rollout, ``hf`` (the CPU recipe): the replica's weights live in host memory all along, its own
  copy of each table when the tables cannot be views of the checkpoint.
- the adapter-only sync (LoRA as an adapter, vLLM): every trainer rank's host copy of the adapter
  and, without CUDA IPC, VERL's shared-memory bucket, during a sync; vLLM's CPU copy of the
  adapter in every TP worker for the whole run, pinned and so rounded per tensor on a GPU host
  ([Note: what an adapter sync holds on the host] in ``sync_memory.py``). Exact from the adapter
  PEFT builds; held to the byte against the CPU run's processes (``tests/verl/test_vllm_main_ppo.py``).
  The sync's lines are added to the steady ones (a peak during the sync, which runs between
  ``wake_up`` and generation): vLLM 0.34 keeps the level-1 backup across ``wake_up``, and 0.32
  drops it there (``cumem.py:360``) into torch's caching host allocator, which keeps pinned blocks
  until its own ``empty_cache``: no host memory comes back for the sync to use.
- Ray's object store: ``ray_init.object_store_memory`` or Ray's default, min(0.3 x the memory
  available at start, 200e9 B) (``ray_constants.py``), shared memory filled as objects are put:
  its capacity is shown, not counted (how much of it a run fills is unknown).
- the workers' own resident memory (Python, torch, CUDA context, NCCL buffers, vLLM's engine
  processes, Ray's raylet and agents): unknown on a GPU host; ``--process-resident-gib`` counts
  a figure per process for the 2 x H worker processes. ``docs/BENCHMARKS.md`` has what the CPU
  recipe's processes hold.
- page cache of the checkpoint: the files a host reads (the trainer's rows, vLLM's full read),
  clean and reclaimable: shown, not counted (Ray's monitor takes MemAvailable, which counts it).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from fsdp2_ext.plan.planner import GIB, MemoryPlan, _lora_shapes
from fsdp2_ext.plan.recipe_settings import RecipeSettings
from fsdp2_ext.vllm.rollout_memory import (
    engram_settings,
    etp_size,
    pinned_bytes,
    pinned_round_threshold,
    ple_bytes_per_rank,
    ple_planes,
    vllm_rules,
)
from fsdp2_ext.vllm.sync_memory import plan_sync
from fsdp2_ext.vllm.vllm_plugin import SHARED_LOAD_FORMATS

__all__ = ["HostLine", "HostPlan", "format_host_plan", "host_memtotal", "plan_host"]

RAY_THRESHOLD_ENV = "RAY_memory_usage_threshold"
RAY_DEFAULT_THRESHOLD = 0.95  # Ray's memory monitor as Ray ships it
RAY_OBJECT_STORE_PROPORTION = 0.3  # ray_constants.DEFAULT_OBJECT_STORE_MEMORY_PROPORTION
RAY_OBJECT_STORE_CAP = 200 * 10**9  # ray_constants.DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # VERL's fallback of vLLM's MaxLoRARanks
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")  # vLLM's row-parallel projections
_MIB = 1 << 20
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class HostLine:
    side: str  # trainer | rollout | ray | system
    item: str
    bytes: int | None  # None: unknown
    formula: str
    kind: str  # exact | estimate | input | unknown | bound
    counted: bool  # in the steady total held against Ray's threshold

    @property
    def gib(self) -> float | None:
        return None if self.bytes is None else self.bytes / GIB


@dataclass
class HostPlan:
    ranks_per_host: int
    host_memory_bytes: int
    threshold: float
    threshold_source: str
    lines: list[HostLine] = field(default_factory=list)
    knobs: list[str] = field(default_factory=list)
    per_rank: dict[str, dict[str, int]] = field(default_factory=dict)  # process -> figure -> B
    # what the total grows by if a saving the plan counts does not happen at run time
    # ([Note: the plan's saving, required]), and why it would not
    fallback_bytes: int = 0
    fallback_why: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(line.bytes for line in self.lines if line.counted and line.bytes is not None)

    @property
    def limit_bytes(self) -> int:
        return int(self.threshold * self.host_memory_bytes)

    @property
    def unknown(self) -> list[str]:
        """The lines the total holds but cannot size: what the verdict depends on."""
        return [line.item for line in self.lines if line.counted and line.bytes is None]

    @property
    def fits(self) -> bool:
        """Fits for certain: under Ray's kill line with every line sized. A plan with unknown
        lines is ``conditional`` at best: the spec's unshared run fitted on the known lines and
        was killed on the ~408 GiB they do not name."""
        return self.total_bytes <= self.limit_bytes and not self.unknown

    @property
    def conditional(self) -> bool:
        """Under the line on the known lines, with unknown lines that may take it over."""
        return self.total_bytes <= self.limit_bytes and bool(self.unknown)

    @property
    def verdict(self) -> str:
        margin = (self.limit_bytes - self.total_bytes) / GIB
        unknown = ", ".join(self.unknown)
        if margin < 0:
            tail = f" (and unknown: {unknown})" if unknown else ""
            return f"does not fit: {-margin:,.2f} GiB over{tail}"
        if unknown:
            return (
                f"fits only if the unknown lines ({unknown}) stay under {margin:,.2f} GiB "
                "together: not a pass; size them (the flags named in their lines) or acknowledge"
            )
        return f"fits, {margin:,.2f} GiB to spare"

    @property
    def fallback_verdict(self) -> str:
        """The verdict on the total without the conditional saving ("" when there is none)."""
        if not self.fallback_bytes:
            return ""
        margin = (self.limit_bytes - self.total_bytes - self.fallback_bytes) / GIB
        return (f"fits on the known lines, {margin:,.2f} GiB to spare" if margin >= 0
                else f"does not fit: {-margin:,.2f} GiB over")  # fmt: skip

    def to_dict(self) -> dict:
        lines = [dict(asdict(line), gib=line.gib) for line in self.lines]
        return dict(
            asdict(self), lines=lines, total_bytes=self.total_bytes,
            fallback_total_bytes=self.total_bytes + self.fallback_bytes,
            fallback_verdict=self.fallback_verdict,
            limit_bytes=self.limit_bytes, fits=self.fits, conditional=self.conditional,
            unknown=self.unknown, verdict=self.verdict,
        )  # fmt: skip


def host_memtotal() -> int:
    """This host's MemTotal (bytes)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def ray_threshold(environ=None) -> tuple[float, str]:
    environ = os.environ if environ is None else environ
    value = environ.get(RAY_THRESHOLD_ENV)
    if value:
        return float(value), f"{RAY_THRESHOLD_ENV}={value}"
    return RAY_DEFAULT_THRESHOLD, f"Ray's default ({RAY_DEFAULT_THRESHOLD})"


def _tp_shard_elements(shape, tp: int) -> int:
    if len(shape) >= 2:
        return -(-shape[0] // tp) * math.prod(shape[1:])
    return math.prod(shape)


def _segments(tensor_bytes: list[int]) -> list[int]:
    """The CUDA caching allocator's segments for these allocations (estimate, see the Note)."""
    large = [-(-b // (2 * _MIB)) * 2 * _MIB for b in tensor_bytes if b >= 10 * _MIB]
    medium = sum(b for b in tensor_bytes if _MIB < b < 10 * _MIB)
    small = sum(b for b in tensor_bytes if b <= _MIB)
    return large + [20 * _MIB] * -(-medium // (20 * _MIB)) + [2 * _MIB] * -(-small // (2 * _MIB))


def _vllm_ple(model: nn.Module, tables: list[str], settings: RecipeSettings, dtype, rules):
    """(engram settings, each PLE allocation's bytes on one inference rank: one per layer, two
    for NVFP4 on 0.33+) where vLLM builds PLE tables for this model (Qwen4Exp with
    ``ple_layer_ids``), else None."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not str(getattr(text, "model_type", "")).startswith("qwen4_exp"):
        return None
    if not getattr(text, "ple_layer_ids", None):
        return None
    params = dict(model.named_parameters())
    shapes = [tuple(params[f].shape) for f in tables if f in params]
    if not shapes:
        return None
    engram = engram_settings(settings.vllm_engine_kwargs, settings.vllm_version)
    # VERL's vLLM replicas are engines of DP 1 each (one per TP group of GPUs)
    etp = etp_size(settings.tensor_parallel_size, 1, engram.embedding_across_dp)
    element = torch.empty((), dtype=dtype).element_size()
    padding = int(getattr(text, "make_ngram_vocab_size_divisible_by", None) or 1)
    embedding_dtype = getattr(text, "ple_embedding_dtype", None)
    allocations = [
        ple_bytes_per_rank([(shape[0], row)], 1, etp, padding)[0]
        for shape in shapes
        for row in ple_planes(math.prod(shape[1:]), element, embedding_dtype, rules)
    ]
    return engram, allocations


def _vllm_lora_rank(rank: int) -> int:
    return next((r for r in VLLM_LORA_RANKS if rank <= r), rank)


def _rollout_weights(model: nn.Module, tables: set[str], settings: RecipeSettings, dtype):
    """(TP-shard tensor bytes of one inference rank's base weights, LoRA slot bytes, drafter)."""
    tp = max(1, settings.tensor_parallel_size)
    element = torch.empty((), dtype=dtype).element_size()
    base = [
        _tp_shard_elements(p.shape, tp) * element
        for fqn, p in model.named_parameters()
        if fqn not in tables
    ] + [
        b.numel() * (element if b.is_floating_point() else b.element_size())
        for _, b in model.named_buffers()
    ]
    lora = 0
    if settings.lora_rank > 0 and not settings.lora_merge:
        rank = (
            settings.lora_rank
            if settings.rollout_name != "vllm"
            else _vllm_lora_rank(settings.lora_rank)
        )
        shapes = _lora_shapes(model, rank, settings.target_modules, settings.target_parameters)
        divisor = tp if settings.rollout_name == "vllm" else 1
        lora = sum(math.prod(s) for s in shapes) * element // divisor
    drafter = 0
    if settings.mtp_rollout:
        layers = getattr(getattr(model, "model", model), "layers", None)
        if layers is not None and len(layers):
            frozen = {id(p) for fqn, p in model.named_parameters() if fqn in tables}
            biggest = max(
                sum(p.numel() for p in layer.parameters() if id(p) not in frozen)
                for layer in layers
            )
            drafter = -(-biggest // tp) * element
    return base, lora, drafter


def tables_stored_in_pieces(model: nn.Module, fqns) -> list[str]:
    """The tables a Transformers checkpoint of ``model`` stores in pieces: a converter of the
    model's conversion mapping builds them (qwen4_exp's ``ngram_embedding.shard_*.weight`` ->
    ``ngram_embedding.weight``), so ``save_pretrained`` writes the pieces and a load can never view
    them ([Note: zero-copy tables])."""
    import fnmatch

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        converters = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 (no mapping: nothing is converted)
        return []
    targets = [
        pattern
        for converter in converters
        if type(converter).__name__ == "WeightConverter"
        for pattern in converter.target_patterns
    ]
    return [f for f in fqns if any(fnmatch.fnmatch(f, "*" + p) for p in targets)]


def tables_are_views_by_default(model: nn.Module, settings: RecipeSettings, fqns) -> bool:
    """Whether a recipe's tables are views of the checkpoint: the checkpoint init source, and no
    table stored in pieces (the dtype and the filesystem are the launch's: ``--tables-are-views``)."""
    return settings.init_source == "checkpoint" and not tables_stored_in_pieces(model, fqns)


def plan_host(
    model: nn.Module,
    memory: MemoryPlan,
    settings: RecipeSettings,
    *,
    host_memory_bytes: int | None = None,
    threshold: float | None = None,
    backup_bytes_per_rank: int | None = None,
    process_resident_bytes: int | None = None,
    tables_are_views: bool | None = None,
    environ=None,
) -> HostPlan:
    """The per-host table of [Note: what a host holds during a run]."""
    environ = os.environ if environ is None else environ
    H = settings.gpus_per_node
    T = sum(memory.no_placement.values())
    S = memory.shard_bytes_per_gpu
    host = host_memory_bytes or host_memtotal()
    if threshold is None:
        threshold, threshold_source = ray_threshold(environ)
    else:
        threshold_source = "--ray-threshold"
    plan = HostPlan(H, host, threshold, threshold_source)
    add = plan.lines.append
    element = torch.empty((), dtype=_DTYPES.get(settings.model_dtype, torch.float32)).element_size()
    rollout_dtype = getattr(torch, settings.rollout_dtype, None) or _DTYPES.get(
        settings.rollout_dtype, torch.bfloat16
    )
    views = (
        tables_are_views_by_default(model, settings, list(memory.no_placement))
        if tables_are_views is None
        else tables_are_views
    )
    shared = bool(settings.shared_directory)
    # -- trainer
    if T:
        if views or shared:
            how = "views of the local checkpoint" if views else "host-shared"
            add(HostLine("trainer", f"no-placement tables ({how})", T,
                         "T, once per host; on a disk directory these pages are page cache, which "
                         "Ray's monitor takes for available memory (MemAvailable) though mapped "
                         "and, once a rollout registers them, pinned: the plan counts them used, "
                         "Ray does not (on /dev/shm they are shmem, which it counts)",
                         "exact", True))  # fmt: skip
        else:
            add(HostLine("trainer", "no-placement tables (one copy per rank)", H * T,
                         f"H x T = {H} x {T / GIB:.2f} GiB", "exact", True))  # fmt: skip
    if settings.param_offload:
        add(HostLine("trainer", "param_offload: shards on the host", H * S,
                     f"H x S = {H} x {S / GIB:.2f} GiB", "exact", True))  # fmt: skip
    if settings.optimizer_offload:
        moments = 2 * memory.lora_bytes_per_gpu if memory.lora_parameters else 2 * S
        add(HostLine("trainer", "optimizer_offload: AdamW moments", H * moments,
                     "H x 2 x a rank's trainable shard bytes", "exact", True))  # fmt: skip
    if settings.init_source != "checkpoint":
        add(HostLine("trainer", "rank 0's load (host 0, during the init only)",
                     memory.peak_rank0_cpu_bytes_during_load,
                     "full model + buffers + 2 x (W - 1) staging parts", "exact", False))  # fmt: skip
    # -- rollout
    base, lora, drafter = _rollout_weights(model, set(memory.no_placement), settings, rollout_dtype)
    weights = sum(base) + lora + drafter
    tp = settings.tensor_parallel_size
    plan.per_rank["trainer"] = {
        "shard_bytes": S,
        "lora_bytes": memory.lora_bytes_per_gpu,
        "table_bytes": T,
    }
    plan.per_rank["inference"] = {
        "weights_bytes": sum(base),
        "lora_bytes": lora,
        "drafter_bytes": drafter,
    }
    if settings.rollout_name == "vllm":
        level = settings.sleep_level
        threshold, threshold_from = pinned_round_threshold(settings.alloc_conf)
        rules = vllm_rules(settings.vllm_version)
        ple = _vllm_ple(model, list(memory.no_placement), settings, rollout_dtype, rules)
        disk = ple is not None and ple[0].disk_offload and rules.disk_offload
        if disk:  # no rows on the host or the device: the files' pages, read each step
            add(HostLine("rollout", "vLLM PLE table rows (engram disk_offload)", 0,
                         f"vLLM {rules.version}: read from the checkpoint files each step, none "
                         "allocated (nvidia/ngram_embedding.py:63-127); their page cache is "
                         "reclaimable", "exact", True))  # fmt: skip
            ple = None
        ple_rows = ple[1] if ple is not None and ple[0].cpu_offload else []
        loads_checkpoint = settings.load_format in SHARED_LOAD_FORMATS  # else the plugin stands by
        host_copy = settings.ple_host_copy and loads_checkpoint
        trainer_shares = (  # the rows it would serve: [Note: the trainer's table served ...]
            shared and not views and _DTYPES.get(settings.model_dtype) == rollout_dtype
        )  # fmt: skip
        trainer_serves = host_copy and trainer_shares
        ple_on_device = ple[1] if ple is not None and not ple[0].cpu_offload else []
        if ple is not None:
            engram = ple[0]
            how = "explicit in the recipe" if engram.explicit else "vLLM's default"
            plan.per_rank["inference"]["ple_bytes"] = sum(ple[1])
            plan.per_rank["inference"]["ple_allocations"] = list(ple[1])
            if engram.cpu_offload and host_copy:  # [Note: the plan's saving, required]
                own_rows = H * sum(pinned_bytes(b, threshold) for b in ple_rows)
                shared_rows = 0 if trainer_serves else min(tp, H) * sum(ple_rows)
                plan.fallback_bytes = own_rows - shared_rows
                plan.fallback_why = (
                    "every inference rank falls back to vLLM's own pinned PLE rows (the plugin "
                    "cannot share them; its GPU check is pending): FSDP2_EXT_PLE_HOST_COPY=require "
                    "refuses the engine's start instead"
                )  # fmt: skip
            if engram.cpu_offload and trainer_serves:
                add(HostLine("rollout", "vLLM PLE table rows (the trainer's table, read-only)", 0,
                             "each rank maps its rows of the trainer's host-shared table (GPU check pending), counted "
                             "above (FSDP2_EXT_PLE_HOST_COPY, VERL_NO_PLACEMENT_MMAP_DIR, "
                             f"load_format {settings.load_format}, dtype {rollout_dtype}: "
                             "[Note: the trainer's table served to the rollout])", "exact",
                             True))  # fmt: skip
            elif engram.cpu_offload and host_copy:
                add(HostLine("rollout", "vLLM PLE table rows (one host copy, shmem)",
                             min(tp, H) * sum(ple_rows),
                             f"min(ETP {tp}, H) row ranges x {sum(ple_rows) / GIB:.2f} GiB, each mapped by "
                             f"the {H // max(tp, 1)} replicas' rank (FSDP2_EXT_PLE_HOST_COPY; "
                             f"engram {how}; {engram.rule}; not rounded: shared memory, not the "
                             "pinned allocator)", "exact", True))  # fmt: skip
            elif engram.cpu_offload:
                add(HostLine("rollout", "vLLM PLE table rows (pinned, cpu_offload)",
                             H * sum(ple_rows),
                             f"H x rows / ETP {settings.tensor_parallel_size} per layer = {H} x "
                             f"{sum(ple_rows) / GIB:.2f} GiB: {H // max(tp, 1)} copies of the "
                             f"table (engram {how}; {engram.rule})", "exact", True))  # fmt: skip
                rounding = sum(pinned_bytes(b, threshold) - b for b in ple_rows)
                add(HostLine("rollout", "pinned rounding of the PLE rows", H * rounding,
                             f"H x (pow2ceil(a layer's rows) - rows) per layer; {threshold_from}",
                             "exact", True))  # fmt: skip
        if level == 1:
            if backup_bytes_per_rank is not None:
                holds = " (holds the PLE rows: cpu_offload off)" if ple_on_device else ""
                add(HostLine("rollout", "vLLM level-1 weights backup (pinned)",
                             H * backup_bytes_per_rank,
                             f"H x backup = {H} x {backup_bytes_per_rank / GIB:.2f} GiB{holds}",
                             "input", True))  # fmt: skip
                if rules.backup_rounded:
                    add(HostLine("rollout", "pinned allocator rounding", None,
                                 "per allocation, up to the next power of two: below 1 x the "
                                 f"backup; needs the allocations (the model's config); "
                                 f"{threshold_from}", "unknown", True))  # fmt: skip
                else:
                    add(_unrounded_backup(rules))
            else:
                on_device = sum(ple_on_device)
                add(HostLine("rollout", "vLLM level-1 weights backup (pinned)",
                             H * (weights + on_device),
                             f"H x (TP-{tp} shard {sum(base) / GIB:.2f} + LoRA slots "
                             f"{lora / GIB:.2f} + drafter {drafter / GIB:.2f}"
                             + (f" + PLE rows on the device {on_device / GIB:.2f}" if on_device
                                else "") + " GiB)",
                             "estimate", True))  # fmt: skip
                segments = _segments(base) + _segments([lora, drafter]) + list(ple_on_device)
                rounding = sum(pinned_bytes(s, threshold) for s in segments) - weights - on_device
                if rules.backup_rounded:
                    add(HostLine("rollout", "pinned allocator rounding", H * rounding,
                                 f"H x sum(pow2ceil(segment) - tensor bytes) over "
                                 f"{len(segments)} segments; {threshold_from}", "estimate",
                                 True))  # fmt: skip
                else:
                    add(_unrounded_backup(rules))
        else:
            add(HostLine("rollout", f"vLLM level-{level} sleep: weights discarded", 0,
                         "nothing kept on the host", "exact", True))  # fmt: skip
        if ple_rows and not host_copy:
            rounded = H * sum(pinned_bytes(b, threshold) for b in ple_rows)
            if threshold is None and rounded > H * sum(ple_rows):
                plan.knobs.append(
                    "PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:64 in the workers' env: "
                    f"the PLE rows unrounded, -{(rounded - H * sum(ple_rows)) / GIB:,.2f} GiB "
                    "(and every backup allocation above 64 MiB)"
                )
            kept = 0 if trainer_shares else min(tp, H) * sum(ple_rows)
            plan.knobs.append(
                "FSDP2_EXT_PLE_HOST_COPY=require in the workers' env"
                + ("" if loads_checkpoint else " and rollout.load_format=safetensors (the plugin "
                   f"shares only the checkpoint's rows, not {settings.load_format}'s)")
                + ": the rollout's PLE rows "
                + ("read-only from the trainer's host-shared table ([Note: the trainer's table "
                   "served to the rollout]" if trainer_shares
                   else "from one host copy ([Note: the PLE rows in a host copy]")
                + f"; GPU check pending): -{(rounded - kept) / GIB:,.2f} GiB"
            )  # fmt: skip
        if settings.lora_rank > 0 and not settings.lora_merge:
            _sync_lines(plan, model, settings, threshold, threshold_from)
        add(HostLine("rollout", "vLLM CPU swap / offload", 0,
                     "VERL 0.9.1 passes neither swap_space nor cpu_offload_gb; the recipe sets "
                     "none (vLLM's own defaults not read: vLLM not installed here)",
                     "estimate", True))  # fmt: skip
    elif settings.rollout_name == "hf":
        add(HostLine("rollout", "hf replicas' weights (host memory)", H * (sum(base) + lora),
                     f"H x (weights {sum(base) / GIB:.4f} + adapter {lora / GIB:.4f} GiB)",
                     "exact", True))  # fmt: skip
        if T and not views:
            add(HostLine("rollout", "hf replicas' own tables", H * T, "H x T", "exact", True))
    else:
        add(HostLine("rollout", f"{settings.rollout_name} rollout", None,
                     "not modelled", "unknown", True))  # fmt: skip
    # -- Ray and the processes
    if settings.object_store_bytes:
        store, formula = settings.object_store_bytes, "ray_init.object_store_memory"
    else:
        store = min(int(RAY_OBJECT_STORE_PROPORTION * host), RAY_OBJECT_STORE_CAP)
        formula = "min(0.3 x available at start (here: x MemTotal), 200e9 B)"
    add(HostLine("ray", "object store capacity (/dev/shm, filled as objects are put)", store,
                 formula, "bound", False))  # fmt: skip
    if process_resident_bytes is not None:
        add(HostLine("system", "worker processes' own resident memory",
                     2 * H * process_resident_bytes,
                     f"2H x {process_resident_bytes / GIB:.2f} GiB per process", "input", True))  # fmt: skip
    else:
        add(HostLine("system", "worker processes' own resident memory", None,
                     "2H processes x (Python, torch, CUDA context, NCCL, vLLM engine): "
                     "--process-resident-gib", "unknown", True))  # fmt: skip
    add(HostLine("system", "page cache of the checkpoint (reclaimable)",
                 memory.parameters * element,
                 "the files' bytes a host reads (trainer rows, vLLM's read)", "bound", False))  # fmt: skip
    backup = backup_bytes_per_rank if backup_bytes_per_rank is not None else weights
    _knobs(plan, settings, H, T, views or shared, backup)
    return plan


def _unrounded_backup(rules) -> HostLine:
    return HostLine("rollout", "pinned allocator rounding", 0,
                    f"vLLM {rules.version} ({rules.source}): each backup is an anonymous mapping "
                    "registered with cudaHostRegister (cumem.py:70-83), not the pinned allocator; "
                    "kept across wake_up", "exact", True)  # fmt: skip


def _sync_lines(plan: HostPlan, model, settings: RecipeSettings, threshold, threshold_from):
    """The adapter-only sync's lines ([Note: what an adapter sync holds on the host])."""
    H, add = plan.ranks_per_host, plan.lines.append
    shapes = _lora_shapes(model, settings.lora_rank, settings.target_modules,
                          settings.target_parameters)  # fmt: skip
    sync = plan_sync(
        shapes, model_dtype=settings.model_dtype, rollout_dtype=settings.rollout_dtype,
        device=settings.device, bucket_megabytes=settings.bucket_megabytes,
        pinned_threshold=threshold,
    )  # fmt: skip
    plan.per_rank["trainer"]["sync_adapter_bytes"] = sync.trainer_adapter_bytes
    plan.per_rank["inference"]["adapter_cpu_bytes"] = sync.worker_adapter_bytes
    params = f"{sync.adapter_parameters:,} adapter parameters (PEFT's)"
    add(HostLine("trainer", "adapter sync: the adapter on the host (during a sync)",
                 H * sync.trainer_adapter_bytes,
                 f"H x {params} x {settings.model_dtype} (collect_lora_params' .cpu(), every "
                 "rank at once)", "exact", True))  # fmt: skip
    if sync.bucket_host_bytes:
        add(HostLine("trainer", "adapter sync: VERL's shared-memory bucket (during a sync)",
                     H * sync.bucket_host_bytes,
                     f"H x min(bucket {settings.bucket_megabytes} MiB, the adapter's bytes): no "
                     "CUDA IPC, the pages written", "exact", True))  # fmt: skip
    else:
        add(HostLine("trainer", "adapter sync: VERL's bucket (on the GPU: CUDA IPC)", 0,
                     f"{settings.bucket_megabytes} MiB per rank on its GPU", "exact", True))  # fmt: skip
    if sync.worker_received_host_bytes:
        add(HostLine("rollout", "adapter sync: the workers' two received clones (during a sync)",
                     H * sync.worker_received_host_bytes,
                     f"H x 2 x the adapter in {settings.model_dtype} (the worker's device is the "
                     "CPU)", "exact", True))  # fmt: skip
    how = "pinned, " if sync.pinned else ""
    add(HostLine("rollout", f"vLLM's CPU copy of the adapter ({how}each TP worker)",
                 H * sync.worker_adapter_bytes,
                 f"H x {params} x {settings.rollout_dtype} (from_lora_tensors(device='cpu'), kept "
                 "in the LoRA manager's CPU cache for the run)", "exact", True))  # fmt: skip
    if sync.pinned:
        add(HostLine("rollout", "pinned rounding of vLLM's adapter copies",
                     H * (sync.worker_adapter_pinned_bytes - sync.worker_adapter_bytes),
                     f"H x sum(pow2ceil(a tensor's bytes) - bytes) over {len(shapes)} tensors, each "
                     f"pinned on its own; {threshold_from}", "exact", True))  # fmt: skip


def _knobs(plan: HostPlan, settings: RecipeSettings, H: int, T: int, shared: bool, backup):
    gib = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
    if T and not shared:
        plan.knobs.append(
            f"host sharing (VERL_NO_PLACEMENT_MMAP_DIR on a node-local disk): -{gib((H - 1) * T)}"
        )
    if settings.rollout_name == "vllm" and settings.sleep_level == 1:
        why = [w for w, on in (("MTP rollout", settings.mtp_rollout),
                               ("LoRA as an adapter", settings.lora_rank > 0
                                and not settings.lora_merge)) if on]  # fmt: skip
        plan.knobs.append(
            f"sleep level 2 (VERL's rule needs: no {' and no '.join(why)}): the whole backup, "
            f"-{gib(H * backup)} and its rounding"
        )
        if settings.tensor_parallel_size < H:
            plan.knobs.append(
                f"TP {2 * settings.tensor_parallel_size}: the backup per host about halves "
                f"(each rank keeps 1/TP): ~-{gib(H * backup / 2)}"
            )
    if settings.param_offload:
        plan.knobs.append("param_offload off: the shards go back to the GPUs")


def format_host_plan(plan: HostPlan) -> str:
    def gib(value) -> str:
        return "unknown" if value is None else f"{value / GIB:,.2f} GiB"

    lines = [
        f"  per host ({plan.ranks_per_host} GPUs: {plan.ranks_per_host} trainer + "
        f"{plan.ranks_per_host} inference ranks); exact = from the model and recipe, estimate = "
        "a stated model of vLLM/CUDA, input = given, unknown = not in the total:",
    ]
    for line in plan.lines:
        mark = "" if line.counted else "  (not counted)"
        lines.append(
            f"    {line.side:<8} {line.item:<58} {gib(line.bytes):>14}  [{line.kind}]{mark}"
        )
        lines.append(f"             = {line.formula}")
    lines.append(
        f"  total {gib(plan.total_bytes)} of {gib(plan.host_memory_bytes)}; Ray kills above "
        f"{plan.threshold:g} ({plan.threshold_source}) = {gib(plan.limit_bytes)}: {plan.verdict}"
    )
    if plan.fallback_bytes:
        lines.append(
            f"  without the PLE saving (conditional): total "
            f"{gib(plan.total_bytes + plan.fallback_bytes)}, +{gib(plan.fallback_bytes)} if "
            f"{plan.fallback_why}: {plan.fallback_verdict}"
        )
    if plan.knobs:
        lines.append("  what each knob buys:")
        lines += [f"    {knob}" for knob in plan.knobs]
    return "\n".join(lines)
