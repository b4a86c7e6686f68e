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
- ``prepare_sharded`` agrees on rank 0's choice (rank 0 built by ``from_pretrained``, which
  kernelized on the CPU, or on meta with the record) in one bounded gather, before any value
  moves (``agree``: a rank that dies later is named by the load's own waits, not by this one);
- after the fill (``apply``, no collective) every rank where the choice is on kernelizes on the
  device its forward runs on (the mesh's device type), in rank 0's mode. Under
  ``CPUOffloadPolicy`` the shards rest on the CPU but FSDP2 computes on the accelerator, so the
  kernels are the accelerator's, as Transformers picks for an offloaded ``device_map`` (its first
  device that is not "cpu" or "disk", ``hub_kernels.py:509-512``).
  The device is kept where Transformers keeps it for later kernelizations (``_kernels_device``,
  ``hub_kernels.py:509-513``), so the ``train()``/``eval()`` that VERL calls later swap the same
  kernels on every rank. Every rank runs the same forwards, with real weights, as
  ``from_pretrained`` would give the model on that device; ``USE_HUB_KERNELS=0`` (the user's
  choice) keeps the torch forwards everywhere.

Rank 0 decides, as it decides the values: a rank whose own build chose otherwise (built with
``from_config`` beside rank 0's ``from_pretrained``; rank 0's environment turning kernels off)
follows it, with a warning naming the ranks. A rank that cannot follow refuses, and so does every
other rank, naming it: kernels on at rank 0 where a rank's ``USE_HUB_KERNELS`` turns them off
(Transformers refuses to kernelize there, ``hub_kernels.py:69-75``) or ``kernels`` is missing. The
agreement is one small gather per init of a model that holds a ``PreTrainedModel`` (a structural
fact, the same on every rank), whatever the Transformers: before 5.25 it finds kernels off
unless the caller's own ``from_pretrained(use_kernels=True)`` turned them on on rank 0.

A caller of ``init_sharded`` who builds ranks > 0 with ``from_pretrained`` under
``init_empty_weights`` meets Transformers 5.25's own refusal (it kernelizes the meta model):
pass ``use_kernels=False`` there, or build with ``build_on_meta``; those ranks then follow rank
0's choice as above (the tests' meta builds do the former).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from fsdp2_ext.common import log

__all__ = [
    "KernelsChoice",
    "KernelsOnMetaError",
    "agree",
    "apply",
    "from_pretrained_choice",
    "pretrained_of",
    "record_choice",
    "refusing_kernels_on_meta",
]

_RECORD = "_fsdp2_ext_hub_kernels"  # on a model built on meta: from_pretrained's choice


def pretrained_of(model: nn.Module):
    """The ``PreTrainedModel`` inside ``model`` (itself, or PEFT's base model), or None."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return None


def _environment_allows() -> tuple[bool, bool]:
    """(``USE_HUB_KERNELS`` read by a function, as from 5.25; kernels allowed by it). Before 5.25
    ``_kernels_enabled`` was a module constant read only by the kernels' own decorators."""
    try:
        from transformers.integrations.hub_kernels import _kernels_enabled
    except ImportError:
        return False, False
    if callable(_kernels_enabled):
        return True, bool(_kernels_enabled())
    return False, bool(_kernels_enabled)


def from_pretrained_choice() -> bool:
    """Whether ``from_pretrained`` without ``use_kernels`` kernelizes here (VERL passes none): on
    from 5.25 unless ``USE_HUB_KERNELS`` turns it off; off before 5.25, where ``use_kernels``
    defaulted to ``False`` (5.24 ``modeling_utils.py:4175``)."""
    read_by_function, allowed = _environment_allows()
    return read_by_function and allowed


def record_choice(model: nn.Module, requested: bool | None = None) -> None:
    """On a model built on meta in place of ``from_pretrained(use_kernels=requested)``: what it
    would have chosen."""
    if from_pretrained_choice() if requested is None else requested:
        vars(model)[_RECORD] = True


