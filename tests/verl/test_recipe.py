"""The recipe is a Hydra config that VERL's own entry point loads, and its launcher checks its ground."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "qwen38_flash_next_bf16_lora_grpo")
sys.path.insert(0, RECIPE)
import launch  # noqa: E402

pytest.importorskip("hydra")
if importlib.util.find_spec("verl") is None:  # locating the package does not import it (ray)
    pytest.skip("verl is not installed", allow_module_level=True)
ENV = {
    "VERL_NO_PLACEMENT_MMAP_DIR": "/tmp",
    "MODEL_PATH": "/m",
    "TRAIN_FILES": "/t.parquet",
    "VAL_FILES": "/v.parquet",
}


def compose_through_main_ppo(variant: str) -> dict:
    """The config exactly as ``python -m verl.trainer.main_ppo --config-path ... --config-name``
    composes it (Hydra's ``--cfg job --resolve`` prints it instead of running)."""
    result = subprocess.run(
        launch.command(variant, ["--cfg", "job", "--resolve"]),
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def recipe() -> dict:
    return compose_through_main_ppo("default")


@pytest.fixture(scope="module")
def recipe_cpu() -> dict:
    return compose_through_main_ppo("cpu")


def test_recipe_composes_on_ppo_trainer_with_the_spec_settings(recipe):
    config = recipe
    arr = config["actor_rollout_ref"]
    model, actor, rollout = arr["model"], arr["actor"], arr["rollout"]
    assert (config["trainer"]["nnodes"], config["trainer"]["n_gpus_per_node"]) == (2, 8)
    assert actor["strategy"] == "fsdp2" and actor["fsdp_config"]["fsdp_size"] == -1
    assert actor["fsdp_config"]["model_dtype"] == "bf16" and actor["optim"]["lr"] == 1e-5
    assert actor["loss_agg_mode"] == "token-mean" and actor["use_dynamic_bsz"] is True
    assert actor["use_kl_loss"] is False and config["algorithm"]["use_kl_in_reward"] is False
    assert config["algorithm"]["adv_estimator"] == "grpo"
    assert (model["lora_rank"], model["lora_alpha"], model["lora"]["merge"]) == (16, 32, False)
    assert model["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert "in_proj_qkv" in model["target_modules"] and "gate_proj" in model["target_modules"]
    assert model["use_remove_padding"] is False and model["external_lib"] == "fsdp2_ext.verl"
    assert model["override_config"]["attn_implementation"] == "sdpa"
    mtp = model["mtp"]
    assert (mtp["enable"], mtp["enable_train"], mtp["enable_rollout"]) == (True, False, True)
    assert mtp["num_speculative_tokens"] == 3
    assert rollout["name"] == "vllm" and rollout["tensor_model_parallel_size"] == 4
    assert rollout["enforce_eager"] is False and rollout["load_format"] == "safetensors"
    assert rollout["n"] == 8 and rollout["checkpoint_engine"]["backend"] == "naive"
    assert rollout["engine_kwargs"]["vllm"]["language_model_only"] is True
    assert config["data"]["train_batch_size"] == 8 and config["data"]["max_response_length"] == 4096
    assert rollout["response_length"] == 4096  # VERL's own interpolation saw the recipe's value
    assert (model["path"], config["data"]["train_files"]) == ("/m", "/t.parquet")
    env_vars = config["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert env_vars == {
        "VERL_USE_EXTERNAL_MODULES": "fsdp2_ext.verl",
        "FSDP2_EXT_INIT_SOURCE": "checkpoint",
        "FSDP2_EXT_VLLM_VERSION": "0.32.0",
        "PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64",
        "FSDP2_EXT_PLE_HOST_COPY": "0",  # stated, off until the GPU check has passed
    }
    engram = rollout["engine_kwargs"]["vllm"]["engram_config"]  # explicit, as the plan reads it
    assert engram == {"cpu_offload": True, "embedding_across_dp": False}


def test_cpu_variant_composes_on_the_same_settings(recipe, recipe_cpu):
    config = recipe_cpu
    arr = config["actor_rollout_ref"]
    assert (config["trainer"]["nnodes"], config["trainer"]["n_gpus_per_node"]) == (1, 2)
    assert arr["rollout"]["name"] == "hf" and arr["rollout"]["tensor_model_parallel_size"] == 1
    assert arr["model"]["mtp"]["enable"] is False
    assert config["reward"]["custom_reward_function"]["path"] == "pkg://fsdp2_ext.verl_cpu.toy_run"
    env_vars = config["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert env_vars["VERL_PLATFORM"] == "cpu"
    assert env_vars["VERL_USE_EXTERNAL_MODULES"].split(",")[-1] == "fsdp2_ext.verl"
    assert env_vars["FSDP2_EXT_INIT_SOURCE"] == "checkpoint"  # inherited
    # Everything the CPU file does not set is the recipe's own value.
    for key in ("lora_rank", "lora_alpha", "target_modules", "target_parameters", "external_lib"):
        assert arr["model"][key] == recipe["actor_rollout_ref"]["model"][key]
    for key in ("strategy", "loss_agg_mode", "use_dynamic_bsz", "use_kl_loss"):
        assert arr["actor"][key] == recipe["actor_rollout_ref"]["actor"][key]
    assert config["algorithm"] == recipe["algorithm"]


def test_vllm_cpu_variant_is_the_cpu_variant_with_vllm(recipe_cpu):
    """``recipe_cpu_vllm``: the CPU variant's settings with VERL's vLLM rollout (TP 2, adapter-only
    sync from the checkpoint's files, sleep mode off) on a dense model's LoRA targets."""
    config = compose_through_main_ppo("cpu_vllm")
    arr, cpu = config["actor_rollout_ref"], recipe_cpu["actor_rollout_ref"]
    rollout = arr["rollout"]
    assert rollout["name"] == "vllm" and rollout["tensor_model_parallel_size"] == 2
    assert rollout["load_format"] == "safetensors" and rollout["dtype"] == "bfloat16"
    assert rollout["enable_sleep_mode"] is False and rollout["free_cache_engine"] is False
    assert all(v is None for v in rollout["engine_kwargs"]["vllm"].values())  # Qwen4Exp's: off
    assert arr["model"]["lora"]["merge"] is False and arr["model"]["lora_rank"] == 16
    assert arr["model"]["target_parameters"] is None
    assert arr["model"]["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]  # fmt: skip
    assert config["trainer"]["total_training_steps"] == 3
    assert arr["actor"] == cpu["actor"] and config["ray_kwargs"] == recipe_cpu["ray_kwargs"]
    files = [os.path.basename(f) for f in launch.recipe_files("cpu_vllm")]
    assert files == ["qwen38_flash_next_16xh200.yaml", "cpu_scale.yaml", "recipe_cpu_vllm.yaml"]


def test_the_run_composes_the_cpu_variant_as_main_ppo_does(recipe_cpu, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    with initialize_config_dir(config_dir=RECIPE, version_base=None):
        config = compose(config_name="recipe_cpu")
    OmegaConf.resolve(config)
    assert OmegaConf.to_container(config) == recipe_cpu


def run_launcher(env, *args):
    return subprocess.run(
        [sys.executable, os.path.join(RECIPE, "launch.py"), *args],
        env={**{k: v for k, v in os.environ.items() if k not in ENV}, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_prints_verl_s_entry_point_on_the_config_file(tmp_path):
    # MODEL_PATH=/m has no config.json: the host plan cannot be made, which refuses the launch
    # unless told to go on (tests/plan/test_host_plan.py has the plan itself).
    env = {**ENV, "VERL_NO_PLACEMENT_MMAP_DIR": str(tmp_path)}
    refused = run_launcher(env, "--dry-run")
    assert refused.returncode == 2 and "has no config.json" in refused.stderr, refused.stderr
    result = run_launcher(env, "--dry-run", "--skip-host-check", "trainer.total_epochs=1")
    assert result.returncode == 0, result.stderr
    assert f"-m verl.trainer.main_ppo --config-path {RECIPE} --config-name recipe" in result.stdout
    assert result.stdout.startswith("VERL_USE_EXTERNAL_MODULES=fsdp2_ext.verl ")
    assert result.stdout.strip().endswith("trainer.total_epochs=1")


def test_refuses_without_the_shared_directory_or_a_variable_the_files_read():
    env = {k: v for k, v in ENV.items() if k not in ("VERL_NO_PLACEMENT_MMAP_DIR", "MODEL_PATH")}
    result = run_launcher(env, "--dry-run")
    assert result.returncode == 2
    assert "VERL_NO_PLACEMENT_MMAP_DIR is not set" in result.stderr
    assert "MODEL_PATH is not set" in result.stderr


def test_refuses_a_missing_directory():
    result = run_launcher({**ENV, "VERL_NO_PLACEMENT_MMAP_DIR": "/no/such/dir"}, "--dry-run")
    assert result.returncode == 2
    assert "does not exist" in result.stderr


def test_required_environment_is_read_from_the_files():
    assert sorted(launch.required_environment()) == sorted(ENV)
    assert sorted(launch.required_environment("cpu")) == sorted(ENV)
