"""Transformers' hub kernels on a sharded model: decided as ``from_pretrained`` decides them,
applied once the weights are real, the same on every rank.

[Note: hub kernels once the weights are real]
Transformers 5.25 turned hub kernels on: ``from_pretrained`` reads ``use_kernels=None`` as on
unless ``USE_HUB_KERNELS`` says otherwise (``modeling_utils.py:4415-4423``) and ends with
``model.set_use_kernels(...)`` (``:4495``), whose ``kernelize`` swaps the forward of every layer
with a hub kernel for the model's device and mode (``integrations/hub_kernels.py:496-523``; on
CUDA RMSNorm, SiLU and the rotary embedding, ``:221-261``; nothing on the CPU), and ``train()`` /
``eval()`` kernelize again for the new mode (``:5093-5101``). On a meta model ``kernelize`` raises
("Unsupported device type 'meta'", ``kernels/_internals/layer/kernelize.py:302-308``), and a meta
model is what VERL 0.9.1 builds on every rank but 0 (``from_pretrained`` under
``init_empty_weights``, ``verl/workers/engine/fsdp/transformer_impl.py:266-281``): VERL alone
cannot start on 5.25 unless kernels are off. Where the sharded init builds the model:

- ``build_on_meta`` does not kernelize (there is no forward to swap on meta) but records what
  ``from_pretrained`` would have decided (``record_choice``);
- after the fill (``apply_after_fill``) every rank takes rank 0's choice (rank 0 built by
  ``from_pretrained``, which kernelized on the CPU, or on meta with the record) in one bounded
  agreement, and where it is on, kernelizes on the device its shards live on, in rank 0's mode.
  The device is kept where Transformers keeps it for later kernelizations (``_kernels_device``,
  ``hub_kernels.py:509-513``), so the ``train()``/``eval()`` that VERL calls later swap the same
  kernels on every rank. Every rank runs the same forwards, with real weights, as
  ``from_pretrained`` would give the model on that device; ``USE_HUB_KERNELS=0`` (the user's
  choice) keeps the torch forwards everywhere.

Ranks whose choices differ (``USE_HUB_KERNELS=0`` on one host only) refuse, every one of them,
naming the ranks: the forwards must be the same on every rank, and a rank whose environment
turns kernels off cannot follow (Transformers refuses to kernelize there,
``hub_kernels.py:69-75``). The
agreement is one small gather per load of a model that holds a ``PreTrainedModel`` (a structural
fact, the same on every rank), whatever the Transformers: before 5.25 it finds kernels off
unless the caller's own ``from_pretrained(use_kernels=True)`` turned them on on rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext import log

__all__ = ["apply_after_fill", "from_pretrained_choice", "pretrained_of", "record_choice"]

_RECORD = "_fsdp2_ext_hub_kernels"  # on a model built on meta: from_pretrained's choice


def pretrained_of(model: nn.Module):
    """The ``PreTrainedModel`` inside ``model`` (itself, or PEFT's base model), or None."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return None


def _kernels_default_on() -> bool:
    """What ``from_pretrained(use_kernels=None)`` decides on this Transformers: on from 5.25
    unless ``USE_HUB_KERNELS`` turns it off (``_kernels_enabled()``, a function there); off
    before 5.25, where ``use_kernels`` defaulted to ``False`` (5.24 ``modeling_utils.py:4175``)
    and ``_kernels_enabled`` was a module constant read only by the kernels' own decorators."""
    try:
        from transformers.integrations.hub_kernels import _kernels_enabled
    except ImportError:
        return False
    return callable(_kernels_enabled) and bool(_kernels_enabled())


def from_pretrained_choice() -> bool:
    """Whether ``from_pretrained`` without ``use_kernels`` kernelizes here (VERL passes none)."""
    return _kernels_default_on()


def record_choice(model: nn.Module, requested: bool | None = None) -> None:
    """On a model built on meta in place of ``from_pretrained(use_kernels=requested)``: what it
    would have chosen."""
    if from_pretrained_choice() if requested is None else requested:
        vars(model)[_RECORD] = True


def _choice(pretrained) -> tuple[bool, int | None]:
    """This rank's choice: (on, kernels ``Mode`` value). Kernelized by ``from_pretrained`` (rank
    0), or recorded by ``build_on_meta``."""
    on = bool(getattr(pretrained, "use_kernels", False)) or bool(vars(pretrained).get(_RECORD))
    mode = getattr(pretrained, "_kernels_mode", None)
    return on, (mode.value if on and mode is not None else None)


def apply_after_fill(
    model: nn.Module, device: torch.device, group: dist.ProcessGroup, timeout_s: float
) -> bool:
    """Rank 0's hub-kernels choice applied on every rank, once the shards are real ([Note: hub
    kernels once the weights are real]); True where kernels are on."""
    pretrained = pretrained_of(model)
    if pretrained is None or not hasattr(pretrained, "set_use_kernels"):
        return False
    from fsdp2_ext.host_shared import gather_objects

    mine = _choice(pretrained)
    choices = gather_objects(mine, group, "agreeing on hub kernels", timeout_s)
    on, mode_value = choices[0]
    differ = [r for r, (c, _) in enumerate(choices) if c != on]
    if differ:  # the same list on every rank: every rank refuses
        raise ValueError(
            f"init_sharded: hub kernels are {'on' if on else 'off'} on rank 0 and "
            f"{'off' if on else 'on'} on ranks {differ} (Transformers' USE_HUB_KERNELS, or "
            "from_pretrained's use_kernels, differs between them); every rank must run the "
            "same forwards: set USE_HUB_KERNELS the same on every host"
        )
    vars(pretrained).pop(_RECORD, None)
    if not on:
        if getattr(pretrained, "use_kernels", False):
            pretrained.set_use_kernels(False)
        return False
    from kernels import Mode

    if mode_value is not None:
        mode = Mode(mode_value)
    else:
        mode = Mode.TRAINING if pretrained.training else Mode.INFERENCE
    pretrained._kernels_device = device.type  # kept by Transformers for later kernelizations
    pretrained.set_use_kernels(True, mode=mode)
    log.info(f"hub kernels on ({mode}) on {device.type}, as from_pretrained chose on rank 0")
    return True


class KernelsOnMetaError(RuntimeError):
    """``from_pretrained`` kernelized a model built on meta (Transformers 5.25, kernels on)."""


def refusing_kernels_on_meta(rule, what: str):
    """``rule`` (an init context such as ``init_empty_weights``) whose body's kernels error on a
    meta model (``kernelize``'s "Unsupported device type 'meta'") becomes one naming the build
    and the fix; anything else passes unchanged."""
    import contextlib

    @contextlib.contextmanager
    def context(*args, **kwargs):
        with rule(*args, **kwargs):
            try:
                yield
            except ValueError as error:
                if "Unsupported device type 'meta'" not in str(error):
                    raise
                raise KernelsOnMetaError(
                    f"{what}: Transformers' from_pretrained kernelized a model built on meta "
                    "(hub kernels are on by default from Transformers 5.25, and kernels cannot "
                    "swap a forward on meta). Set USE_HUB_KERNELS=0 on every host to build it "
                    "with the torch forwards, or build an FSDP2 language model, where fsdp2_ext "
                    "builds on meta without kernelizing and applies rank 0's choice once the "
                    "weights are real ([Note: hub kernels once the weights are real])"
                ) from error

    return context
