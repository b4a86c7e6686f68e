"""The real Transformers `qwen4_exp` class: its `_no_placement_params` handled on a tiny config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp2_ext.model.no_placement import (
    find_no_placement_params,
    register_no_placement_params,
    to_device,
)
from fsdp2_ext.testing.tiny_models import tiny_qwen4_exp_kwargs as tiny_text_kwargs

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen4ExpTextConfig"):
    pytest.skip("the installed Transformers has no qwen4_exp", allow_module_level=True)

SUFFIX = "ple.ple_embedding.ngram_embedding.weight"


def tiny_causal_lm():
    torch.manual_seed(0)
    return transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**tiny_text_kwargs()))


def freeze_tables(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if name.endswith(SUFFIX):
            param.requires_grad_(False)


def test_real_class_declares_the_table():
    assert transformers.Qwen4ExpForCausalLM._no_placement_params == [SUFFIX]


def test_unfrozen_table_cannot_train():
    with pytest.raises(ValueError, match="cannot train"):
        find_no_placement_params(tiny_causal_lm())


def test_tables_found_in_every_ple_layer():
    model = tiny_causal_lm()
    freeze_tables(model)
    registrations = find_no_placement_params(model)
    assert [r.fqn for r in registrations] == [f"model.layers.{i}.{SUFFIX}" for i in (0, 1)]
    assert all(r.param is model.get_parameter(r.fqn) for r in registrations)


def test_conditional_generation_vision_tower_inherits_without_error():
    config = transformers.Qwen4ExpConfig(
        text_config=tiny_text_kwargs(),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=32,
            num_position_embeddings=16,
        ),
        image_token_id=120,
        video_token_id=121,
        vision_start_token_id=122,
        vision_end_token_id=123,
    )
    model = transformers.Qwen4ExpForConditionalGeneration(config)
    freeze_tables(model)
    fqns = [r.fqn for r in find_no_placement_params(model)]
    assert fqns == [f"model.language_model.layers.{i}.{SUFFIX}" for i in (0, 1)]


def test_tables_stay_on_cpu_when_the_model_moves():
    model = tiny_causal_lm().eval()
    freeze_tables(model)
    registrations = register_no_placement_params(model)
    ids = torch.tensor([[0, 5, 7, 9, 1, 11]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    to_device(model, "meta")
    assert all(
        r.param.device.type == "cpu" and r.param is model.get_parameter(r.fqn)
        for r in registrations
    )
    assert model.lm_head.weight.is_meta
    # The tables still hold exactly what they held before the move.
    reference = tiny_causal_lm()
    for registration in registrations:
        assert torch.equal(registration.param, reference.get_parameter(registration.fqn))
    assert torch.isfinite(expected).all()
