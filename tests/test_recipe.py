"""The recipe composes with the installed VERL's Hydra schema, and its launcher checks its ground."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "qwen38_flash_next_bf16_lora_grpo")
sys.path.insert(0, RECIPE)
import launch  # noqa: E402

hydra = pytest.importorskip("hydra")
verl_spec = importlib.util.find_spec("verl")  # locating the package does not import it (ray)
if verl_spec is None:
    pytest.skip("verl is not installed", allow_module_level=True)
VERL_CONFIG = os.path.join(verl_spec.submodule_search_locations[0], "trainer", "config")
ENV = {
    "VERL_NO_PLACEMENT_MMAP_DIR": "/tmp",
    "MODEL_PATH": "/m",
    "TRAIN_FILES": "/t.parquet",
    "VAL_FILES": "/v.parquet",
}


def compose(variant: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    _, _, overrides = launch.load_overrides(variant)
    with initialize_config_dir(config_dir=VERL_CONFIG, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=launch.resolve(overrides, ENV))


def test_recipe_composes_with_the_spec_settings():
    config = compose("default")  # an unknown key would raise here
    model, actor, rollout = (config.actor_rollout_ref[k] for k in ("model", "actor", "rollout"))
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (2, 8)
    assert actor.strategy == "fsdp2" and actor.fsdp_config.fsdp_size == -1
    assert actor.fsdp_config.model_dtype == "bf16" and actor.optim.lr == 1e-5
    assert actor.loss_agg_mode == "token-mean" and actor.use_dynamic_bsz is True
    assert actor.use_kl_loss is False and config.algorithm.use_kl_in_reward is False
    assert config.algorithm.adv_estimator == "grpo"
    assert (model.lora_rank, model.lora_alpha, model.lora.merge) == (16, 32, False)
    assert list(model.target_parameters) == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert model.use_remove_padding is False and model.external_lib == "fsdp2_ext.verl"
    assert (model.mtp.enable, model.mtp.enable_train, model.mtp.num_speculative_tokens) == (
        True,
        False,
        3,
    )
    assert rollout.tensor_model_parallel_size == 4 and rollout.enforce_eager is False
    assert rollout.load_format == "safetensors" and rollout.n == 8
    assert config.data.train_batch_size == 8 and config.data.max_response_length == 4096
    assert model.path == "/m"


def test_cpu_variant_composes():
    config = compose("cpu_smoke")
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (1, 2)
    assert config.actor_rollout_ref.rollout.tensor_model_parallel_size == 1


def run_launcher(env, *args):
    return subprocess.run(
        [sys.executable, os.path.join(RECIPE, "launch.py"), *args],
        env={**{k: v for k, v in os.environ.items() if k not in ENV}, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_prints_the_resolved_command(tmp_path):
    result = run_launcher(
        {**ENV, "VERL_NO_PLACEMENT_MMAP_DIR": str(tmp_path)}, "--dry-run", "trainer.total_epochs=1"
    )
    assert result.returncode == 0, result.stderr
    assert "-m verl.trainer.main_ppo" in result.stdout
    assert "actor_rollout_ref.model.path=/m" in result.stdout
    assert result.stdout.strip().endswith("trainer.total_epochs=1")


def test_refuses_without_the_shared_directory():
    result = run_launcher(
        {k: v for k, v in ENV.items() if k != "VERL_NO_PLACEMENT_MMAP_DIR"}, "--dry-run"
    )
    assert result.returncode == 2
    assert "VERL_NO_PLACEMENT_MMAP_DIR is not set" in result.stderr


def test_refuses_a_missing_directory():
    result = run_launcher({**ENV, "VERL_NO_PLACEMENT_MMAP_DIR": "/no/such/dir"}, "--dry-run")
    assert result.returncode == 2
    assert "does not exist" in result.stderr


def test_recipe_loads_the_shim_at_import_verl_and_through_external_lib():
    assert launch.recipe_environment()["VERL_USE_EXTERNAL_MODULES"] == "fsdp2_ext.verl"
    assert launch.recipe_environment("cpu_smoke")["VERL_USE_EXTERNAL_MODULES"] == "fsdp2_ext.verl"
    assert compose("default").actor_rollout_ref.model.external_lib == "fsdp2_ext.verl"
