"""An in-process Transformers rollout for VERL (``actor_rollout_ref.rollout.name=hf``), for runs
without vLLM or SGLang: CPU-scale checks of a recipe, with VERL's own worker driving it.

    VERL_USE_EXTERNAL_MODULES=fsdp2_ext.verl_hf_rollout ...   # registers "hf" in VERL's registry

[Note: in-process HF rollout]
- VERL 0.9.1 registers only server rollouts (vLLM, SGLang, TensorRT-LLM); its ``HFRollout`` is
  still shipped but cannot be built (``BaseRollout`` grew abstract methods and a constructor it
  does not call). ``HFRolloutReplica`` is that class made whole: VERL's ``ActorRolloutRefWorker``
  builds it through ``get_rollout_class`` like any rollout, and its generation is ``HFRollout``'s.
- It is a replica, like a vLLM engine: each rank holds its own unsharded model, loaded from the
  checkpoint (``model.path``), so generation needs no collective and ranks never wait on each
  other's EOS. Only the LoRA adapter travels from the trainer, through VERL's own
  ``update_weights`` (``get_per_tensor_param(base_sync_done=True)``: adapter tensors + PEFT config);
  ``base_sync_done=False`` (``load_format=dummy``) loads the whole model from the trainer instead.
- Frozen no-placement tables are views of the checkpoint file itself where it stores them as the
  model needs them ([Note: zero-copy tables]): the trainer's ranks and the replicas then share the
  page cache's one copy. Otherwise they are mapped from one host-shared file per host
  (``VERL_NO_PLACEMENT_MMAP_DIR``), as in the trainer: a replica never adds a per-rank copy.
- ``export_adapter`` writes the synced adapter in PEFT's format (``adapter_config.json`` +
  ``adapter_model.safetensors``), loadable with ``PeftModel.from_pretrained`` on the checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.hf_rollout import HFRollout

from fsdp2_ext import log

__all__ = ["HFRolloutReplica", "register"]

ROLLOUT_NAME = "hf"


class HFRolloutReplica(HFRollout):
    """VERL's ``HFRollout`` generation on a per-rank replica that receives adapter syncs."""

    def __init__(self, config, model_config, device_mesh, **kwargs) -> None:
        rollout_base.BaseRollout.__init__(self, config, model_config, device_mesh)
        self.module = self._load_base()
        self.peft_config = None
        self.synced_tensors = 0
        self.synced_bytes = 0

    def _load_base(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        path = self.model_config.local_path
        dtype = getattr(torch, str(self.config.dtype).removeprefix("torch."))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.requires_grad_(False).eval()
        self._share_tables(model)
        return model

    def _share_tables(self, model: torch.nn.Module) -> None:
        from fsdp2_ext.host_shared import share_tables_on_host
        from fsdp2_ext.no_placement import find_no_placement_params

        tables = self._view_from_checkpoint(model, find_no_placement_params(model))
        directory = os.environ.get("VERL_NO_PLACEMENT_MMAP_DIR")
        if not tables or not dist.is_initialized():
            return
        if not directory:
            log.warn(
                f"rollout replica: {len(tables)} no-placement table(s) kept as a private copy per "
                "rank; set VERL_NO_PLACEMENT_MMAP_DIR to map one copy per host"
            )
            return
        mapped, _ = share_tables_on_host(
            [t.fqn for t in tables],
            [t.param.detach() for t in tables],
            group=dist.group.WORLD,
            directory=directory,
        )
        for table, tensor in zip(tables, mapped, strict=True):
            setattr(table.module, table.name, torch.nn.Parameter(tensor, requires_grad=False))

    def _view_from_checkpoint(self, model: torch.nn.Module, tables: list) -> list:
        """Tables that become views of the mapped checkpoint; returns the others."""
        from fsdp2_ext.checkpoint_load import table_view
        from fsdp2_ext.checkpoint_source import CheckpointSource

        if not tables:
            return tables
        path = self.model_config.local_path
        source = CheckpointSource.open(model, path, fqns=[t.fqn for t in tables])
        remaining = []
        for table in tables:
            view, reason = table_view(source, [table.fqn], table.param)
            if view is None:
                log.info(f"rollout replica: table {table.fqn} is not a view of {path}: {reason}")
                remaining.append(table)
            else:
                setattr(table.module, table.name, torch.nn.Parameter(view, requires_grad=False))
        return remaining

    # BaseRollout's lifecycle: the replica lives in host memory and is never put to sleep.
    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        *,
        peft_config=None,
        base_sync_done: bool = True,
        **kwargs,
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(
                f"HFRolloutReplica.update_weights: wire_format={wire_format!r} is not supported; "
                "use checkpoint_engine.backend=naive (named tensors)"
            )
        tensors = {name: tensor.detach().cpu() for name, tensor in weights}
        self.synced_tensors = len(tensors)
        self.synced_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if peft_config is not None and base_sync_done:
            self._load_adapter(tensors, peft_config)
        else:
            _, unexpected = self._base_model().load_state_dict(tensors, strict=False)
            if unexpected:
                raise KeyError(
                    f"HFRolloutReplica.update_weights: unexpected weights {unexpected[:5]}"
                )

    def _base_model(self) -> torch.nn.Module:
        return self.module.get_base_model() if self.peft_config is not None else self.module

    def _load_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        from peft import get_peft_config, get_peft_model, set_peft_model_state_dict

        if isinstance(peft_config, dict):  # the engine sends ``PeftConfig.to_dict()``
            peft_config = get_peft_config(dict(peft_config))
        if self.peft_config is None:
            self.peft_config = peft_config
            self.module = get_peft_model(self.module, peft_config).eval()
        result = set_peft_model_state_dict(self.module, tensors)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise KeyError(
                f"HFRolloutReplica.update_weights: unknown adapter keys {unexpected[:5]}"
            )

    def export_adapter(self, directory: str) -> str:
        """Writes the synced adapter in PEFT's format; returns ``directory``."""
        if self.peft_config is None:
            raise RuntimeError(
                "HFRolloutReplica.export_adapter: no adapter has been synced yet "
                "(call the worker's update_weights first; the model needs lora_rank > 0)"
            )
        self.module.save_pretrained(directory, safe_serialization=True)
        return directory


def register() -> None:
    """Adds ``("hf", "async")`` to VERL's rollout registry (idempotent)."""
    fqn = f"{HFRolloutReplica.__module__}.{HFRolloutReplica.__qualname__}"
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = fqn


register()
