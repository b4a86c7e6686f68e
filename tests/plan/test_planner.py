"""`fsdp2-ext plan`: per-GPU and per-host memory, checked against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from fsdp2_ext.plan.planner import format_plan, plan_memory


class Toy(nn.Module):
    _no_placement_params = ["table.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 10)
        self.proj = nn.Linear(10, 6)
        self.table = nn.Embedding(100, 8)


def test_toy_plan_by_hand():
    with torch.device("meta"):
        model = Toy()
    plan = plan_memory(model, world_size=4, nodes=2, lora_rank=2, target_modules=["proj"])
    # bf16, W = 4: embed ceil(37/4) = 10 rows x 10 x 2 B = 200; proj.weight 2 rows x 10 x 2 = 40;
    # proj.bias 2 x 2 = 4. The table (100 x 8 x 2 = 1600 B) stays on CPU, out of the shards.
    assert plan.shard_bytes_per_gpu == 244
    assert plan.no_placement == {"table.weight": 1600}
    assert plan.host_cpu_bytes_unshared == 2 * 1600  # 2 GPUs per host, one copy each
    assert plan.host_cpu_bytes_shared == 1600
    assert plan.lora_parameters == 2 * (10 + 6)  # PEFT's lora_A (2, 10) and lora_B (6, 2)
    # Each a Shard(0) parameter in the base's dtype (VERL casts them): ceil(2/4) x 10 and
    # ceil(6/4) x 2 elements per GPU, 2 B each.
    assert plan.lora_bytes_per_gpu == (1 * 10 + 2 * 2) * 2
    # [Note: rank-0 transfer]: two slots of parts, a part no larger than a rank's shard (244 B
    # here, not the 16 MiB a full bucket part would be); rank 0 holds one per rank on the GPU
    # (its own a scratch part) and one per receiving rank pinned on the host.
    assert plan.peak_gpu_bytes_during_load == 244 + 2 * 244
    assert plan.peak_rank0_gpu_bytes_during_load == 244 + 2 * 4 * 244
    assert plan.peak_rank0_cpu_bytes_during_load == (370 + 66 + 800) * 2 + 2 * 3 * 244
    # One save: 32 LoRA parameters and their two AdamW moments, 2 B each (bf16, the parameters'
    # dtype); without save_lora_only, the 4 ranks' base shards (244 B each) too; VERL alone adds
    # every rank's table (4 x 1600).
    assert plan.save_bytes_lora_only == 32 * 3 * 2
    assert plan.save_bytes_full == 32 * 3 * 2 + 4 * 244
    assert plan.save_bytes_full_verl_alone == 32 * 3 * 2 + 4 * 244 + 4 * 1600
    # A resume from another number of GPUs: each rank assembles its rows of every saved tensor
    # at W = 4: the adapter's ((1 x 10 + 2 x 2) x 2 B) and its two moments; without
    # save_lora_only its base shard (244 B) too.
    assert plan.reshard_rank_bytes_lora_only == 3 * (1 * 10 + 2 * 2) * 2
    assert plan.reshard_rank_bytes_full == 3 * (1 * 10 + 2 * 2) * 2 + 244
    assert "no-placement tables" in format_plan(plan) and "save_lora_only" in format_plan(plan)
    assert "resumed from another GPU count" in format_plan(plan)


def test_rank0_staging_is_one_part_per_rank_per_slot():
    with torch.device("meta"):
        model = nn.Linear(4096, 4096, bias=False)  # 32 MiB in bf16
    plan = plan_memory(model, world_size=8, bucket_bytes=64 << 20)
    assert plan.shard_bytes_per_gpu == 4 << 20
    assert plan.peak_gpu_bytes_during_load == (4 << 20) + 2 * (4 << 20)  # part capped by shard
    plan = plan_memory(model, world_size=2, bucket_bytes=16 << 20)
    part = (16 << 20) // 2
    assert plan.peak_gpu_bytes_during_load == (16 << 20) + 2 * part
    assert plan.peak_rank0_gpu_bytes_during_load == (16 << 20) + 2 * 2 * part
    assert plan.peak_rank0_cpu_bytes_during_load == (32 << 20) + 2 * part


def test_replicated_buffers_count_on_every_gpu():
    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8, bias=False)  # bf16: 2 rows x 8 x 2 B = 32 per GPU (W=4)
            self.register_buffer("inv_freq", torch.ones(16), persistent=False)  # fp32: 64 B

    with torch.device("meta"):
        model = Rotary()
    plan = plan_memory(model, world_size=4)
    assert plan.shard_bytes_per_gpu == 32 and plan.replicated_bytes_per_gpu == 64
    assert plan.peak_gpu_bytes_during_load == 96 + 2 * 96  # the part holds buffers too


def test_scalar_parameters_are_refused_as_fully_shard_refuses_them():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.tensor(2.0))

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match=r"\['scale'\] are scalar \(0-d\) parameters"):
        plan_memory(model, world_size=2)


def test_hsdp_plans_the_shard_group_and_saves_every_replica():
    """fsdp_size 2 on 4 GPUs (VERL's 2 x 2 ('ddp', 'fsdp') mesh): per GPU what 2-way sharding
    holds; each save holds both replicas' files; the resharded resume is refused there."""
    with torch.device("meta"):
        model = Toy()
    hsdp = plan_memory(model, world_size=4, nodes=2, fsdp_size=2, lora_rank=2,
                       target_modules=["proj"])  # fmt: skip
    flat = plan_memory(model, world_size=2, nodes=1, lora_rank=2, target_modules=["proj"])
    assert hsdp.fsdp_size == 2 and flat.fsdp_size == 2
    for field in ("shard_bytes_per_gpu", "lora_bytes_per_gpu", "peak_gpu_bytes_during_load",
                  "peak_rank0_gpu_bytes_during_load", "peak_rank0_cpu_bytes_during_load"):  # fmt: skip
        assert getattr(hsdp, field) == getattr(flat, field), field
    # bf16, 2-way: embed ceil(37/2) = 19 rows x 10 x 2 B = 380; proj 3 x 10 x 2 = 60, bias 3 x 2
    assert hsdp.shard_bytes_per_gpu == 380 + 60 + 6
    assert hsdp.save_bytes_lora_only == 2 * flat.save_bytes_lora_only  # two replicas write
    assert hsdp.save_bytes_full == hsdp.save_bytes_lora_only + 4 * hsdp.shard_bytes_per_gpu
    assert hsdp.reshard_rank_bytes_full == hsdp.reshard_rank_bytes_lora_only == 0  # refused
    text = format_plan(hsdp)
    assert "HSDP: 2 replicas of fsdp_size 2" in text and "refused on an HSDP mesh" in text
    with pytest.raises(ValueError, match="must divide world_size"):
        plan_memory(model, world_size=4, fsdp_size=3)
    with pytest.raises(ValueError, match="must divide world_size"):
        plan_memory(model, world_size=4, fsdp_size=0)
    for flat_size in (-1, 4, 8):  # VERL's create_device_mesh: plain FSDP over every GPU
        assert plan_memory(model, world_size=4, fsdp_size=flat_size).fsdp_size == 4
    # Without LoRA the base trains: a save holds its AdamW moments too (3 x the shards).
    assert plan_memory(model, world_size=4).save_bytes_full == 3 * 4 * 244


def test_hsdp_load_peak_holds_one_bucket_along_ddp():
    """[Note: HSDP loads]: after the scatter (two parts of 2 MiB staged here), a rank holds one
    bucket of the broadcast along ddp: 16 MiB, its whole shard."""
    with torch.device("meta"):
        model = nn.Linear(8192, 1024, bias=False)  # 16 MiB in bf16: 2 MiB per GPU at 8
    flat = plan_memory(model, world_size=8, bucket_bytes=16 << 20)
    hsdp = plan_memory(model, world_size=16, fsdp_size=8, bucket_bytes=16 << 20)
    assert flat.shard_bytes_per_gpu == hsdp.shard_bytes_per_gpu == 2 << 20
    assert flat.peak_gpu_bytes_during_load == (2 << 20) + 2 * (2 << 20)
    with torch.device("meta"):
        model = nn.Linear(8192, 8192, bias=False)  # 128 MiB: 16 MiB per GPU at 8
    flat = plan_memory(model, world_size=8, bucket_bytes=16 << 20)
    hsdp = plan_memory(model, world_size=16, fsdp_size=8, bucket_bytes=16 << 20)
    assert flat.peak_gpu_bytes_during_load == (16 << 20) + 2 * (2 << 20)
    assert hsdp.peak_gpu_bytes_during_load == (16 << 20) + (16 << 20)


def test_world_size_must_divide_into_nodes():
    with pytest.raises(ValueError, match="multiple of nodes"):
        plan_memory(Toy(), world_size=3, nodes=2)


@pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"), reason="no qwen4_exp")
def test_qwen4_exp_table_is_95_37_gib():
    from fsdp2_ext.testing.tiny_models import tiny_qwen4_exp_kwargs as tiny_text_kwargs

    kwargs = tiny_text_kwargs()
    # The real n-gram settings: 3-grams x 8 heads = 16 hashed heads, base 20,000,000 rows,
    # rows rounded to a multiple of 128; 2560 / 16 = 160 columns; one PLE layer.
    kwargs.update(
        ple_layer_ids=[1],
        ple_embed_dim=2560,
        heads_per_ngram=8,
        ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128,
    )
    with torch.device("meta"):
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**kwargs))
    plan = plan_memory(model, world_size=16, nodes=2, lora_rank=16, target_modules=["q_proj"])
    ((fqn, size),) = plan.no_placement.items()
    assert fqn == "model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    assert size == 320_001_536 * 160 * 2
    assert f"{size / 2**30:.2f}" == "95.37"
    assert plan.host_cpu_bytes_unshared == 8 * size and plan.host_cpu_bytes_shared == size
