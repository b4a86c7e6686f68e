"""The toy run of the recipe's CPU variant: what ``main_ppo`` needs to run it on a laptop.

    python -m fsdp2_ext.verl_cpu.toy_run /tmp/toy        # writes it, prints the environment
    eval "$(python -m fsdp2_ext.verl_cpu.toy_run /tmp/toy --exports)"
    python -m verl.trainer.main_ppo --config-path $PWD/recipes/qwen38_flash_next_bf16_lora_grpo \\
        --config-name recipe_cpu

It writes a tiny qwen4_exp checkpoint with every part of the real model (linear and indexed
attention, MoE, the PLE n-gram tables on two layers) with ``save_pretrained``, a character-level
tokenizer, and the task's train/val parquet files. The task is verifiable: a prompt asks for
digits, the reward is the share of the response's characters that are digits (``compute_score``,
named in ``recipe_cpu.yaml``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

__all__ = ["CPU_ENV", "TASK_SOURCE", "compute_score", "environment", "write_toy_run"]

# What every process needs, before `import verl`, to run VERL on CPU ranks with fsdp2_ext: the
# CPU support first (it registers the platform VERL resolves at once), then the shim.
CPU_ENV = {
    "VERL_USE_EXTERNAL_MODULES": "fsdp2_ext.verl_cpu.plugin,fsdp2_ext.verl",
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cuda",  # VERL's engine registry knows cuda/npu; the platform is the CPU
    "FSDP2_EXT_INIT_SOURCE": "checkpoint",  # as the recipe
    "TOKENIZERS_PARALLELISM": "false",
}
TASK_SOURCE = "fsdp2_ext/digits"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """The toy task's verifiable reward: the share of the response's characters in
    ``ground_truth`` (the digits). VERL's reward manager calls it with the decoded response."""
    if data_source != TASK_SOURCE:
        raise ValueError(
            f"compute_score: unknown data_source {data_source!r} (expected {TASK_SOURCE!r})"
        )
    text = solution_str.replace(" ", "")
    return sum(ch in ground_truth for ch in text) / len(text) if text else 0.0


def write_toy_run(
    directory: str, prompts: int = 8, *, stored_dtype: str | None = None, model: str = "qwen4_exp"
) -> dict[str, str]:
    """Checkpoint (``save_pretrained``, n-gram tables included), tokenizer and the task's
    train/val parquet files in ``directory``; returns the recipe's variables for them.
    ``stored_dtype`` (e.g. ``"bfloat16"``): the checkpoint stores every tensor in that dtype, so
    the fp32 run converts its tables as it loads them and they cannot be views of the file, as on
    a network filesystem: the trainer maps one host-shared copy (``VERL_NO_PLACEMENT_MMAP_DIR``).
    Every stored value is a bf16 one whatever the dtype, so the fp32 and the bf16 checkpoint hold
    the same numbers and an fp32 run trains alike, to the bit, on either (the tests compare a run
    on each: tables as views and tables shared once per host).
    ``model="qwen3"``: a tiny dense Qwen3 in bf16 instead (``save_tiny_qwen3``), for the recipe's
    vLLM variant (``recipe_cpu_vllm``: vLLM's Qwen4Exp needs a GPU)."""
    import pandas
    import torch
    import transformers

    from fsdp2_ext.testing.tiny_models import (
        DIGITS,
        save_tiny_qwen3,
        save_tiny_tokenizer,
        tiny_qwen4_exp_kwargs,
    )

    model_dir = _paths(directory)["MODEL_PATH"]
    if model == "qwen3":
        save_tiny_qwen3(model_dir)
    else:
        config = transformers.Qwen4ExpTextConfig(**tiny_qwen4_exp_kwargs())
        torch.manual_seed(0)
        hf_model = transformers.Qwen4ExpForCausalLM(config)
        with torch.no_grad():  # every value a bf16 one (a tied tensor is rounded twice, alike)
            for tensor in hf_model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.copy_(tensor.to(torch.bfloat16))
        if stored_dtype is not None:
            hf_model = hf_model.to(getattr(torch, stored_dtype))
        hf_model.save_pretrained(model_dir)
        save_tiny_tokenizer(model_dir, config.vocab_size)
    rows = [
        {
            "data_source": TASK_SOURCE,
            "prompt": [{"role": "user", "content": f"digits {i}?"}],
            "reward_model": {"style": "rule", "ground_truth": DIGITS},
            "extra_info": {"index": i},
        }
        for i in range(prompts)
    ]
    paths = _paths(directory)
    pandas.DataFrame(rows).to_parquet(paths["TRAIN_FILES"])
    pandas.DataFrame(rows).to_parquet(paths["VAL_FILES"])
    os.makedirs(paths["VERL_NO_PLACEMENT_MMAP_DIR"], exist_ok=True)
    return paths


def environment(directory: str) -> dict[str, str]:
    """Everything ``main_ppo`` needs for the toy run in ``directory`` (written already)."""
    return {**CPU_ENV, **_paths(directory)}


def _paths(directory: str) -> dict[str, str]:
    return {
        "MODEL_PATH": os.path.join(directory, "tiny_qwen4_exp"),
        "TRAIN_FILES": os.path.join(directory, "train.parquet"),
        "VAL_FILES": os.path.join(directory, "val.parquet"),
        "VERL_NO_PLACEMENT_MMAP_DIR": os.path.join(directory, "host_shared"),
        "CHECKPOINT_DIR": os.path.join(directory, "checkpoints"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", help="where to write the toy run (created if missing)")
    parser.add_argument(
        "--exports", action="store_true", help="print only the export lines (for eval)"
    )
    parser.add_argument(
        "--model", choices=("qwen4_exp", "qwen3"), default="qwen4_exp",
        help="qwen3: the dense toy of the recipe's vLLM variant (recipe_cpu_vllm)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.directory)
    os.makedirs(directory, exist_ok=True)
    write_toy_run(directory, model=args.model)
    exports = [f"export {k}={shlex.quote(v)}" for k, v in environment(directory).items()]
    if args.exports:
        print("\n".join(exports))
        return 0
    print(f"toy run written to {directory}; the environment main_ppo needs:\n")
    print("\n".join(exports))
    print(
        "\npython -m verl.trainer.main_ppo --config-path "
        "$PWD/recipes/qwen38_flash_next_bf16_lora_grpo --config-name recipe_cpu"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
