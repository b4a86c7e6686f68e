"""fsdp2_ext's vLLM plugin: every inference rank's PLE (n-gram) rows from one copy per host.

    FSDP2_EXT_PLE_HOST_COPY=1   # in the rollout workers' env (the recipe's runtime_env); off unset

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
(``:294``), so the method knows which rows it allocates. It returns a view of this host's copy
of exactly those rows ([Note: a host copy without a group]), keyed by:
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
"""

from __future__ import annotations

import functools
import os
import weakref

import torch

from fsdp2_ext import log
from fsdp2_ext.host_copy import HostCopy, HostCopyRefused
from fsdp2_ext.patching import PatchSet

__all__ = ["ENV_PLE_HOST_COPY", "PATCHES", "enabled", "install", "register"]

ENV_PLE_HOST_COPY = "FSDP2_EXT_PLE_HOST_COPY"
_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
PATCHES = PatchSet()


def enabled(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ENV_PLE_HOST_COPY, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: installs the host copy when enabled. vLLM calls
    it unguarded in every process (``plugins/__init__.py:88-90``): a vLLM without Qwen4Exp's PLE
    class is logged, never raised."""
    if not enabled():
        return
    try:
        install()
    except (ImportError, AttributeError) as error:
        log.error(f"{ENV_PLE_HOST_COPY}: this vLLM has no Qwen4Exp PLE allocation to replace "
                  f"({error}); every rank keeps its own rows")  # fmt: skip


def install() -> list[str]:
    """Replaces the allocation (idempotent, atomic: ``PatchSet``)."""
    rebound = PATCHES.install()
    log.info(f"fsdp2_ext vLLM plugin: PLE rows from one host copy ({ENV_PLE_HOST_COPY})")
    return rebound


_SHARED_LOAD_FORMATS = ("auto", "safetensors")


@functools.lru_cache(maxsize=8)
def _checkpoint_identity(directory: str) -> tuple[str, tuple]:
    """The fingerprint of the files vLLM reads from ``directory`` and each file's identity."""
    from fsdp2_ext.model_checkpoint import checkpoint_files, checkpoint_fingerprint

    files = checkpoint_files(directory)
    identities = []
    for path in files:
        status = os.stat(os.path.realpath(path))
        identities.append((os.path.basename(path), status.st_dev, status.st_ino, status.st_size,
                           status.st_mtime_ns))  # fmt: skip
    return checkpoint_fingerprint(files), tuple(identities)


def ple_key(layer, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> dict | str:
    """The host copy's key for ``layer``'s rows ([Note: the PLE rows in a host copy]), or why
    there is none."""
    from vllm.config import get_current_vllm_config
    from vllm.platforms import current_platform

    if current_platform.is_xpu():
        return "on XPU vLLM copies unpinned host rows into a private buffer (torch_utils.py:929)"
    config = get_current_vllm_config()
    model = config.model_config.model
    load_format = str(getattr(getattr(config, "load_config", None), "load_format", "auto"))
    if load_format not in _SHARED_LOAD_FORMATS:
        return (f"load_format {load_format!r} does not write the checkpoint's rows (shared only "
                f"with {', '.join(_SHARED_LOAD_FORMATS)})")  # fmt: skip
    if not os.path.isdir(model):
        return f"the model {model!r} is not a local directory (nothing to fingerprint)"
    try:
        fingerprint, files = _checkpoint_identity(os.path.realpath(model))
    except (OSError, ValueError) as error:
        return f"the checkpoint in {model!r} cannot be fingerprinted: {error}"
    indices = layer.shard_indices
    return {
        "kind": "vllm.qwen4_exp.ple_rows",
        "checkpoint": fingerprint,
        "files": [list(f) for f in files],
        "load_format": load_format,
        "layer": layer.prefix,
        "org_vocab": [indices.org_vocab_start_index, indices.org_vocab_end_index],
        "padded": [layer.org_vocab_size_padded, layer.num_embeddings_padded],
        "rows": int(num_embeddings),
        "dim": int(embedding_dim),
        "dtype": str(dtype),
    }


def _unregister(pointer: int) -> None:
    result = torch.cuda.cudart().cudaHostUnregister(pointer)
    if int(getattr(result, "value", result)) != 0:
        log.warn(f"{ENV_PLE_HOST_COPY}: cudaHostUnregister failed: {result}")


def _register_for_device(copy: HostCopy) -> None:
    """``cudaHostRegister`` the mapping in this process, as vLLM's
    ``DPSharedEngramStorage._allocate`` does; unregistered by a finalizer on the mapping's numpy
    owner, once no tensor uses the memory (``engram.py:812-817``)."""
    if not torch.cuda.is_available():
        return
    pointer = copy.tensor.data_ptr()
    result = torch.cuda.cudart().cudaHostRegister(pointer, copy.nbytes, 0)
    if int(getattr(result, "value", result)) != 0:
        raise RuntimeError(f"cudaHostRegister of the PLE host copy failed ({result})")
    finalizer = weakref.finalize(copy.owner, _unregister, pointer)
    finalizer.atexit = False
    if not copy.tensor.is_pinned():
        raise RuntimeError("cudaHostRegister did not pin the PLE host copy")


@PATCHES.replaces(_MODULE, "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight")
def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
    """This rank's PLE rows as a view of the host's copy ([Note: the PLE rows in a host copy])."""
    key = ple_key(self, num_embeddings, embedding_dim, dtype)
    if not isinstance(key, str):
        element = torch.empty((), dtype=dtype).element_size()
        try:
            copy = HostCopy.attach(key, num_embeddings * embedding_dim * element)
            _register_for_device(copy)
        except (HostCopyRefused, TimeoutError, OSError, RuntimeError) as error:
            key = f"the host copy failed: {type(error).__name__}: {error}"
        else:
            self._fsdp2_ext_host_copy = copy  # the layer keeps the mapping (and its server) alive
            return copy.tensor.view(dtype).view(num_embeddings, embedding_dim)
    log.warn(f"{ENV_PLE_HOST_COPY}: {self.prefix}: own pinned rows, not a host copy: {key}")
    original = PATCHES.original(_MODULE, "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight")
    return original(self, num_embeddings, embedding_dim, dtype)
