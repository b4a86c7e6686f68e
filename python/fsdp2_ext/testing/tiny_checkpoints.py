"""Tiny random checkpoints of the model types the installed Transformers converts on load.

    for model_type in conversion_model_types():
        path = write_tiny_checkpoint(model_type, f"/tmp/ckpt/{model_type}")

``conversion_model_types`` reads the installed Transformers' conversion mapping (no list kept
here), ``tiny_config`` shrinks a model type's default config by the sizes in ``TINY_SIZES`` (every
sub-config too), and ``write_tiny_checkpoint`` builds it on the CPU, gives every tensor its own
values and writes it with ``save_pretrained`` in shards with an index: the checkpoint is in the
stored (unconverted) layout, as the model type's real checkpoints are, so ``from_pretrained``
runs the conversions on it. A model type that does not build tiny raises ``NotTiny`` with why.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "TINY_SIZES",
    "NotTiny",
    "conversion_model_types",
    "model_class",
    "tiny_config",
    "write_tiny_checkpoint",
]

# Upper bounds for the size fields of any config (a field is lowered to its bound, never raised).
TINY_SIZES = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_layers": 2,
    "n_layer": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 128, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 256, "n_embd": 32, "d_model": 32, "ffn_dim": 64,
    "encoder_layers": 2, "decoder_layers": 2, "depth": 2, "embed_dim": 32, "kv_lora_rank": 16,
    "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "image_size": 32, "patch_size": 8, "projection_dim": 32, "text_hidden_size": 32,
    "vision_hidden_size": 32, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
}  # fmt: skip
MAX_PARAMETERS = 20_000_000


class NotTiny(Exception):
    """The model type does not build as a tiny model from its default config."""


def conversion_model_types() -> list[str]:
    """Model types that the installed Transformers' conversion mapping names (directly, or
    through a model class it names)."""
    from transformers import conversion_mapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    names = conversion_mapping._build_checkpoint_conversion_mapping()
    return sorted(name for name in names if name in CONFIG_MAPPING)


_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "depth")
_DERIVED = ("transformers_version", "architectures", "out_features", "out_indices",
            "per_layer_config")  # fmt: skip


def _shrink(values: dict, parent_layers: int | None = None) -> dict:
    """``values`` with every size field lowered to ``TINY_SIZES``; what depends on the layer
    count or the head size (per-layer lists, feature-layer indices, mRoPE sections) follows."""
    layers = {values[k]: min(values[k], TINY_SIZES[k]) for k in _LAYER_COUNTS
              if isinstance(values.get(k), int) and not isinstance(values[k], bool)}  # fmt: skip
    new_layers = min(layers.values(), default=parent_layers or TINY_SIZES["num_hidden_layers"])
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            out[key] = _shrink(value, new_layers)
        elif key in TINY_SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, TINY_SIZES[key])
        elif key.endswith("layer_types") or key in _DERIVED:
            continue  # derived again from the layer count
        elif isinstance(value, list) and len(value) in layers and len(value) > 1:
            out[key] = value[: layers[len(value)]]  # one entry per layer
        else:
            out[key] = value
    for key, value in list(out.items()):
        if "feature_layer" in key and new_layers and isinstance(value, int | list):
            indices = value if isinstance(value, list) else [value]
            clamped = [-1 - (i % new_layers) for i, _ in enumerate(indices)]
            out[key] = clamped if isinstance(value, list) else clamped[0]
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and heads == kv_heads:
        out["num_key_value_heads"] = out["num_attention_heads"]
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        head_dim = out.get("head_dim") or out.get("hidden_size", 32) // out.get(
            "num_attention_heads", 4
        )
        sections = len(rope["mrope_section"])
        half = head_dim // 2
        rope = dict(rope, mrope_section=[half // sections] * (sections - 1)
                    + [half - half // sections * (sections - 1)])  # fmt: skip
        out["rope_parameters"] = rope
    vocab = out.get("vocab_size")
    for key, value in list(out.items()):
        token_id = key.endswith("token_id") or key == "padding_idx"
        if vocab and token_id and isinstance(value, int) and value >= vocab:
            out[key] = vocab - 1
    return out


def tiny_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    try:
        return config_class(**_shrink(config_class().to_dict()))
    except Exception as error:
        raise NotTiny(f"{model_type}: config: {type(error).__name__}: {error}") from error


def model_class(config):
    """The class a causal-LM or VLM trainer would load (else the base model)."""
    from transformers.models.auto import modeling_auto

    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        modeling_auto.MODEL_MAPPING,
    ):
        try:
            return mapping[type(config)]
        except KeyError:
            continue
    raise NotTiny(f"{config.model_type}: no model class for {type(config).__name__}")


def _distinct_values(model: torch.nn.Module, seed: int) -> None:
    """Every floating tensor its own values (a swap of two same-shape tensors is visible)."""
    generator = torch.Generator().manual_seed(seed)
    seen = set()
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if id(tensor) in seen or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            tensor.copy_(values * 0.1 + len(seen) * 1e-3)


def write_tiny_checkpoint(
    model_type: str,
    directory: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    shards: int = 3,
    config=None,
) -> str:
    """A tiny random ``model_type`` checkpoint in ``directory`` (``save_pretrained``, about
    ``shards`` files with an index). Raises ``NotTiny`` when it does not build small."""
    config = config if config is not None else tiny_config(model_type)
    cls = model_class(config)
    try:
        torch.manual_seed(seed)
        model = cls._from_config(config, dtype=dtype)
    except Exception as error:
        raise NotTiny(f"{model_type}: {cls.__name__}: {type(error).__name__}: {error}") from error
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise NotTiny(f"{model_type}: {count:,} parameters even tiny")
    _distinct_values(model, seed)
    total = sum(t.nbytes for t in model.state_dict().values())
    shard_bytes = max(1, math.ceil(total / shards))
    try:
        model.save_pretrained(directory, max_shard_size=shard_bytes)
    except Exception as error:
        raise NotTiny(f"{model_type}: save_pretrained: {type(error).__name__}: {error}") from error
    if not os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        raise NotTiny(f"{model_type}: save_pretrained wrote no index (one tensor holds it all)")
    return directory
