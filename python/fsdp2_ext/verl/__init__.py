"""fsdp2_ext.verl: plugs fsdp2_ext into VERL's FSDP2 engine (verl 0.9.1).

    actor_rollout_ref.model.external_lib=fsdp2_ext.verl    # VERL imports it in every worker
    # or, in your own code:  import fsdp2_ext.verl  (install() runs at import; idempotent)

What it replaces, in ``verl.utils.fsdp_utils`` and wherever VERL imported the name directly
(``verl.workers.engine.fsdp.transformer_impl``, ``fsdp_turbo_impl``), in order of use:

- ``_select_fsdp2_wrap_targets``: non-overlapping wrap targets (outermost wins);
- ``apply_fsdp2``: ``prepare_sharded`` — aliases and buffers recorded, alias-preserving meta
  conversion, no-placement tables kept on CPU (``ignored_params``), then ``fully_shard`` with VERL's
  own keywords (never moving rank 0's unsharded model to the device);
- ``fsdp2_load_full_state_dict``: ``fill_sharded`` — rank 0's state scattered as shards, ties and
  non-persistent buffers restored, tables shared per host with ``VERL_NO_PLACEMENT_MMAP_DIR``;
- ``offload_fsdp2_model_to_cpu`` / ``load_fsdp2_model_to_gpu``: no-placement aware transfers;
- ``tensordict_utils.maybe_fix_3d_position_ids``: validate-and-repair instead of a blind
  ``_ragged_idx = 2`` ([Note: VERL position IDs]).

An unsupported VERL version, or one that moved a replaced symbol, fails at import naming the
symbol and the supported versions: never a silent no-op.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.distributed as dist

from fsdp2_ext import log, positions
from fsdp2_ext.no_placement import offload, onload
from fsdp2_ext.sharded_init import _PREPARED_ATTRIBUTE, fill_sharded, prepare_sharded
from fsdp2_ext.wrap_targets import select_wrap_targets

__all__ = ["ORIGINALS", "SUPPORTED_VERSIONS", "install", "installed"]

SUPPORTED_VERSIONS = ("0.9.1",)
# Where VERL defines each replaced name, and the modules that import it by name.
_TARGETS = {
    "verl.utils.fsdp_utils": [
        "_select_fsdp2_wrap_targets",
        "apply_fsdp2",
        "fsdp2_load_full_state_dict",
        "offload_fsdp2_model_to_cpu",
        "load_fsdp2_model_to_gpu",
    ],
    "verl.utils.tensordict_utils": ["maybe_fix_3d_position_ids"],
}
_BY_NAME_IMPORTERS = [
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.fsdp.fsdp_turbo_impl",
]
ORIGINALS: dict[str, Any] = {}
_installed: list[str] = []


def installed() -> list[str]:
    """``module.name`` of every replaced symbol (empty before ``install``)."""
    return list(_installed)


def _fsdp_utils():
    return sys.modules["verl.utils.fsdp_utils"]


def _select_fsdp2_wrap_targets(model, fsdp_transformer_layer_cls_to_wrap):
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


def _apply_fsdp2(model, fsdp_kwargs, config):
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


def _fsdp2_load_full_state_dict(model, full_state, device_mesh=None, cpu_offload=None):
    if _PREPARED_ATTRIBUTE not in vars(model):
        # Not sharded by our apply_fsdp2 (another code path): VERL's own loader.
        return ORIGINALS["verl.utils.fsdp_utils.fsdp2_load_full_state_dict"](
            model, full_state, device_mesh, cpu_offload
        )
    rank = dist.get_rank(vars(model)[_PREPARED_ATTRIBUTE].group)
    fill_sharded(model, full_state if rank == 0 else None, source="rank0")
    if cpu_offload is not None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        for module in model.modules():  # VERL keeps buffers on the GPU under CPU offload
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


def _offload_fsdp2_model_to_cpu(model, empty_cache: bool = True):
    offload(model, non_blocking=True)
    if empty_cache and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_fsdp2_model_to_gpu(model):
    # VERL's get_device_id() needs an accelerator; a CPU-only run (Gloo tests) stays on the CPU.
    device = _fsdp_utils().get_device_id() if torch.accelerator.is_available() else "cpu"
    onload(model, device, non_blocking=True)


def _maybe_fix_3d_position_ids(data):
    """[Note: VERL position IDs]
    VERL's 3-D position IDs are always (C, L_i) per sample (C = 3 or 4), so a ragged@1 tensor
    whose offsets step by one C with values (B*C, L) can only be the coordinate-packed reading
    that shape inference produces for equal lengths; it is rebuilt. A label-reset tensor (values
    (C, sum L), ragged_idx 1) is relabelled. A canonical one is left alone; anything else raises
    naming both readings, where VERL used to set ``_ragged_idx = 2`` blindly."""
    if "position_ids" not in data:
        return
    ids = data["position_ids"]
    if not (getattr(ids, "is_nested", False) and ids.dim() == 3):
        return
    rows = None
    values, offsets = ids._values, ids._offsets
    steps = offsets.diff().unique()
    if ids._ragged_idx == 1 and values.dim() == 2 and steps.numel() == 1:
        step = int(steps.item())
        if values.size(0) == step * (offsets.numel() - 1) and offsets[-1].item() != values.size(1):
            rows = step
    fixed, action = positions.repair(ids, rows=rows)
    if action:
        data["position_ids"] = fixed


_REPLACEMENTS = {
    "_select_fsdp2_wrap_targets": _select_fsdp2_wrap_targets,
    "apply_fsdp2": _apply_fsdp2,
    "fsdp2_load_full_state_dict": _fsdp2_load_full_state_dict,
    "offload_fsdp2_model_to_cpu": _offload_fsdp2_model_to_cpu,
    "load_fsdp2_model_to_gpu": _load_fsdp2_model_to_gpu,
    "maybe_fix_3d_position_ids": _maybe_fix_3d_position_ids,
}


def install() -> list[str]:
    """Patches VERL in this process (idempotent); returns what was replaced."""
    if _installed:
        return list(_installed)
    try:
        import verl
    except ImportError as error:
        raise ImportError(
            f"fsdp2_ext.verl needs VERL installed (supported: {SUPPORTED_VERSIONS})"
        ) from error
    version = getattr(verl, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS:
        raise ImportError(
            f"fsdp2_ext.verl supports verl {', '.join(SUPPORTED_VERSIONS)}, found {version}; "
            "pin a supported verl or update fsdp2_ext"
        )
    modules = {name: importlib.import_module(name) for name in _TARGETS}
    missing = [
        f"{m}.{n}" for m, names in _TARGETS.items() for n in names if not hasattr(modules[m], n)
    ]
    if missing:
        raise ImportError(
            f"fsdp2_ext.verl: verl {version} lacks {missing}; it supports verl "
            f"{', '.join(SUPPORTED_VERSIONS)}"
        )
    for module_name, names in _TARGETS.items():
        for name in names:
            ORIGINALS[f"{module_name}.{name}"] = getattr(modules[module_name], name)
            setattr(modules[module_name], name, _REPLACEMENTS[name])
            _installed.append(f"{module_name}.{name}")
    for importer in _BY_NAME_IMPORTERS:
        try:
            module = importlib.import_module(importer)
        except ImportError as error:
            if importer.endswith("transformer_impl"):
                raise ImportError(f"fsdp2_ext.verl: cannot import {importer}: {error}") from error
            continue  # optional engines (turbo) that this VERL install does not have
        for name in list(_REPLACEMENTS):
            original = ORIGINALS.get(f"verl.utils.fsdp_utils.{name}") or ORIGINALS.get(
                f"verl.utils.tensordict_utils.{name}"
            )
            current = getattr(module, name, None)
            if original is not None and current is original:
                setattr(module, name, _REPLACEMENTS[name])
            if current is not None and current in (original, _REPLACEMENTS[name]):
                _installed.append(f"{importer}.{name}")  # imported before or after the patch
    log.info(f"fsdp2_ext.verl installed into verl {version}: replaced {', '.join(_installed)}")
    return list(_installed)


install()
