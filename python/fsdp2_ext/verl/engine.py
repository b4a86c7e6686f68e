"""Replacements for VERL's FSDP2 helpers in ``verl.utils.fsdp_utils`` (verl 0.9.1).

In the order VERL's ``FSDPEngine`` calls them:

- ``_select_fsdp2_wrap_targets``: non-overlapping wrap targets (outermost wins);
- ``apply_fsdp2``: ``prepare_sharded``: aliases and buffers recorded, alias-preserving meta
  conversion, no-placement tables kept on CPU (``ignored_params``), then ``fully_shard`` with VERL's
  own keywords (never moving rank 0's unsharded model to the device);
- ``fsdp2_load_full_state_dict``: ``fill_sharded``: rank 0's state scattered as shards, ties and
  non-persistent buffers restored, tables shared per host with ``VERL_NO_PLACEMENT_MMAP_DIR``;
- ``offload_fsdp2_model_to_cpu`` / ``load_fsdp2_model_to_gpu``: VERL's own functions for a model
  without no-placement parameters ([Note: do no harm]); otherwise transfers that leave the tables
  where they are.

[Note: do no harm]
A replacement changes behaviour only where VERL's would be wrong: the sharded init gives the same
parameters bit for bit (and runs for every model, since it never materialises the unsharded model
on the device), while the transfer helpers call VERL's own functions unchanged unless the model
registers no-placement parameters.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext.no_placement import no_placement_params, offload, onload
from fsdp2_ext.sharded_init import _PREPARED_ATTRIBUTE, fill_sharded, prepare_sharded
from fsdp2_ext.wrap_targets import select_wrap_targets

FSDP_UTILS = "verl.utils.fsdp_utils"


def _fsdp_utils():
    return sys.modules[FSDP_UTILS]


def _original(name: str):
    from fsdp2_ext.verl import ORIGINALS

    return ORIGINALS[f"{FSDP_UTILS}.{name}"]


def select_fsdp2_wrap_targets(model, fsdp_transformer_layer_cls_to_wrap):
    return select_wrap_targets(model, fsdp_transformer_layer_cls_to_wrap)


def _layer_classes(model, config) -> list[str]:
    """VERL's own resolution: the configured wrap list, else ``_no_split_modules``."""
    default = getattr(model, "_no_split_modules", None)
    classes = (config or {}).get("wrap_policy", {}).get("transformer_layer_cls_to_wrap", default)
    if isinstance(classes, str):
        classes = [classes]
    classes = list(classes or [])
    if not classes or classes[0] is None:
        raise ValueError(
            f"apply_fsdp2: no layer classes to wrap for {type(model).__name__}; set "
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap"
        )
    return classes


def apply_fsdp2(model, fsdp_kwargs, config):
    fsdp_utils = _fsdp_utils()
    kwargs = dict(fsdp_kwargs)
    mesh = kwargs.pop("mesh")

    def fully_shard_fn(module, **shard_kwargs):
        with fsdp_utils.maybe_patch_fsdp_module(module):
            fsdp_utils.fully_shard(module, **shard_kwargs)

    prepared = prepare_sharded(
        model,
        mesh=mesh,
        layer_class_names=_layer_classes(model, config),
        fsdp_kwargs=kwargs,
        fully_shard_fn=fully_shard_fn,
    )
    if (config or {}).get("forward_prefetch", False):  # as VERL: depth 1, wrap order
        units = [m for m in prepared.wrap.modules if isinstance(m, fsdp_utils.FSDPModule)]
        for unit, following in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([following])


def fsdp2_load_full_state_dict(model, full_state, device_mesh=None, cpu_offload=None):
    if _PREPARED_ATTRIBUTE not in vars(model):
        # Not sharded by our apply_fsdp2 (another code path): VERL's own loader.
        return _original("fsdp2_load_full_state_dict")(model, full_state, device_mesh, cpu_offload)
    rank = dist.get_rank(vars(model)[_PREPARED_ATTRIBUTE].group)
    fill_sharded(model, full_state if rank == 0 else None, source="rank0")
    if cpu_offload is not None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        for module in model.modules():  # VERL keeps buffers on the GPU under CPU offload
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


def _has_no_placement_params(model) -> bool:
    return isinstance(model, nn.Module) and bool(no_placement_params(model))


def offload_fsdp2_model_to_cpu(model, empty_cache: bool = True):
    if not _has_no_placement_params(model):
        return _original("offload_fsdp2_model_to_cpu")(model, empty_cache)
    offload(model, non_blocking=True)
    if empty_cache:
        _fsdp_utils().get_torch_device().empty_cache()


def load_fsdp2_model_to_gpu(model):
    if not _has_no_placement_params(model):
        return _original("load_fsdp2_model_to_gpu")(model)
    onload(model, _verl_device(), non_blocking=True)


def _verl_device() -> torch.device:
    name, index = _fsdp_utils().get_device_name(), _fsdp_utils().get_device_id()
    return torch.device(name, index) if isinstance(index, int) else torch.device(name)
