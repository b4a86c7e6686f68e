"""No-placement parameters: frozen tensors that stay on CPU through FSDP2 and every transfer.

Transformers declares them per model class in ``_no_placement_params`` (FQN suffixes relative to
the declaring module; ``qwen4_exp``: ``["ple.ple_embedding.ngram_embedding.weight"]``). In order:

1. ``find_no_placement_params(model)`` matches the suffixes (C++, [Note: no-placement matching]),
   refuses trainable matches, and returns one registration per parameter;
2. ``register_no_placement_params(model)`` stores them on the model so later steps need no rescan;
3. ``ignored_params(model)`` is the set for ``fully_shard(..., ignored_params=...)``;
4. ``to_device`` / ``offload`` / ``onload`` move everything else, never ``Module.to`` on the whole
   model, while ``detached_no_placement_params`` keeps the registered parameters out of reach; the
   same objects are put back, still on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext.common import log

__all__ = [
    "NoPlacementParam",
    "detached_no_placement_params",
    "find_no_placement_params",
    "fingerprint",
    "ignored_params",
    "no_placement_params",
    "offload",
    "onload",
    "register_no_placement_params",
    "to_device",
]

_REGISTRY_ATTRIBUTE = "_fsdp2_ext_no_placement_params"


class NoPlacementParam(NamedTuple):
    """One registered parameter: ``getattr(module, name) is param``, reachable as ``fqn``."""

    module: nn.Module
    name: str
    param: nn.Parameter
    fqn: str


def _declarations(model: nn.Module) -> list[_fsdp2_ext.NoPlacementDeclaration]:
    """Outermost declaration of every distinct ``_no_placement_params`` list.

    Submodules of a HF model inherit the attribute from the shared ``PreTrainedModel`` base (the
    inner ``Model``, a vision tower); the nested copies of a list already declared by an ancestor
    are the same declaration and are not matched again.
    """
    declarations: list[_fsdp2_ext.NoPlacementDeclaration] = []
    for path, module in model.named_modules():
        suffixes = getattr(type(module), "_no_placement_params", None)
        if not suffixes:
            continue
        suffixes = list(suffixes)
        if any(
            suffixes == declared.suffixes
            and (not declared.module_path or path.startswith(declared.module_path + "."))
            for declared in declarations
        ):
            continue
        declarations.append(
            _fsdp2_ext.NoPlacementDeclaration(path, type(module).__name__, suffixes)
        )
    return declarations


def find_no_placement_params(model: nn.Module) -> list[NoPlacementParam]:
    """Scans the model for parameters named by ``_no_placement_params``.

    Raises:
        ValueError: a malformed entry (names the entry and the class), or a match
            requires grad ("cannot train", names the FQN).
    """
    declarations = _declarations(model)
    if not declarations:
        return []
    owners: list[tuple[nn.Module, str, nn.Parameter, str]] = []
    for module_path, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                fqn = f"{module_path}.{name}" if module_path else name
                owners.append((module, name, param, fqn))
    matches = _fsdp2_ext.match_no_placement_params(
        declarations,
        [_fsdp2_ext.ParameterRecord(fqn, param.requires_grad) for _, _, param, fqn in owners],
    )
    indices = sorted(match.parameter_index for match in matches)
    return [NoPlacementParam(*owners[index]) for index in indices]


def register_no_placement_params(
    model: nn.Module, registrations: list[NoPlacementParam] | None = None
) -> list[NoPlacementParam]:
    """Scans (unless given) and stores the registrations on ``model`` for the later steps. An
    entry that matches nothing is no error (a model built without the module that owns it, as
    qwen4_exp without PLE layers, has none; Transformers ignores it too): it is logged once."""
    if registrations is None:
        registrations = find_no_placement_params(model)
        for declaration in _declarations(model):
            for suffix in declaration.suffixes:
                if not any(r.fqn.endswith(suffix) for r in registrations):
                    log.info(
                        f"{declaration.class_name}._no_placement_params entry '{suffix}' matches "
                        "no parameter of this model (built without it?); nothing is kept on CPU "
                        "for it"
                    )
    vars(model)[_REGISTRY_ATTRIBUTE] = list(registrations)
    return registrations


def no_placement_params(model: nn.Module) -> list[NoPlacementParam]:
    """The registrations stored on ``model``, else a fresh scan."""
    stored = vars(model).get(_REGISTRY_ATTRIBUTE)
    return list(stored) if stored is not None else find_no_placement_params(model)


def ignored_params(model: nn.Module) -> set[nn.Parameter]:
    """The set to pass as ``fully_shard(..., ignored_params=...)``."""
    return {registration.param for registration in no_placement_params(model)}


@contextlib.contextmanager
def detached_no_placement_params(
    model: nn.Module, registrations: list[NoPlacementParam] | None = None
) -> Iterator[list[NoPlacementParam]]:
    """Sets every registered parameter slot to ``None`` and puts the same objects back on exit.

    ``nn.Module._apply`` (``to``, ``cuda``, FSDP2's reshard/reset) skips ``None`` slots, so nothing
    inside the block can move or replace them. The slots are restored even if the block raises.
    """
    registrations = no_placement_params(model) if registrations is None else registrations
    for registration in registrations:  # check all before detaching any
        current = registration.module._parameters.get(registration.name)
        if current is not registration.param:
            raise RuntimeError(
                f"no-placement parameter '{registration.fqn}' is no longer the registered object; "
                "re-register with register_no_placement_params(model) after replacing it"
            )
    for registration in registrations:
        registration.module._parameters[registration.name] = None
    try:
        yield registrations
    finally:
        for registration in registrations:
            registration.module._parameters[registration.name] = registration.param


def to_device(
    model: nn.Module, device: torch.device | str, *, non_blocking: bool = False
) -> nn.Module:
    """Moves every parameter, gradient and buffer to ``device`` except the no-placement ones.

    Uses ``Module._apply`` under :func:`detached_no_placement_params` rather than ``Module.to``, so
    FSDP2 modules still reshard and re-pad (``FSDPModule._apply``) and the CPU tables stay put.
    """
    device = torch.device(device)
    with detached_no_placement_params(model):
        model._apply(lambda tensor: tensor.to(device, non_blocking=non_blocking))
    return model


def offload(model: nn.Module, *, non_blocking: bool = False) -> nn.Module:
    """``to_device(model, "cpu")``: VERL's offload without moving the no-placement tables."""
    return to_device(model, "cpu", non_blocking=non_blocking)


def onload(
    model: nn.Module, device: torch.device | str | None = None, *, non_blocking: bool = False
) -> nn.Module:
    """Moves the model back to ``device`` (default: the current accelerator, else CPU)."""
    if device is None:
        accelerator = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        device = accelerator if accelerator is not None else torch.device("cpu")
    return to_device(model, device, non_blocking=non_blocking)


FINGERPRINT_PAGES = 64  # sampled pages of 4 KiB, plus the first and last 64 KiB


def fingerprint(tensor: torch.Tensor) -> str:
    """A cheap content fingerprint of a frozen table: shape, dtype, byte size and a hash of its
    first and last 64 KiB and ``FINGERPRINT_PAGES`` evenly spaced 4 KiB pages (about 384 KiB
    read, whatever the size: the 95 GiB table too). Two tables with different values differ in
    it unless they differ only outside the sampled pages."""
    import hashlib

    data = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else tensor
    size = int(tensor.numel() * tensor.element_size())
    digest = hashlib.blake2b(f"{tuple(tensor.shape)}|{tensor.dtype}|{size}".encode())
    edge, page = 64 << 10, 4 << 10
    spans = [(0, min(edge, size)), (max(0, size - edge), size)]
    stride = max(page, size // FINGERPRINT_PAGES)
    spans += [(offset, min(offset + page, size)) for offset in range(0, size, stride)]
    for begin, end in spans:
        if end > begin:
            digest.update(data[begin:end].numpy().tobytes())
    return f"{size}:{digest.hexdigest()[:32]}"
