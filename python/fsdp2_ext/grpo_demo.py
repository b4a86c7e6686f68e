"""Stage 2 of the demo: LoRA GRPO on a tiny model of the real architecture, 2 CPU ranks (Gloo).

    python -m fsdp2_ext.demo            # runs it after the sharded-init stage

In order: build the model (rank 0 on CPU, other ranks on meta) → LoRA (PEFT; the frozen n-gram
table stays frozen) → ``init_sharded`` (sharded load, table host-shared through
``VERL_NO_PLACEMENT_MMAP_DIR``) → a few GRPO steps on a synthetic verifiable reward (the share of
sampled tokens with an even id; group-normalised advantages, token-mean loss) → adapter-only
export (safetensors, rank 0). The model is Transformers' ``qwen4_exp``; without it the stage is
skipped with a message.
"""

from __future__ import annotations

import os
import resource
import time

import torch
import torch.distributed as dist

PROMPTS = torch.tensor([[0, 5, 9, 3], [0, 11, 4, 6]])
GROUP, NEW_TOKENS, STEPS = 4, 6, 3


def tiny_qwen4_exp_kwargs() -> dict:
    """``Qwen4ExpTextConfig`` keywords of the smallest model with every part of the real one
    (linear + indexed attention, MoE, PLE n-gram tables on layers 1 and 2)."""
    return dict(
        vocab_size=128, hidden_size=32, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
        ple_layer_ids=[1, 2], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=11, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=8, indexer_compress_ratio=4, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        eos_token_id=1, bos_token_id=0, pad_token_id=2,
    )  # fmt: skip


def _tiny_qwen4_exp():
    import transformers

    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        return None
    config = transformers.Qwen4ExpTextConfig(**tiny_qwen4_exp_kwargs())
    return lambda: transformers.Qwen4ExpForCausalLM(config), ["q_proj", "v_proj", "in_proj_qkv"]


def build_model(rank: int):
    """(model, LoRA target modules, architecture name): rank 0 real, others on meta."""
    factory = _tiny_qwen4_exp()
    torch.manual_seed(0)
    if factory is None:
        raise RuntimeError("the installed Transformers has no qwen4_exp; stage 2 needs it")
    make, targets = factory
    if rank == 0:
        model = make()
    else:
        with torch.device("meta"):
            model = make()
    return model, targets, type(model).__name__


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.no_grad()
def sample(model, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fixed-length sampling (same number of forwards on every rank, as FSDP needs)."""
    sequences = prompts.repeat_interleave(GROUP, dim=0)
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=sequences).logits[:, -1].float()
        next_token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        sequences = torch.cat([sequences, next_token], dim=1)
    return sequences


def grpo_step(model, optimizer, generator) -> float:
    sequences = sample(model, PROMPTS, generator)
    completions = sequences[:, PROMPTS.shape[1] :]
    rewards = (completions % 2 == 0).float().mean(1)  # verifiable: the share of even token ids
    grouped = rewards.view(-1, GROUP)
    advantages = (
        (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    ).view(-1)
    logits = model(input_ids=sequences).logits[:, PROMPTS.shape[1] - 1 : -1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    loss = -(advantages.unsqueeze(1) * logprobs).mean()  # token-mean
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(rewards.mean())


def run_rank(rank: int, world_size: int, export_dir: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.sharded_init import init_sharded

    stages: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name):
        nonlocal clock
        stages[name] = time.perf_counter() - clock
        clock = time.perf_counter()

    model, targets, architecture = build_model(rank)
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    lap("build+lora")
    report = init_sharded(
        model,
        model.state_dict() if rank == 0 else None,
        mesh=init_device_mesh("cpu", (world_size,)),
    )
    lap("sharded_init")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=5e-2)
    generator = torch.Generator().manual_seed(1234)  # the same samples on every rank
    rewards = [grpo_step(model, optimizer, generator) for _ in range(STEPS)]
    lap("grpo")
    adapters = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().contiguous()
        for n, p in model.named_parameters()
        if "lora_" in n
    }
    path = os.path.join(export_dir, "adapter_model.safetensors")
    if rank == 0:
        save_file(adapters, path)
    dist.barrier()
    lap("export")
    table_ok = all(
        model.get_parameter(fqn).device.type == "cpu" and not model.get_parameter(fqn).requires_grad
        for fqn in report.no_placement_fqns
    )
    return {
        "architecture": architecture,
        "stages": stages,
        "rss_mib": _rss_mib(),
        "rewards": rewards,
        "adapters": len(adapters),
        "adapter_bytes": sum(t.nbytes for t in adapters.values()),
        "export": path if rank == 0 else "",
        "tables": report.no_placement_fqns,
        "inode": report.host_share.inode if report.host_share else 0,
        "table_ok": table_ok,
        "only_lora_trainable": all(
            "lora_" in n for n, p in model.named_parameters() if p.requires_grad
        ),
    }
