"""fsdp2_ext.init.meta_build: the model ``from_pretrained`` builds, on meta, without reading a tensor.

The matrix (``test_model_checkpoint_matrix``) loads every model type built this way and compares
it with ``from_pretrained``; here, what a build must reproduce that no loaded value carries: the
dtype plan, the buffers ``from_pretrained`` initialises after a load, the mode, the generation
config, the caller's config left alone, and that no tensor is read.
"""

from __future__ import annotations

import gc

import torch
import transformers
from torch import nn

from fsdp2_ext.init.meta_build import build_on_meta
from fsdp2_ext.testing.tiny_models import tiny_qwen2_config


class _Qwen2WithPlanAndBuffer(transformers.Qwen2ForCausalLM):
    """A Qwen2 whose ``down_proj`` only the dtype plan keeps in fp32, and with a non-persistent
    buffer that ``_init_weights`` (not the constructor) gives its value."""

    _keep_in_fp32_modules_strict = ["mlp.down_proj"]

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("scale", torch.zeros(4), persistent=False)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            transformers.initialization.ones_(self.scale)


def _save(directory) -> str:
    torch.manual_seed(0)
    config = tiny_qwen2_config(False)
    model = _Qwen2WithPlanAndBuffer(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    generation = transformers.GenerationConfig(max_new_tokens=7, temperature=0.3, do_sample=True)
    generation.save_pretrained(directory)  # after the model's own
    return str(directory)


def test_the_build_is_from_pretrained_without_values(tmp_path, monkeypatch):
    path = _save(tmp_path / "m")
    reference = _Qwen2WithPlanAndBuffer.from_pretrained(path, dtype=torch.bfloat16)
    config = transformers.AutoConfig.from_pretrained(path)
    before = config.to_dict()

    import safetensors

    read = []
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: read.append(a))
    model = build_on_meta(_Qwen2WithPlanAndBuffer, path, config=config, dtype=torch.bfloat16)

    assert read == []  # no checkpoint tensor read
    assert config.to_dict() == before and model.config is not config  # copied, as from_pretrained
    ours = dict(model.named_parameters())
    theirs = dict(reference.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert all(p.is_meta for p in ours.values())
    dtypes = {n: p.dtype for n, p in ours.items()}
    assert dtypes == {n: p.dtype for n, p in theirs.items()}
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.float32  # the dtype plan
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    assert torch.equal(model.scale, torch.ones(4))  # initialised as after a load
    assert model.training is reference.training is False
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()
    assert model.generation_config.max_new_tokens == 7


def test_an_auto_class_resolves_as_from_pretrained(tmp_path):
    from fsdp2_ext.testing.tiny_models import save_tiny_qwen2

    path = save_tiny_qwen2(str(tmp_path / "q"), tied=True)
    model = build_on_meta(transformers.AutoModelForCausalLM, path, dtype="bfloat16")
    assert type(model) is transformers.Qwen2ForCausalLM
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.is_meta
    assert model.dtype == torch.bfloat16


def test_the_shim_builds_on_meta_only_for_the_call_it_reproduces(tmp_path, caplog):
    """VERL's ``auto_class.from_pretrained(path, torch_dtype=, config=, trust_remote_code=)`` in a
    checkpoint build reads nothing; a call with more keywords is Transformers' own, announced."""
    import logging

    from fsdp2_ext.testing.tiny_models import save_tiny_qwen2
    from fsdp2_ext.verl.engine import _AutoClassBuildingOnMeta

    path = save_tiny_qwen2(str(tmp_path / "q"), tied=False)
    auto = _AutoClassBuildingOnMeta(transformers.AutoModelForCausalLM)
    config = transformers.AutoConfig.from_pretrained(path)
    model = auto.from_pretrained(path, torch_dtype=torch.bfloat16, config=config)
    assert all(p.is_meta for p in model.parameters())
    with caplog.at_level(logging.WARNING, logger="fsdp2_ext"):
        model = auto.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="eager")
    assert not any(p.is_meta for p in model.parameters())  # read, as Transformers reads it
    assert "['attn_implementation']): not reproduced on meta" in caplog.text
    assert auto.__name__ == "AutoModelForCausalLM"  # everything else is the auto class's


def test_no_automatic_collection_during_the_build(tmp_path):
    """[Note: the collector paused during an init]: thresholds that make every allocation trip a
    collection, yet none starts inside the build, and the collector is on again afterwards."""
    from fsdp2_ext.testing.gc_watch import collections_inside

    path = _save(tmp_path / "m")
    with collections_inside(build_on_meta) as collections:
        build_on_meta(transformers.AutoModelForCausalLM, path, dtype=torch.bfloat16)
    assert not collections, f"{len(collections)} collections in the build: {collections[:4]}"
    assert gc.isenabled()