def _can_kernelize() -> bool:
    """Whether Transformers lets this rank kernelize: ``kernels`` installed and ``USE_HUB_KERNELS``
    not turning it off (``set_use_kernels(True)`` raises otherwise, ``hub_kernels.py:69-75``)."""
    from transformers.utils import is_kernels_available

    return _environment_allows()[1] and bool(is_kernels_available())


def _choice(pretrained) -> tuple[bool, int | None, bool]:
    """This rank's choice: (on, kernels ``Mode`` value, whether it can kernelize). On where
    ``from_pretrained`` kernelized (rank 0) or ``build_on_meta`` recorded it."""
    on = bool(getattr(pretrained, "use_kernels", False)) or bool(vars(pretrained).get(_RECORD))
    mode = getattr(pretrained, "_kernels_mode", None)
    return on, (mode.value if on and mode is not None else None), _can_kernelize()


@dataclass(frozen=True)
class KernelsChoice:
    """Rank 0's hub-kernels choice, agreed by every rank: on or off, and the kernels ``Mode``
    value rank 0's ``from_pretrained`` kernelized in (None: the model's own mode decides)."""

    on: bool
    mode_value: int | None = None


def agree(model: nn.Module, group: dist.ProcessGroup, timeout_s: float) -> KernelsChoice | None:
    """Rank 0's choice, agreed in one bounded gather before any value moves (``prepare_sharded``);
    None for a model that holds no ``PreTrainedModel``. Every rank refuses where a rank cannot
    follow rank 0; a rank whose own build chose otherwise follows, named in a warning."""
    pretrained = pretrained_of(model)
    if pretrained is None or not hasattr(pretrained, "set_use_kernels"):
        return None
    from fsdp2_ext.common.distributed import gather_objects

    choices = gather_objects(_choice(pretrained), group, "agreeing on hub kernels", timeout_s)
    on, mode_value, _ = choices[0]
    cannot = [r for r, (_, _, can) in enumerate(choices) if on and not can]
    if cannot:  # the same list on every rank: every rank refuses
        raise ValueError(
            f"init_sharded: hub kernels are on on rank 0 (its from_pretrained kernelized) and "
            f"ranks {cannot} cannot run them (Transformers' USE_HUB_KERNELS turns them off "
            "there, or kernels is not installed); every rank must run the same forwards: set "
            "USE_HUB_KERNELS the same on every host (0 keeps the torch forwards everywhere)"
        )
    follow = [r for r, (c, _, _) in enumerate(choices) if c != on]
    if follow:  # e.g. ranks built with from_config, or rank 0's environment turning them off
        log.warn(
            f"hub kernels: ranks {follow} follow rank 0's choice ({'on' if on else 'off'}); "
            "their own build chose otherwise"
        )
    return KernelsChoice(on, mode_value)


def apply(model: nn.Module, choice: KernelsChoice | None, device_type: str) -> bool:
    """The agreed choice applied on this rank once its shards are real (``fill_sharded``; no
    collective), for the device the forward runs on (``device_type``: the mesh's, also under
    ``CPUOffloadPolicy``, whose shards rest on the CPU); True where kernels are on."""
    if choice is None:
        return False
    pretrained = pretrained_of(model)
    vars(pretrained).pop(_RECORD, None)
    if not choice.on:
        if getattr(pretrained, "use_kernels", False):
            pretrained.set_use_kernels(False)
        return False
    from kernels import Mode

    if choice.mode_value is not None:
        mode = Mode(choice.mode_value)
    else:
        mode = Mode.TRAINING if pretrained.training else Mode.INFERENCE
    pretrained._kernels_device = device_type  # kept by Transformers for later kernelizations
    pretrained.set_use_kernels(True, mode=mode)
    log.info(f"hub kernels on ({mode}) on {device_type}, as rank 0's from_pretrained chose")
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
