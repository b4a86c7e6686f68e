"""The private parts of FSDP2 that fsdp2_ext relies on, named once and checked at import.

[Note: FSDP2 internals]
The sharded init writes FSDP2's own padded shard buffers in place ([Note: shard padding]), so it
reads and swaps a few private members of ``torch.distributed.fsdp._fully_shard``:

- ``FSDPModule._get_fsdp_state()`` -> ``FSDPState._fsdp_param_group`` ->
  ``FSDPParamGroup.fsdp_params``: the ``FSDPParam`` of every parameter of a unit;
- on each ``FSDPParam``: ``_module_info`` (``module``, ``param_name``), ``_orig_size``,
  ``sharded_size``, ``sharded_param``, ``pin_memory``, ``to_sharded_dtensor``,
  ``_sharded_param_data`` and ``reset_sharded_param`` (which, given ``_sharded_param_data``
  already holding the padded storage, neither re-pads nor copies).

They are the same from torch 2.11 to 2.15 (checked by ``make compat``). ``check()`` runs when
this module is imported (the sharded init imports it): a torch that lacks one of them fails there,
naming the torch version and every missing member, instead of failing mid-load. A member is found
on the class (methods, properties) or, for what ``__init__`` assigns, in the class's source
(``self.<name> =``): what an instance would have, without building one.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["REQUIRED", "adopt_padded_shard", "check", "fsdp_params_by_fqn", "missing_members"]

_PACKAGE = "torch.distributed.fsdp._fully_shard"
# (module, class) -> members: each an attribute of the class (method, property) or assigned in
# its source (``self.<name> =``, an instance attribute set in ``__init__``).
REQUIRED: dict[tuple[str, str], tuple[str, ...]] = {
    ("torch.distributed.fsdp", "FSDPModule"): ("_get_fsdp_state",),
    (f"{_PACKAGE}._fsdp_state", "FSDPState"): ("_fsdp_param_group",),
    (f"{_PACKAGE}._fsdp_param_group", "FSDPParamGroup"): ("fsdp_params",),
    (f"{_PACKAGE}._fsdp_param", "FSDPParam"): (
        "to_sharded_dtensor",
        "reset_sharded_param",
        "_module_info",
        "_orig_size",
        "sharded_size",
        "sharded_param",
        "pin_memory",
        "_sharded_param_data",
    ),
}


def missing_members() -> list[str]:
    """``module.Class.member`` for every member of ``REQUIRED`` this torch lacks."""
    missing = []
    for (module_name, class_name), members in REQUIRED.items():
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{class_name}")
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):  # no source shipped: only class attributes can be checked
            source = None
        for name in members:
            if hasattr(cls, name):
                continue
            if source is None or re.search(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=", source):
                continue
            missing.append(f"{module_name}.{class_name}.{name}")
    return missing


def check() -> None:
    missing = missing_members()
    if missing:
        raise ImportError(
            f"fsdp2_ext: torch {torch.__version__} lacks FSDP2 internals the sharded init relies "
            f"on ([Note: FSDP2 internals]): {', '.join(missing)}. Use a torch in the supported "
            "range (README: supported torch versions), or report this torch version."
        )


def fsdp_params_by_fqn(model: nn.Module) -> dict[str, Any]:
    """FQN -> ``FSDPParam`` for every FSDP2-managed parameter (FQN of its owning module)."""
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    result = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is None:
            continue
        for fsdp_param in param_group.fsdp_params:
            info = fsdp_param._module_info
            path = paths[id(info.module)]
            result[f"{path}.{info.param_name}" if path else info.param_name] = fsdp_param
    return result


def adopt_padded_shard(fsdp_param, padded: torch.Tensor) -> None:
    """Swaps the filled padded buffer into FSDP2's own parameter object (identity kept).

    ``_sharded_param_data`` is set to the padded buffer first, so ``reset_sharded_param`` sees the
    same storage and neither re-pads nor copies; see [Note: shard padding].
    """
    if fsdp_param.pin_memory and not padded.is_pinned():
        padded = padded.pin_memory()  # CPUOffloadPolicy(pin_memory=True): FSDP2 would re-pin a copy
    rows = fsdp_param.sharded_size[0]
    local = padded.narrow(0, 0, rows)
    old = fsdp_param.sharded_param
    new = nn.Parameter(fsdp_param.to_sharded_dtensor(local), requires_grad=old.requires_grad)
    torch.utils.swap_tensors(old, new)
    fsdp_param._sharded_param_data = padded.view(-1)
    fsdp_param.reset_sharded_param()


check()
