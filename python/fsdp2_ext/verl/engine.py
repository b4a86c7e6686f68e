"""Replacements for VERL's FSDP2 helpers in ``verl.utils.fsdp_utils`` (verl 0.9.1).

In the order VERL's ``FSDPEngine`` calls them:

- ``FSDPEngine._build_model_optimizer``: VERL's own, run knowing that it builds for FSDP2 and
  where the values come from (``FSDP2_EXT_INIT_SOURCE``, [Note: where an FSDP2 engine's values
  come from]);
- ``get_init_weight_context_manager``: meta on every rank but the source also for tied models;
  meta on every rank when loading from the checkpoint; a rank built on meta builds from the config
  without reading the checkpoint (``get_hf_auto_model_class``'s class runs ``meta_build``);
- ``FSDPEngine._build_lora_module``: VERL's own; loading from the checkpoint, rank 0 keeps the new
  adapters' initial values (PEFT would move them onto the meta base);
- ``_select_fsdp2_wrap_targets``: non-overlapping wrap targets (outermost wins);
- ``apply_fsdp2``: ``prepare_sharded``: aliases and buffers recorded, alias-preserving meta
  conversion, no-placement tables kept on CPU (``ignored_params``), then ``fully_shard`` with VERL's
  own keywords (never moving rank 0's unsharded model to the device);
- ``fsdp2_load_full_state_dict``: ``fill_sharded``: rank 0's state scattered as shards, ties and
  non-persistent buffers restored, tables views of ``model.path`` where rank 0's are its bytes
  ([Note: rank-0 tables from the checkpoint]), else shared per host with
  ``VERL_NO_PLACEMENT_MMAP_DIR``;
- ``offload_fsdp2_model_to_cpu`` / ``load_fsdp2_model_to_gpu``: VERL's own functions for a model
  without no-placement parameters ([Note: do no harm]); otherwise transfers that leave the tables
  where they are.

[Note: where an FSDP2 engine's values come from]
VERL builds the whole model on rank 0's CPU (``from_pretrained``) and on meta elsewhere, except for
tied models: accelerate's ``init_empty_weights`` re-registers every assigned parameter as a new
meta tensor, which unties them, so VERL builds the whole model on *every* rank (W full copies per
host). With the shim, the sharded init keeps ties itself (aliases recorded and merged over ranks;
on a meta-built model the ties ``from_pretrained`` makes for ``model.path``, which a checkpoint
storing a different head leaves untied: [Note: checkpoint ties]), so tied models are built on meta
too: one full copy per host, rank 0's. A rank built on meta reads nothing: it is built from the
config (``meta_build``), where VERL's ``from_pretrained`` under ``init_empty_weights`` reads and
converts the whole checkpoint on every rank to drop it. ``model.path`` also decides, for both init sources, what
may be missing ([Note: missing tensors]; ``FSDP2_EXT_ALLOW_MISSING``). ``FSDP2_EXT_INIT_SOURCE=checkpoint`` (opt-in; the recipe sets it) goes
further: every rank builds on meta and copies only its own rows from the mapped safetensors of
``model.path`` (``fsdp2_ext.init.model_checkpoint_load``): no full copy anywhere but the page cache's one.
Rank 0 keeps only what the checkpoint lacks (the adapters), and sends it. Both apply only to
``strategy=fsdp2`` language models; FSDP1 and value models are built as VERL builds them.

[Note: do no harm]
A replacement changes behaviour only where VERL's would be wrong: the sharded init gives the same
parameters bit for bit (and runs for every model, since it never materialises the unsharded model
on the device), while the transfer helpers call VERL's own functions unchanged unless the model
registers no-placement parameters.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext.checkpoint.model_checkpoint import ModelCheckpoint
from fsdp2_ext.common import log
from fsdp2_ext.init import hub_kernels
from fsdp2_ext.init.meta_build import build_on_meta
from fsdp2_ext.init.model_checkpoint_load import adapters_kept_off_meta
from fsdp2_ext.init.sharded_init import fill_sharded, prepare_sharded, prepared_state
from fsdp2_ext.model.no_placement import no_placement_params, offload, onload
from fsdp2_ext.model.wrap_targets import select_wrap_targets
from fsdp2_ext.verl.targets import (
    FSDP_UTILS,
    MODEL_UTILS,
    TRANSFORMER_IMPL,
    original,
    replaces,
    verl_module,
)

INIT_SOURCE_ENV = "FSDP2_EXT_INIT_SOURCE"
INIT_SOURCES = ("rank0", "checkpoint")
ALLOW_MISSING_ENV = "FSDP2_EXT_ALLOW_MISSING"


@dataclass(frozen=True)
class EngineBuild:
    """What the FSDPEngine being built needs from us; see [Note: where an FSDP2 engine's values
    come from]."""

    model_path: str  # model.path: the checkpoint that decides ties and what may be missing
    from_checkpoint: bool  # every rank loads its rows from model_path (else rank 0 sends them)

    @property
    def checkpoint(self) -> str | None:
        return self.model_path if self.from_checkpoint else None


def allow_missing() -> bool | list[str]:
    """``FSDP2_EXT_ALLOW_MISSING``: ``1``/``all`` or comma-separated FQN patterns of parameters
    the checkpoint may lack ([Note: missing tensors]); unset: none."""
    value = os.environ.get(ALLOW_MISSING_ENV, "").strip()
    if value.lower() in ("1", "all", "true"):
        return True
    return [p.strip() for p in value.split(",") if p.strip()]


_BUILD: contextvars.ContextVar[EngineBuild | None] = contextvars.ContextVar(
    "fsdp2_ext_engine_build", default=None
)


def init_source() -> str:
    source = os.environ.get(INIT_SOURCE_ENV, "rank0") or "rank0"
    if source not in INIT_SOURCES:
        raise ValueError(
            f"{INIT_SOURCE_ENV}={source!r}: use one of {', '.join(INIT_SOURCES)} (rank0: rank 0 "
            "reads the model and sends each rank its rows; checkpoint: every rank copies its own "
            "rows from the mapped safetensors of model.path)"
        )
    return source


@replaces(TRANSFORMER_IMPL, "FSDPEngine._build_model_optimizer")
def build_model_optimizer(self):
    """VERL's ``FSDPEngine._build_model_optimizer``, run inside this engine's ``EngineBuild``."""
    build = None
    if self.engine_config.strategy == "fsdp2" and self.model_config.model_type == "language_model":
        from_checkpoint = init_source() == "checkpoint"
        build = EngineBuild(self.model_config.local_path, from_checkpoint)
        if from_checkpoint:
            log.info(f"FSDPEngine: every rank loads its rows from {build.checkpoint}")
    token = _BUILD.set(build)
    try:
        return original(TRANSFORMER_IMPL, "FSDPEngine._build_model_optimizer")(self)
    finally:
        _BUILD.reset(token)


@replaces(FSDP_UTILS, "get_init_weight_context_manager")
def get_init_weight_context_manager(use_meta_tensor=True, mesh=None):
    verl_rule = original(FSDP_UTILS, "get_init_weight_context_manager")
    build = _BUILD.get()
    if build is None:  # not an FSDP2 language model being built by FSDPEngine: VERL's rule
        rule = verl_rule(use_meta_tensor=use_meta_tensor, mesh=mesh)
        if rule is not _init_empty_weights():
            return rule
        # [Note: hub kernels once the weights are real]: VERL's build fails there on Transformers
        # 5.25 with kernels' own error; the same failure, named with its fix.
        return hub_kernels.refusing_kernels_on_meta(
            rule, "VERL's build on meta (not an FSDP2 language model: fsdp2_ext leaves it to VERL)"
        )
    if build.checkpoint:
        return _meta_build_reading_nothing
    rule = verl_rule(use_meta_tensor=True, mesh=mesh)  # ties survive our init
    # The ranks VERL builds on meta take their values from rank 0: they need the structure only.
    # VERL's rule builds in full wherever the mesh's last coordinate is 0: on its 2-D HSDP mesh
    # one full model per replica, of which only rank 0's is read ([Note: HSDP loads]).
    elsewhere = mesh is not None and any(mesh.get_coordinate() or ())
    return _meta_build_reading_nothing if rule is _init_empty_weights() or elsewhere else rule


def _init_empty_weights():
    from accelerate import init_empty_weights

    return init_empty_weights


_READS_NOTHING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp2_ext_meta_build_reads_nothing", default=False
)


@contextlib.contextmanager
def _meta_build_reading_nothing():
    """The init context of a rank whose values come later (from the checkpoint, or sent by rank
    0): ``init_empty_weights``, and the auto class VERL resolves inside it builds from the config
    ([Note: a meta build that reads nothing]); ``from_pretrained`` would read and convert every
    stored tensor on this rank only to drop the values."""
    from accelerate import init_empty_weights

    token = _READS_NOTHING.set(True)
    try:
        with init_empty_weights():
            yield
    finally:
        _READS_NOTHING.reset(token)


class _AutoClassBuildingOnMeta:
    """VERL's auto class whose ``from_pretrained`` is ``build_on_meta``: the model it would build
    on meta, without reading a tensor of the checkpoint (every rank loads its rows later)."""

    def __init__(self, auto_class) -> None:
        self.auto_class = auto_class

    def from_pretrained(
        self,
        pretrained_model_name_or_path,
        *,
        torch_dtype=None,
        dtype=None,
        config=None,
        trust_remote_code=None,
        **kwargs,
    ):
        if kwargs:  # a VERL passing more than we reproduce: its own call, reading the files
            log.warn(
                f"{self.auto_class.__name__}.from_pretrained({sorted(kwargs)}): not reproduced "
                "on meta; Transformers reads the checkpoint once more on every rank"
            )
            given = {"torch_dtype": torch_dtype, "dtype": dtype, "config": config}
            kwargs.update({k: v for k, v in given.items() if v is not None})
            # On meta kernelize raises: the choice is recorded and applied once the weights are
            # real ([Note: hub kernels once the weights are real]).
            requested = kwargs.pop("use_kernels", None)
            model = self.auto_class.from_pretrained(
                pretrained_model_name_or_path,
                trust_remote_code=trust_remote_code,
                use_kernels=False,
                **kwargs,
            )
            hub_kernels.record_choice(model, requested)
            return model
        return build_on_meta(
            self.auto_class,
            pretrained_model_name_or_path,
            config=config,
            dtype=dtype if dtype is not None else torch_dtype,
            trust_remote_code=trust_remote_code,
        )

    def __getattr__(self, name):
        return getattr(self.auto_class, name)


@replaces(MODEL_UTILS, "get_hf_auto_model_class")
def get_hf_auto_model_class(hf_config):
    auto_class = original(MODEL_UTILS, "get_hf_auto_model_class")(hf_config)
    return _AutoClassBuildingOnMeta(auto_class) if _READS_NOTHING.get() else auto_class


@replaces(TRANSFORMER_IMPL, "FSDPEngine._build_lora_module")
def build_lora_module(self, module):
    build = _BUILD.get()
    keep = build is not None and build.checkpoint and dist.get_rank() == 0
    with adapters_kept_off_meta() if keep else contextlib.nullcontext():
        return original(TRANSFORMER_IMPL, "FSDPEngine._build_lora_module")(self, module)


def _retie_meta_built(model: nn.Module) -> None:
    """Redo Transformers' config ties on a model built under ``init_empty_weights`` (which unties
    them), for a checkpoint that is not safetensors (no tie decision from the files)."""
    if not any(p.is_meta for p in model.parameters()):
        return
    for module in model.modules():
        if hasattr(module, "tie_weights") and hasattr(module, "config"):  # the PreTrainedModel
            module.tie_weights()
            return


def _model_checkpoint(model: nn.Module, build: EngineBuild) -> ModelCheckpoint | None:
    """``model.path`` resolved against the model, on every rank (headers only): its ties and what
    it lacks apply to both init sources. A checkpoint without safetensors is loadable from rank 0
    only: VERL's own rules then (config ties)."""
    try:
        return ModelCheckpoint.open(model, build.model_path)
    except FileNotFoundError as error:
        if build.from_checkpoint:
            raise
        log.debug(f"apply_fsdp2: ties and missing keys from the config only: {error}")
        _retie_meta_built(model)
        return None


