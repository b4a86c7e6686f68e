"""VERL's own TrainingWorker + FSDPEngine on CPU ranks: what the engine-level tests and the
cold-start benchmark build and drive.

Everything here is VERL's: the worker, the engine, the checkpoint manager,
``left_right_2_no_padding``, GRPO's advantage (``compute_grpo_outcome_advantage``) and policy loss
(``ppo_loss``). The CPU comes from ``fsdp2_ext.verl_cpu.plugin`` ([Note: VERL on a CPU
platform]); the shim is loaded, when a caller wants it, only the way VERL loads it:
``HFModelConfig(external_lib="fsdp2_ext.verl")``.

Import VERL only inside functions: spawned ranks unpickle their worker before ``ENGINE_ENV`` is
set (pass it as the spawn helper's ``env``), and VERL resolves its platform once.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from fsdp2_ext.verl_cpu.toy_run import CPU_ENV

__all__ = [
    "ENGINE_ENV",
    "GROUP",
    "build_training_worker",
    "build_worker",
    "env_for",
    "full_state",
    "grpo_batch",
    "infer_log_probs",
    "rank_slice",
    "test_dir",
    "train_step",
]

GROUP = 2  # GRPO group size (rollout.n) of the engine tests' batches
# Set in every rank before `import verl`: the CPU run's environment with the CPU support alone (a
# caller loads the shim itself, through external_lib, when it wants it).
ENGINE_ENV = {
    **CPU_ENV,
    "VERL_USE_EXTERNAL_MODULES": "fsdp2_ext.verl_cpu.plugin",
    "VERL_LOGGING_LEVEL": "WARN",
    "NCCL_DEBUG": "WARN",
}
PROMPT_LEN, RESPONSE_LEN = 4, 6


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
    lora_adapter_path: str | None = None,
    fsdp_size: int = -1,
    hub_kernels_off: bool | None = None,
):
    """VERL's TrainingWorker for ``model_path`` with GRPO's policy loss set; initialised
    (``worker.reset()``: model, FSDP2, optimizer) unless ``initialise=False``. ``optimizer``:
    ``FSDPOptimizerConfig`` fields over the defaults (lr 1e-3, 10 steps, clip 1.0);
    ``load_contents``: what ``load_checkpoint`` restores (default: what is saved);
    ``lora_adapter_path``: a saved PEFT adapter VERL loads instead of new adapters (the one way
    VERL's engine takes ``modules_to_save``); ``fsdp_size``: VERL's shard-group size (below the
    world size VERL builds its 2-D ``("ddp", "fsdp")`` mesh, HSDP); ``hub_kernels_off``: set
    ``USE_HUB_KERNELS=0`` in this process first (default: VERL alone, see below)."""
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
        lora_adapter_path=lora_adapter_path,
        external_lib="fsdp2_ext.verl" if shim else None,
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
        use_torch_compile=False,
        model_dtype=model_dtype,
        fsdp_size=fsdp_size,
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
    if (not shim) if hub_kernels_off is None else hub_kernels_off:
        # VERL alone on Transformers 5.25 builds its non-zero ranks on meta with from_pretrained,
        # whose default kernelize raises there ([Note: hub kernels once the weights are real]):
        # the reference runs with hub kernels off, the one form VERL alone starts in. On the CPU
        # no hub kernel maps a layer (transformers/integrations/hub_kernels.py:221-261), so its
        # forwards are the code the shim's kernelized model runs. Set for this process: its
        # later train()/eval() find kernels off, as its build left them.
        os.environ["USE_HUB_KERNELS"] = "0"
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


def build_worker(model_path: str, **options):
    """VERL's TrainingWorker for ``model_path``, initialised (``build_training_worker``)."""
    return build_training_worker(model_path, **options)


def grpo_batch(
    batch: int, vocab: int, *, seed: int, position_rows: int = 0, equal_lengths: bool = True
):
    """A left/right padded GRPO batch as VERL's trainer has it, put through VERL's own
    ``left_right_2_no_padding``: nested input/position ids, GRPO advantages from VERL."""
    from tensordict import TensorDict
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (batch, PROMPT_LEN), generator=generator)
    responses = torch.randint(3, vocab, (batch, RESPONSE_LEN), generator=generator)
    prompt_mask = torch.ones(batch, PROMPT_LEN, dtype=torch.long)
    response_mask = torch.ones(batch, RESPONSE_LEN, dtype=torch.long)
    if not equal_lengths:
        for b in range(batch):
            prompt_mask[b, : b % 2] = 0  # left padding
            response_mask[b, RESPONSE_LEN - (b % 3) :] = 0  # right padding
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if position_rows:
        positions = torch.stack([positions + 7 * row for row in range(position_rows)], dim=1)
    scores = torch.tensor([1.0 if b % 2 == 0 else -1.0 for b in range(batch)])  # each group: +1, -1
    token_rewards = torch.zeros(batch, RESPONSE_LEN)
    last = response_mask.sum(-1) - 1
    token_rewards[torch.arange(batch), last] = scores
    index = [str(b // GROUP) for b in range(batch)]
    advantages, _ = compute_grpo_outcome_advantage(token_rewards, response_mask.float(), index)
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": positions,
            "old_log_probs": torch.full((batch, RESPONSE_LEN), -3.0),
            "advantages": advantages,
        },
        batch_size=[batch],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, global_batch_size=batch)
    return td


def rank_slice(td, rank: int, world_size: int):
    """This rank's part of a batch, cut as VERL's dispatch cuts it (``chunk_tensordict``)."""
    from verl.utils import tensordict_utils as tu

    return tu.chunk_tensordict(td, world_size)[rank]


def train_step(worker, td):
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(td, mini_batch_size=td.shape[0] * 2, epochs=1)  # one optimizer step
    return tu.get(worker.train_mini_batch(td), "metrics")


def infer_log_probs(worker, td):
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(td, compute_loss=False)
    return tu.get(worker.infer_batch(td), "log_probs")


def full_state(worker) -> dict[str, torch.Tensor]:
    """Every parameter in full (collective: all ranks call it in the same order)."""
    module = worker.engine.module
    out = {}
    for name, param in module.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = tensor.detach().cpu().clone()
    return out


def env_for(directory: str) -> dict[str, str]:
    return dict(ENGINE_ENV, FSDP2_EXT_TEST_DIR=directory)


def test_dir() -> str:
    return os.environ["FSDP2_EXT_TEST_DIR"]
