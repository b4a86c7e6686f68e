"""Test-only reference: VERL's wrap selection as it is today, without the ancestor check.

The negative control for ``fsdp2_ext.model.wrap_targets.select_wrap_targets``: it applies the same
candidate rules (the C++ core's ``wrap_candidate_reason``) to every module of ``named_modules()``
and keeps every candidate, so a candidate nested in another one is wrapped twice.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fsdp2_ext.model.wrap_targets import default_layer_class_names, is_tied

__all__ = ["is_wrap_candidate", "select_wrap_targets_naive"]


def is_wrap_candidate(
    path: str, module: nn.Module, layer_class_names: set[str], tied: bool
) -> bool:
    """VERL's candidate rules: a layer class; untied, an ``nn.Embedding`` or a module with a weight
    named ``embed_tokens`` / ``lm_head``. Never the root (the caller shards it last)."""
    if not path:
        return False
    if type(module).__name__ in layer_class_names:
        return True
    if tied:
        return False  # tied embed/head stay together in the root unit
    if isinstance(module, nn.Embedding):
        return True
    return path.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head") and hasattr(module, "weight")


def select_wrap_targets_naive(
    model: nn.Module,
    layer_class_names: Iterable[str] | None = None,
    *,
    tied: bool | None = None,
) -> list[nn.Module]:
    """Every candidate in ``named_modules()`` order, nested or not (defaults as
    ``select_wrap_targets``: the model's ``_no_split_modules`` and its tie)."""
    names = set(
        default_layer_class_names(model) if layer_class_names is None else layer_class_names
    )
    tied = is_tied(model) if tied is None else bool(tied)
    return [
        module
        for path, module in model.named_modules()
        if is_wrap_candidate(path, module, names, tied)
    ]
