"""What the shim replaces in VERL and what it reads there: each VERL module named once.

Side-effect free. The shim's modules (``engine``, ``positions``, ``training_checkpoint``) declare
each replacement next to its code with ``@replaces(module, name)`` and reach VERL's own function
with ``original(module, name)``; ``fsdp2_ext.verl`` imports them and installs ``SHIM``. Nothing here
imports back up from ``fsdp2_ext.verl``.

[Note: what the shim assumes of VERL]
Replaced (verl 0.9.1; ``install`` refuses another version, and any of these missing, before
writing anything):

- ``verl.workers.engine.fsdp.transformer_impl``: ``FSDPEngine._build_model_optimizer``,
  ``FSDPEngine._build_lora_module``;
- ``verl.utils.fsdp_utils``: ``get_init_weight_context_manager``, ``_select_fsdp2_wrap_targets``,
  ``apply_fsdp2``, ``fsdp2_load_full_state_dict``, ``offload_fsdp2_model_to_cpu``,
  ``load_fsdp2_model_to_gpu``, ``get_fsdp_full_state_dict``, ``collect_lora_params``;
- ``verl.utils.model.get_hf_auto_model_class`` (inside a checkpoint build's init context only);
- ``verl.utils.tensordict_utils.maybe_fix_3d_position_ids``,
  ``verl.workers.utils.padding.left_right_2_no_padding``, ``verl.protocol.deserialize_tensordict``;
- ``verl.utils.checkpoint.fsdp_checkpoint_manager``: ``FSDPCheckpointManager.save_checkpoint``,
  ``FSDPCheckpointManager.load_checkpoint``;
- ``verl.workers.engine_workers.ActorRolloutRefWorker.load_checkpoint`` (a registered worker
  method: [Note: a replaced method keeps its registration]).

Read at run time (a VERL that renamed one of these fails where it is read, naming it):

- ``verl.__version__``;
- on ``FSDPEngine``: ``engine_config.strategy``, ``model_config.model_type``,
  ``model_config.local_path``;
- in ``verl.utils.fsdp_utils``: ``fully_shard``, ``maybe_patch_fsdp_module``, ``FSDPModule``,
  ``get_torch_device``, ``get_device_name``, ``get_device_id``;
- ``apply_fsdp2``'s arguments: ``fsdp_kwargs["mesh"]``, the config's
  ``wrap_policy.transformer_layer_cls_to_wrap`` and ``forward_prefetch``;
- on ``FSDPCheckpointManager``: ``model``; a PEFT model's ``base_model.model``;
- on ``ActorRolloutRefWorker``: ``config.actor.ppo_mini_batch_size``, ``config.rollout.n``,
  ``actor.engine.get_data_parallel_size()`` (what ``TrainingWorker.train_mini_batch`` divides).
"""

from __future__ import annotations

from fsdp2_ext.common.patching import PatchSet

__all__ = [
    "CHECKPOINT_MANAGER",
    "ENGINE_WORKERS",
    "FSDP_UTILS",
    "MODEL_UTILS",
    "PADDING",
    "PROTOCOL",
    "SHIM",
    "TENSORDICT_UTILS",
    "TRANSFORMER_IMPL",
    "original",
    "replaces",
    "verl_module",
]

FSDP_UTILS = "verl.utils.fsdp_utils"
TRANSFORMER_IMPL = "verl.workers.engine.fsdp.transformer_impl"
MODEL_UTILS = "verl.utils.model"
TENSORDICT_UTILS = "verl.utils.tensordict_utils"
PADDING = "verl.workers.utils.padding"
PROTOCOL = "verl.protocol"
CHECKPOINT_MANAGER = "verl.utils.checkpoint.fsdp_checkpoint_manager"
ENGINE_WORKERS = "verl.workers.engine_workers"

SHIM = PatchSet()
replaces = SHIM.replaces
original = SHIM.original


def verl_module(name: str):
    """A VERL module the shim reads at run time (loaded already: the shim patched it)."""
    import sys

    return sys.modules[name]
