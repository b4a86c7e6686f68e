"""Demo stage 2 (LoRA GRPO on a tiny qwen4_exp, 2 Gloo ranks) does what its report claims."""

from __future__ import annotations

import os

import pytest
import transformers

from distributed import run_distributed

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"), reason="no qwen4_exp"),
]


def _stage(rank, world_size, shared_dir, export_dir, results_dir):
    os.environ["VERL_NO_PLACEMENT_MMAP_DIR"] = shared_dir
    from fsdp2_ext.grpo_demo import STEPS, run_rank

    row = run_rank(rank, world_size, export_dir)
    assert row["architecture"] == "Qwen4ExpForCausalLM"
    assert len(row["tables"]) == 2 and row["table_ok"] and row["inode"] != 0
    assert row["only_lora_trainable"] and row["adapters"] > 0
    assert len(row["rewards"]) == STEPS
    with open(os.path.join(results_dir, f"rank{rank}"), "w") as out:
        out.write(repr((row["rewards"], row["inode"])))


def test_grpo_stage_trains_lora_and_exports_adapters_only(tmp_path):
    from safetensors.torch import load_file

    shared, export, results = (tmp_path / n for n in ("shared", "export", "results"))
    for directory in (shared, export, results):
        directory.mkdir()
    run_distributed(2, _stage, str(shared), str(export), str(results), timeout_s=300)
    rows = [(results / f"rank{r}").read_text() for r in range(2)]
    assert rows[0] == rows[1]  # same samples, same rewards, same mapped table on both ranks
    adapters = load_file(str(export / "adapter_model.safetensors"))
    assert adapters and all("lora_" in name for name in adapters)
    assert os.listdir(shared) == []
