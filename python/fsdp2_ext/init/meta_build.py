"""The model ``from_pretrained`` would build for a checkpoint, on meta, without reading the checkpoint.

[Note: a meta build that reads nothing]
Loading from the checkpoint (``init_source="checkpoint"``), every rank fills its own rows from the
mapped files later; what it needs first is only the model's structure on meta. ``from_pretrained``
under ``init_empty_weights`` gives that structure but reads and converts every stored tensor on
every rank (per-expert tensors stacked into fused experts, dtype casts) before the meta
registration drops the values: ~1 s per GiB here, more than the copy of a rank's own rows, and on
every rank. Transformers' own advice for an empty model is ``from_config``; ``build_on_meta`` runs
it and then does what ``from_pretrained`` does to a model besides loading values, so that the
result is the same module tree, dtypes, buffers and mode:

- construction as in ``from_pretrained``: the model's dtype, a copy of the config, no weight
  initialisation while constructing (``from_pretrained`` constructs on the meta device, where it
  is a no-op; a CPU temporary drawn at random would move the random stream that PEFT's adapters
  draw from next);
- ``_keep_in_fp32_modules(_strict)``: the dtype plan ``from_pretrained`` casts loaded tensors to,
  matched with Transformers' own glob alternation;
- buffers as ``_finalize_model_loading`` leaves them: every parameter and persistent buffer marked
  loaded, then ``initialize_weights`` (only the non-persistent buffers' modules run
  ``_init_weights``, as after a load); persistent buffers take their stored values in
  ``fill_sharded`` like any other target;
- ``eval()`` and the generation config read from the directory;
- hub kernels (Transformers 5.25): not applied on meta, where ``kernelize`` raises, but recorded
  as ``from_pretrained`` would choose them, and applied by ``fill_sharded`` once the weights are
  real ([Note: hub kernels once the weights are real]).

Ties, the keys the checkpoint lacks and the conversions are not decided here: ``ModelCheckpoint``
decides them from the files' headers as ``from_pretrained`` does ([Note: checkpoint ties],
[Note: missing tensors], [Note: checkpoint key resolution]). The test matrix builds every model
type this way and compares the loaded model with ``from_pretrained`` on the CPU, bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fsdp2_ext.common import log
from fsdp2_ext.common.collector import collection_paused
from fsdp2_ext.init import hub_kernels
from fsdp2_ext.model.aliases import set_tensor

__all__ = ["build_on_meta"]


def _apply_dtype_plan(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """``_keep_in_fp32_modules(_strict)``: the parameters and buffers ``from_pretrained`` would
    load in another dtype than ``dtype``, cast (on meta: no data). Returns their FQNs."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return []
    alternation, group_of, _ = build_glob_alternation(list(plan.keys()))
    cast = []
    for fqn, tensor in list(model.state_dict(keep_vars=True).items()):
        match = alternation.search(fqn)
        if match is None:
            continue
        wanted = plan[group_of[match.lastgroup]]
        if tensor.dtype == wanted:
            continue
        if isinstance(tensor, nn.Parameter):
            set_tensor(model, fqn, nn.Parameter(tensor.to(wanted), tensor.requires_grad))
        else:
            set_tensor(model, fqn, tensor.to(wanted))
        cast.append(fqn)
    return cast


def _initialise_as_after_a_load(model: nn.Module) -> None:
    """What ``_finalize_model_loading`` initialises after a load that found every stored key:
    the non-persistent buffers (everything else is marked loaded)."""
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True
    model.initialize_weights()


def _resolved_dtype(dtype, config) -> torch.dtype:
    """``from_pretrained``'s ``dtype``: a dtype or its name; ``None``/``"auto"``: the config's."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}: pass a torch.dtype or its name")
    return dtype


@collection_paused()  # [Note: the collector paused during an init]
def build_on_meta(
    model_class,
    directory: str,
    *,
    config=None,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool | None = None,
) -> nn.Module:
    """``model_class.from_pretrained(directory, config=config, dtype=dtype)`` as
    ``init_empty_weights`` leaves it, without reading a tensor ([Note: a meta build that reads
    nothing]). ``model_class``: a ``PreTrainedModel`` class or an auto class. Parameters are on
    meta; buffers are real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, PreTrainedModel
    from transformers.initialization import no_init_weights

    if config is None:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    config = copy.deepcopy(config)  # as from_pretrained: the caller's config is not modified
    dtype = _resolved_dtype(dtype, config)
    with init_empty_weights(), no_init_weights():
        if isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
            model = model_class._from_config(config, dtype=dtype)
        else:  # an auto class resolves the concrete class (remote code too) as from_pretrained does
            model = model_class.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code
            )
    cast = _apply_dtype_plan(model, dtype)
    _initialise_as_after_a_load(model)
    model.eval()
    hub_kernels.record_choice(model)  # [Note: hub kernels once the weights are real]
    if model.can_generate():
        model.adjust_generation_fn(  # the generation config from the directory, as from_pretrained
            generation_config=None,
            from_auto_class=not isinstance(model_class, type)
            or not issubclass(model_class, PreTrainedModel),
            from_pipeline=None,
            pretrained_model_name_or_path=directory,
            cache_dir=None,
            force_download=False,
            proxies=None,
            local_files_only=True,
            token=None,
            revision=None,
            subfolder="",
            trust_remote_code=trust_remote_code,
        )
    log.debug(
        f"built {type(model).__name__} on meta for {directory} without reading it (dtype {dtype}"
        + (f"; kept in another dtype: {cast[:5]}" if cast else "")
        + ")"
    )
    return model
