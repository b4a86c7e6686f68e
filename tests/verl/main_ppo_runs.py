"""The recipe's CPU variant through ``main_ppo``: the runs several tests read (each costs minutes).

``uninterrupted`` is 4 steps with the actor probe in every process (``fsdp2_ext.testing.
actor_probe``); the resume tests compare against it. Started once per session, on first use.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "qwen38_flash_next_bf16_lora_grpo")
STEPS = 4
PROBED_MODULES = "fsdp2_ext.verl_cpu.plugin,fsdp2_ext.verl,fsdp2_ext.testing.actor_probe"


def overrides(*extra: str, probe: bool = False) -> list[str]:
    """The command's overrides: ``STEPS`` steps (saves and evaluations every 2, as the recipe)."""
    out = [f"trainer.total_training_steps={STEPS}", *extra]
    if probe:  # quoted: a comma in a Hydra override value is a sweep otherwise
        out.append(
            f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{PROBED_MODULES}'"
        )
    return out


def recipe_plan(run, config_name: str = "recipe_cpu"):
    """(the run's model on meta, the recipe variant's settings, its memory plan in fp32): what the
    tests hold the run's processes against."""
    import torch
    import transformers

    from fsdp2_ext.plan.planner import plan_memory
    from fsdp2_ext.plan.recipe_settings import read_recipe
    from fsdp2_ext.verl_cpu.toy_run import environment

    model_path = environment(run.directory)["MODEL_PATH"]
    settings = read_recipe(os.path.join(RECIPE, f"{config_name}.yaml"), environ={})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(model_path)
        )
    memory = plan_memory(
        model, world_size=settings.world_size, nodes=settings.nodes, dtype=torch.float32,
        lora_rank=settings.lora_rank, target_modules=settings.target_modules,
        target_parameters=settings.target_parameters,
    )  # fmt: skip
    return model, settings, memory