@replaces(FSDP_UTILS, "_select_fsdp2_wrap_targets")
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


@replaces(FSDP_UTILS, "apply_fsdp2")
def apply_fsdp2(model, fsdp_kwargs, config):
    fsdp_utils = verl_module(FSDP_UTILS)
    kwargs = dict(fsdp_kwargs)
    mesh = kwargs.pop("mesh")

    def fully_shard_fn(module, **shard_kwargs):
        with fsdp_utils.maybe_patch_fsdp_module(module):
            fsdp_utils.fully_shard(module, **shard_kwargs)

    build = _BUILD.get()
    # Resolved before fully_shard renames the classes. VERL took the full state before this call:
    # what rank 0 initialises joins it at the load.
    checkpoint = _model_checkpoint(model, build) if build is not None else None
    prepared = prepare_sharded(
        model,
        mesh=mesh,
        layer_class_names=_layer_classes(model, config),
        fsdp_kwargs=kwargs,
        fully_shard_fn=fully_shard_fn,
        checkpoint=checkpoint,
        allow_missing=allow_missing(),
        init_source="checkpoint" if build and build.from_checkpoint else "rank0",
    )
    if (config or {}).get("forward_prefetch", False):  # as VERL: depth 1, wrap order
        units = [m for m in prepared.wrap.modules if isinstance(m, fsdp_utils.FSDPModule)]
        for unit, following in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([following])


