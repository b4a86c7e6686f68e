"""Tiny models with every part of the real ones, for tests, benchmarks, the demo and the toy run.

- ``ToyModel``: a decoder-shaped toy with everything the library handles (an nn.Embedding nested
  in each wrapped block, a frozen no-placement table, a parameter with fewer rows than ranks, a
  bf16 unit beside fp32 ones, a non-persistent bf16 buffer); ``build_toy(rank)`` builds it as a
  rank-0 load starts (rank 0 on the CPU, meta elsewhere) beside a CPU reference;
- ``tiny_qwen2_config`` / ``build_qwen2`` / ``save_tiny_qwen2``: a tiny (tied) Qwen2;
- ``tiny_qwen4_exp_kwargs`` / ``save_tiny_qwen4_exp``: the smallest qwen4_exp with every part;
- ``save_tiny_qwen3``: a tiny dense Qwen3 that vLLM's CPU build serves with LoRA (its vLLM class
  has a weights mapper, as Qwen4Exp's has; head_dim 32, which vLLM's CPU attention supports);
- ``save_tiny_tokenizer``: a character-level tokenizer for the toy run.
"""

from __future__ import annotations

import string

import torch
from torch import nn

__all__ = [
    "DIGITS",
    "TOY_DIM",
    "TOY_VOCAB",
    "Block",
    "ToyModel",
    "build_qwen2",
    "build_toy",
    "save_resume_model",
    "save_tiny_qwen2",
    "save_tiny_qwen3",
    "save_tiny_qwen4_exp",
    "save_tiny_tokenizer",
    "tiny_qwen2_config",
    "tiny_qwen4_exp_kwargs",
]

DIGITS = "0123456789"
TOY_VOCAB, TOY_DIM = 37, 10  # 37 rows: uneven over 2 and 4 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Embedding(TOY_VOCAB, TOY_DIM)  # nested embedding inside a wrapped block
        self.proj = nn.Linear(TOY_DIM, TOY_DIM)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(hidden) + self.inner(ids))


class ToyModel(nn.Module):
    _no_split_modules = ["Block"]
    _no_placement_params = ["frozen.weight"]

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(TOY_VOCAB, TOY_DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.frozen = nn.Embedding(3 * TOY_VOCAB, TOY_DIM).requires_grad_(False)
        self.gate = nn.Parameter(torch.randn(1, TOY_DIM))  # dim0 < world size
        self.lm_head = nn.Linear(TOY_DIM, TOY_VOCAB)  # 1-D bias of 37; its own unit (by name)
        self.lm_head.to(torch.bfloat16)  # bf16 unit beside fp32 ones
        self.register_buffer(
            "scale", torch.linspace(0.5, 1.5, TOY_DIM, dtype=torch.bfloat16), persistent=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        table = self.frozen(ids.to(self.frozen.weight.device)).to(hidden.device)
        hidden = hidden + table * self.gate
        for layer in self.layers:
            hidden = layer(hidden, ids)
        return self.lm_head((hidden * self.scale.to(hidden.dtype)).to(torch.bfloat16)).float()


def build_toy(rank: int) -> tuple[ToyModel, ToyModel]:
    """(reference on CPU, model to shard: the reference itself on rank 0, meta elsewhere)."""
    torch.manual_seed(1234)
    reference = ToyModel()
    if rank == 0:
        model = ToyModel()
        model.load_state_dict(reference.state_dict())
    else:
        with torch.device("meta"):
            model = ToyModel()
    return reference, model


def tiny_qwen2_config(tied: bool = True):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=64,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )


def build_qwen2(rank: int, tied: bool = True):
    """(bf16 reference on CPU, model to shard: a copy on rank 0, meta elsewhere)."""
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(tied)
    torch.manual_seed(0)
    reference = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if rank == 0:
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.load_state_dict(reference.state_dict())
        model.tie_weights()
    else:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return reference, model


def save_tiny_qwen2(directory: str, *, tied: bool = True) -> str:
    """A tiny Qwen2 checkpoint written with save_pretrained (bf16 weights, fixed seed)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_qwen2_config(tied)).to(torch.bfloat16).save_pretrained(directory)
    return directory


def save_tiny_qwen4_exp(directory: str, dtype: torch.dtype | None = None, **overrides) -> str:
    """A tiny qwen4_exp (n-gram PLE tables included) written with save_pretrained."""
    import transformers

    config = transformers.Qwen4ExpTextConfig(**{**tiny_qwen4_exp_kwargs(), **overrides})
    torch.manual_seed(0)
    model = transformers.Qwen4ExpForCausalLM(config)
    (model.to(dtype) if dtype is not None else model).save_pretrained(directory)
    return directory


def save_resume_model(kind: str, directory: str, *, kv_heads: int = 2, hidden: int = 32) -> str:
    """The resume tests' models: odd row counts, so that ranks' shards differ in size.
    ``qwen4_exp``: the tiny qwen4_exp with a shared expert of 17; else a tied Qwen2 with vocab 129,
    intermediate 37, ``kv_heads`` k/v heads of ``hidden / 4`` (1 head of 6: 6 rows, at 4 ranks
    2, 2, 2 and an empty shard)."""
    import transformers

    torch.manual_seed(0)
    if kind == "qwen4_exp":
        config = transformers.Qwen4ExpTextConfig(
            **{**tiny_qwen4_exp_kwargs(), "shared_expert_intermediate_size": 17}
        )
        transformers.Qwen4ExpForCausalLM(config).save_pretrained(directory)
    else:
        config = transformers.Qwen2Config(
            vocab_size=129, hidden_size=hidden, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=True,
        )  # fmt: skip
        transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


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


def save_tiny_qwen3(directory: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """A tiny dense Qwen3 (2 layers, GQA 4/2, untied) and its tokenizer, saved in ``directory``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).to(dtype).save_pretrained(directory)
    save_tiny_tokenizer(directory, config.vocab_size)
    return directory


def save_tiny_tokenizer(directory: str, vocab_size: int = 128) -> None:
    """A character-level tokenizer with exactly ``vocab_size`` ids (every id the model can sample
    decodes) and a plain chat template, saved with ``save_pretrained``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    chars = list(DIGITS + string.ascii_letters + string.punctuation + " ")
    chars += [chr(0x100 + i) for i in range(vocab_size - len(specials) - len(chars))]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    tokenizer.save_pretrained(directory)
