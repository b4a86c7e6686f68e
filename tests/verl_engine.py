"""VERL's own TrainingWorker + FSDPEngine on CPU ranks: the pieces the engine-level tests share.

Everything here is VERL's: the worker, the engine, the checkpoint manager, ``left_right_2_no_padding``,
GRPO's advantage (``compute_grpo_outcome_advantage``) and policy loss (``ppo_loss``). The CPU comes
from ``fsdp2_ext.verl_cpu.plugin`` (see [Note: VERL on a CPU platform]); the shim is loaded, when
a test wants it, only the way VERL loads it: ``HFModelConfig(external_lib="fsdp2_ext.verl")``.

Import VERL only inside functions: spawned ranks unpickle their worker before the environment
below is set, and VERL resolves its platform once.
"""

from __future__ import annotations

import os

import torch

from fsdp2_ext.testing.verl_worker import GROUP
from fsdp2_ext.verl_cpu.toy_run import CPU_ENV

# Set in every rank before `import verl` (see distributed.run_distributed's env): the CPU run's
# environment, with the platform alone (a test loads the shim itself when it wants it).
ENGINE_ENV = {
    **CPU_ENV,
    "VERL_USE_EXTERNAL_MODULES": "fsdp2_ext.verl_cpu.plugin",
    "VERL_LOGGING_LEVEL": "WARN",
    "NCCL_DEBUG": "WARN",
}
PROMPT_LEN, RESPONSE_LEN = 4, 6


def save_tiny_qwen2(directory: str, *, tied: bool = True) -> str:
    """A tiny Qwen2 checkpoint written with save_pretrained (bf16 weights, fixed seed)."""
    from test_fsdp2_full_state_load import tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(tied)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def save_tiny_qwen4_exp(directory: str) -> str:
    """A tiny qwen4_exp (n-gram PLE tables included) written with save_pretrained."""
    import transformers

    from fsdp2_ext.testing.tiny_models import tiny_qwen4_exp_kwargs

    config = transformers.Qwen4ExpTextConfig(**tiny_qwen4_exp_kwargs())
    torch.manual_seed(0)
    transformers.Qwen4ExpForCausalLM(config).save_pretrained(directory)
    return directory


def build_worker(model_path: str, **options):
    """VERL's TrainingWorker for ``model_path``, initialised (``build_training_worker``)."""
    from fsdp2_ext.testing.verl_worker import build_training_worker

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
