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
``Qwen4ExpPLEPinnedHostEmbedding.__init__``) gives the UVA view the lookup kernel reads; without
registration that call fails rather than reading private memory, and the plugin refuses first.
Each rank's weight loader then writes its rows into the copy (``copy_ple_embedding_shard_``,
``vllm/models/qwen4_exp/common/ple.py:48-77``) as it would into its own tensor: the same bytes in
every engine. The copy is shmem, not a pinned ``torch.empty``: no power-of-two rounding.

Where the model is not a local directory (a hub name), the plugin cannot fingerprint it and the
method allocates as vLLM does, with a WARNING naming why. Proven on this CPU with vLLM's own class
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
from fsdp2_ext.host_copy import HostCopy
from fsdp2_ext.patching import PatchSet

__all__ = ["ENV_PLE_HOST_COPY", "PATCHES", "enabled", "install", "register"]

ENV_PLE_HOST_COPY = "FSDP2_EXT_PLE_HOST_COPY"
_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
PATCHES = PatchSet()


def enabled(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ENV_PLE_HOST_COPY, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: installs the host copy when enabled."""
    if enabled():
        install()


def install() -> list[str]:
    """Replaces the allocation (idempotent, atomic: ``PatchSet``)."""
    rebound = PATCHES.install()
    log.info(f"fsdp2_ext vLLM plugin: PLE rows from one host copy ({ENV_PLE_HOST_COPY})")
    return rebound


@functools.lru_cache(maxsize=8)
def _fingerprint(directory: str) -> str:
    from fsdp2_ext.model_checkpoint import checkpoint_files, checkpoint_fingerprint

    return checkpoint_fingerprint(checkpoint_files(directory))


def ple_key(layer, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> dict | str:
    """The host copy's key for ``layer``'s rows ([Note: the PLE rows in a host copy]), or why
    there is none."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    model = config.model_config.model
    if not os.path.isdir(model):
        return f"the model {model!r} is not a local directory (nothing to fingerprint)"
    indices = layer.shard_indices
    return {
        "kind": "vllm.qwen4_exp.ple_rows",
        "checkpoint": _fingerprint(os.path.realpath(model)),
        "layer": layer.prefix,
        "org_vocab": [indices.org_vocab_start_index, indices.org_vocab_end_index],
        "padded": [layer.org_vocab_size_padded, layer.num_embeddings_padded],
        "rows": int(num_embeddings),
        "dim": int(embedding_dim),
        "dtype": str(dtype),
    }


def _register_for_device(copy: HostCopy) -> None:
    """``cudaHostRegister`` the mapping in this process (once per copy), as vLLM's
    ``DPSharedEngramStorage._allocate`` does; unregistered when the mapping goes."""
    if getattr(copy, "registered", False) or not torch.cuda.is_available():
        return
    pointer = copy.tensor.data_ptr()
    result = torch.cuda.cudart().cudaHostRegister(pointer, copy.nbytes, 0)
    if int(getattr(result, "value", result)) != 0:
        raise RuntimeError(
            f"{ENV_PLE_HOST_COPY}: cudaHostRegister of the PLE host copy failed ({result}); "
            f"unset {ENV_PLE_HOST_COPY} to give each rank its own pinned rows"
        )
    if not copy.tensor.is_pinned():
        raise RuntimeError(f"{ENV_PLE_HOST_COPY}: cudaHostRegister did not pin the PLE host copy")

    def unregister(pointer=pointer) -> None:
        torch.cuda.cudart().cudaHostUnregister(pointer)

    weakref.finalize(copy, unregister).atexit = False
    copy.registered = True


@PATCHES.replaces(_MODULE, "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight")
def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
    """This rank's PLE rows as a view of the host's copy ([Note: the PLE rows in a host copy])."""
    key = ple_key(self, num_embeddings, embedding_dim, dtype)
    if isinstance(key, str):
        log.warn(f"{ENV_PLE_HOST_COPY}: {self.prefix}: own pinned rows, not a host copy: {key}")
        original = PATCHES.original(
            _MODULE, "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight"
        )
        return original(self, num_embeddings, embedding_dim, dtype)
    element = torch.empty((), dtype=dtype).element_size()
    copy = HostCopy.attach(key, num_embeddings * embedding_dim * element)
    _register_for_device(copy)
    self._fsdp2_ext_host_copy = copy  # the layer keeps the mapping (and its server) alive
    return copy.tensor.view(dtype).view(num_embeddings, embedding_dim)