@replaces(FSDP_UTILS, "fsdp2_load_full_state_dict")
def fsdp2_load_full_state_dict(model, full_state, device_mesh=None, cpu_offload=None):
    prepared = prepared_state(model)
    if prepared is None:
        # Not sharded by our apply_fsdp2 (another code path): VERL's own loader.
        verl_load = original(FSDP_UTILS, "fsdp2_load_full_state_dict")
        return verl_load(model, full_state, device_mesh, cpu_offload)
    report = fill_sharded(model, full_state if prepared.holds_rank0 else None)
    _write_run_record(model, dist.get_rank(), prepared.init_source, report)
    if cpu_offload is not None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        for module in model.modules():  # VERL keeps buffers on the GPU under CPU offload
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


def _write_run_record(model, rank: int, source: str, report) -> None:
    """With ``FSDP2_EXT_REPORT_DIR`` (``fsdp2_ext.common.run_report``): this rank's init, as loaded."""
    from fsdp2_ext.common.procfs import mapped_inode, status_bytes, storage_bytes
    from fsdp2_ext.common.run_report import report_dir, write_record

    if report_dir() is None:
        return
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    tables = {id(r.param) for r in no_placement_params(model)}
    params = [(n, p) for n, p in model.named_parameters() if id(p) not in tables]
    held = {  # what this rank holds of the model, for the host plan's per-rank figures
        "shard_bytes": storage_bytes(p for n, p in params if "lora_" not in n),
        "lora_bytes": storage_bytes(p for n, p in params if "lora_" in n),
        "buffer_bytes": storage_bytes(b for _, b in model.named_buffers()),
        "table_bytes": storage_bytes(r.param for r in no_placement_params(model)),
    }
    write_record(
        f"trainer-rank{rank}",
        {
            "kind": "trainer",
            "rank": rank,
            "pid": os.getpid(),
            "init_source": source,
            # the default group's form as torch states it: VERL's "cpu:gloo,cuda:nccl" on a GPU
            # host, "cpu:gloo" on the CPU platform
            "backend": str(torch.distributed.get_backend_config())
            if torch.distributed.is_initialized()
            else "",
            "loaded": report.checkpoint_kinds,
            "bytes_received": report.bytes_received,
            "bytes_sent": report.bytes_sent,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "only_lora_trainable": bool(trainable) and all("lora_" in n for n in trainable),
            "tables": [
                {"fqn": r.fqn, "inode": mapped_inode(r.param), "device": r.param.device.type}
                for r in no_placement_params(model)
            ],
            "held": held,
            "resident": status_bytes(),
        },
    )


def _has_no_placement_params(model) -> bool:
    return isinstance(model, nn.Module) and bool(no_placement_params(model))


@replaces(FSDP_UTILS, "offload_fsdp2_model_to_cpu")
def offload_fsdp2_model_to_cpu(model, empty_cache: bool = True):
    if not _has_no_placement_params(model):
        return original(FSDP_UTILS, "offload_fsdp2_model_to_cpu")(model, empty_cache)
    offload(model, non_blocking=True)
    if empty_cache:
        verl_module(FSDP_UTILS).get_torch_device().empty_cache()


@replaces(FSDP_UTILS, "load_fsdp2_model_to_gpu")
def load_fsdp2_model_to_gpu(model):
    if not _has_no_placement_params(model):
        return original(FSDP_UTILS, "load_fsdp2_model_to_gpu")(model)
    onload(model, _verl_device(), non_blocking=True)


def _verl_device() -> torch.device:
    fsdp_utils = verl_module(FSDP_UTILS)
    name, index = fsdp_utils.get_device_name(), fsdp_utils.get_device_id()
    return torch.device(name, index) if isinstance(index, int) else torch.device(name)
