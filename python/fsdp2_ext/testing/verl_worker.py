"""VERL's own TrainingWorker (FSDPEngine, strategy fsdp2) as the engine tests and the cold-start
benchmark build it: one call, VERL's config dataclasses, GRPO's policy loss.

Import it (and VERL) only after the process's VERL environment is set: VERL resolves its platform
once, at ``import verl`` (see ``fsdp2_ext.verl_cpu.toy_run.CPU_ENV``).
"""

from __future__ import annotations

from functools import partial

GROUP = 2  # GRPO group size (rollout.n) of the engine tests' batches

__all__ = ["GROUP", "build_training_worker"]


def build_training_worker(
    model_path: str,
    *,
    shim: bool,
    lora_rank: int = 0,
    target_modules="all-linear",
    save_lora_only: bool = False,
    save_contents=("model", "optimizer", "extra"),
    load_contents=None,
    model_dtype: str = "fp32",
    initialise: bool = True,
    optimizer: dict | None = None,
):
    """VERL's TrainingWorker for ``model_path`` with GRPO's policy loss set; initialised
    (``worker.reset()``: model, FSDP2, optimizer) unless ``initialise=False``. ``optimizer``:
    ``FSDPOptimizerConfig`` fields over the defaults (lr 1e-3, 10 steps, clip 1.0);
    ``load_contents``: what ``load_checkpoint`` restores (default: what is saved)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        ActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        PolicyLossConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=False,
        override_config={"attn_implementation": "sdpa"},
        lora_rank=lora_rank,
        lora_alpha=2 * lora_rank,
        target_modules=target_modules,
        external_lib="fsdp2_ext.verl" if shim else None,
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
        use_torch_compile=False,
        model_dtype=model_dtype,
        mixed_precision={
            "param_dtype": model_dtype,
            "reduce_dtype": "fp32",
            "buffer_dtype": "fp32",
        },
    )
    optimizer_config = FSDPOptimizerConfig(
        **{"lr": 1e-3, "total_training_steps": 10, "clip_grad": 1.0, **(optimizer or {})}
    )
    checkpoint_config = CheckpointConfig(
        save_contents=list(save_contents),
        load_contents=list(save_contents if load_contents is None else load_contents),
        save_lora_only=save_lora_only,
    )
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type="language_model",
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=checkpoint_config,
        )
    )
    if initialise:
        worker.reset()
    actor_config = ActorConfig(
        strategy="fsdp2",
        rollout_n=GROUP,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode="token-mean",
        use_kl_loss=False,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )
    worker.set_loss_fn(partial(ppo_loss, config=actor_config))
    return worker
