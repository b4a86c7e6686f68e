"""FSDP2 wrap-target selection that never nests one unit inside another.

Python feeds ``named_modules()`` to the C++ core, which applies VERL's candidate rules and keeps
only the outermost candidate of every branch; see [Note: non-overlapping wrap targets] in
``include/fsdp2_ext/wrap_targets.h``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from fsdp2_ext import _fsdp2_ext

__all__ = [
    "WrapReport",
    "default_layer_class_names",
    "explain_wrap_targets",
    "is_tied",
    "select_wrap_targets",
]


@dataclass
class WrapReport:
    """What was selected (path, reason) and what was skipped because an ancestor is selected."""

    modules: list[nn.Module] = field(default_factory=list)
    selected: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)


def default_layer_class_names(model: nn.Module) -> set[str]:
    """``_no_split_modules`` of the outermost module that declares it (PEFT hides it one level down)."""
    for _, module in model.named_modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def is_tied(model: nn.Module) -> bool:
    """Whether parameters are tied, as Transformers ties them: a parameter reachable under two
    names, else the ties the outermost Transformers model declares (``all_tied_weights_keys``,
    which ``from_pretrained`` empties of what the checkpoint unties), else the top-level config's
    ``tie_word_embeddings`` (the one ``get_expanded_tied_weights_keys`` reads, and VERL too)."""
    unique = {id(p) for p in model.parameters()}
    if len(unique) < sum(1 for _ in model.named_parameters(remove_duplicate=False)):
        return True
    for module in model.modules():
        declared = getattr(module, "all_tied_weights_keys", None)
        if declared is not None:
            return bool(declared)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "tie_word_embeddings", None) is not None:
            return bool(config.tie_word_embeddings)
    return False


def _module_records(
    model: nn.Module,
) -> tuple[list[str], list[nn.Module], list[_fsdp2_ext.ModuleRecord]]:
    paths, modules, records = [], [], []
    for path, module in model.named_modules():
        paths.append(path)
        modules.append(module)
        records.append(
            _fsdp2_ext.ModuleRecord(
                path,
                type(module).__name__,
                isinstance(module, nn.Embedding),
                hasattr(module, "weight"),
            )
        )
    return paths, modules, records


def _resolve(model, layer_class_names, tied):
    names = set(
        default_layer_class_names(model) if layer_class_names is None else layer_class_names
    )
    return names, is_tied(model) if tied is None else bool(tied)


def explain_wrap_targets(
    model: nn.Module,
    layer_class_names: Iterable[str] | None = None,
    *,
    tied: bool | None = None,
) -> WrapReport:
    """Selects wrap targets and says why each was chosen or skipped."""
    names, tied = _resolve(model, layer_class_names, tied)
    paths, modules, records = _module_records(model)
    selection = _fsdp2_ext.select_wrap_targets(records, names, tied)
    return WrapReport(
        modules=[modules[d.index] for d in selection.selected],
        selected=[(paths[d.index], d.why) for d in selection.selected],
        skipped=[(paths[d.index], d.why, d.covered_by) for d in selection.skipped],
    )


def select_wrap_targets(
    model: nn.Module,
    layer_class_names: Iterable[str] | None = None,
    *,
    tied: bool | None = None,
) -> list[nn.Module]:
    """Modules to ``fully_shard`` (before the root), outermost first-come, never nested.

    Args:
        model: the model (plain, HF, or PEFT-wrapped).
        layer_class_names: class names to wrap; default: the model's ``_no_split_modules``.
        tied: whether embeddings are tied; default: from the config. Tied embed/head are never
            wrapped on their own, so they stay together in the root unit.
    """
    return explain_wrap_targets(model, layer_class_names, tied=tied).modules
