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
    """Whether the embeddings are tied, for wrapping: VERL's rule (``_select_fsdp2_wrap_targets``
    reads ``model.config.tie_word_embeddings``, False without it), except where the model itself
    holds a tie that two FSDP units could not share: one Parameter registered in two modules on
    separate branches (``embed_tokens`` and ``lm_head``, as Transformers ties them). A Parameter a
    wrapper merely exposes again beside its inner module (PEFT's ``ModulesToSaveWrapper``: the
    wrapper's ``weight`` is its ``original_module.weight``) is no tie: both names lie in one branch,
    which becomes one unit. [Note: checkpoint ties] says how this meets the checkpoint's ties."""
    if _shared_across_branches(model):
        return True
    config = getattr(model, "config", None)
    if config is None:  # VERL needs a config here; a plain module: the outermost one with a config
        config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    return bool(getattr(config, "tie_word_embeddings", False))


def _shared_across_branches(model: nn.Module) -> bool:
    """Whether some Parameter is registered in two modules neither of which contains the other."""
    owners: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(parameter), []).append(name.rpartition(".")[0])
    for paths in owners.values():
        for i, first in enumerate(paths):
            for second in paths[i + 1 :]:
                if not (_contains(first, second) or _contains(second, first)):
                    return True
    return False


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


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
