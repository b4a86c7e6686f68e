"""The recipe's CPU variant runs in VERL: VERL's worker, 2 Gloo ranks, tiny qwen4_exp + LoRA 16,
adapter-only sync, and a PEFT adapter that reproduces the trained model's logits exactly."""

from __future__ import annotations

import json
import math
import os

import pytest
import transformers

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"), reason="no qwen4_exp"),
]


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    from fsdp2_ext.verl_cpu_grpo import run

    root = str(tmp_path_factory.mktemp("recipe_cpu"))
    ok, by_rank = run(world_size=2, steps=2, keep=root)
    return ok, by_rank, root


def test_every_check_of_the_run_passes(recipe_run):
    ok, by_rank, _ = recipe_run
    assert not [row.get("trace") for row in by_rank.values() if "error" in row]
    assert ok


def test_steps_report_reward_loss_grad_norm_time_and_memory(recipe_run):
    _, by_rank, _ = recipe_run
    steps = by_rank[0]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert 0.0 <= s["reward"] <= 1.0
        assert math.isfinite(s["pg_loss"]) and math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
        assert s["seconds"] > 0 and s["pss_bytes_sum"] > 0
    other = by_rank[1]["steps"]  # the driver's part runs on every rank: the same batch
    assert [(s["reward"], s["pg_loss"]) for s in steps] == [
        (s["reward"], s["pg_loss"]) for s in other
    ]


def test_sync_carries_the_adapter_only(recipe_run):
    _, by_rank, root = recipe_run
    from safetensors import safe_open

    adapter = os.path.join(root, "adapter", "adapter_model.safetensors")
    with safe_open(adapter, "pt") as handle:
        names = list(handle.keys())
        adapter_bytes = sum(handle.get_tensor(n).nbytes for n in names)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    for s in by_rank[0]["steps"]:
        assert s["adapter_only"] and s["synced_tensors"] == len(names)
        assert s["synced_bytes"] == adapter_bytes  # not one base weight travels


def test_exported_adapter_is_peft_format_and_reproduces_the_trained_logits(recipe_run):
    _, by_rank, root = recipe_run
    with open(os.path.join(root, "adapter", "adapter_config.json")) as handle:
        config = json.load(handle)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 16, 32)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert by_rank[0]["reload_max_abs_diff"] == 0.0  # PeftModel.from_pretrained vs VERL's engine
    # Negative control: the checkpoint without the adapter does not give those logits.
    assert by_rank[0]["base_max_abs_diff"] > 0.0


def test_frozen_tables_stay_on_cpu_and_host_shared(recipe_run):
    _, by_rank, _ = recipe_run
    assert len(by_rank[0]["tables"]) == 2
    inodes = {}
    for key in ("trainer_table_inodes", "replica_table_inodes"):
        inodes[key] = {i for row in by_rank.values() for i in row[key]}
        assert len(inodes[key]) == 1 and 0 not in inodes[key], key
    # Loaded from the checkpoint, both map the checkpoint file itself: one page-cache copy.
    assert inodes["trainer_table_inodes"] == inodes["replica_table_inodes"]
    assert all(row["tables_on_cpu"] and row["only_lora_trainable"] for row in by_rank.values())
