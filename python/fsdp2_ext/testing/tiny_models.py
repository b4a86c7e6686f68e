"""Tiny models with every part of the real ones, for tests, benchmarks and the toy run."""

from __future__ import annotations

import string

__all__ = ["DIGITS", "save_tiny_tokenizer", "tiny_qwen4_exp_kwargs"]

DIGITS = "0123456789"


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
