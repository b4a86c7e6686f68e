"""fsdp2_ext.checkpoint.model_checkpoint: finding each model tensor's source in a checkpoint directory."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp2_ext.checkpoint.model_checkpoint import ModelCheckpoint
from tests.checkpoint.test_model_checkpoint_load import build, save_qwen2


def test_a_tied_name_the_checkpoint_stores_under_its_alias_is_not_missing(tmp_path):
    """Negative control for new heads: a tied lm_head is the stored embed_tokens, so nothing is
    'missing' and rank 0 initialises nothing (it would cost a full head and break the tie)."""
    path = save_qwen2(str(tmp_path / "qwen2"))
    model = build(path, on_meta=True, lora=False, dtype=torch.float32, keep_adapters=False)
    source = ModelCheckpoint.open(model, path)
    assert "lm_head.weight" not in source.direct and source.missing == []


def test_a_directory_without_safetensors_is_named(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="has no model.safetensors or model.safetensors.index.json"
    ):
        ModelCheckpoint.open(torch.nn.Linear(2, 2), str(tmp_path))


def _save_tiny(directory, **save_kwargs) -> str:
    from fsdp2_ext.testing.tiny_checkpoints import model_class, tiny_config

    torch.manual_seed(0)
    config = tiny_config("qwen2")
    model_class(config)._from_config(config, dtype=torch.bfloat16).save_pretrained(
        directory, **save_kwargs
    )
    return str(directory)


def test_files_are_chosen_as_from_pretrained_chooses_them(tmp_path):
    """model.safetensors first (a variant beside it is not read), the index otherwise, the
    variant only when asked for; the config's transformers_weights overrides."""
    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files

    path = _save_tiny(tmp_path / "m")
    _save_tiny(tmp_path / "m", variant="fp16", max_shard_size="20KB")
    assert checkpoint_files(path) == [f"{path}/model.safetensors"]
    variant = checkpoint_files(path, variant="fp16")
    assert len(variant) > 1 and all(".fp16" not in f or "-of-" in f for f in variant)
    sharded = _save_tiny(tmp_path / "sharded", max_shard_size="20KB")
    assert len(checkpoint_files(sharded)) > 1
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**config, "transformers_weights": "model.safetensors.index.fp16.json"}, f)
    assert checkpoint_files(path) == variant


def test_a_variant_file_beside_the_checkpoint_does_not_fail_the_load(tmp_path):
    path = _save_tiny(tmp_path / "m")
    _save_tiny(tmp_path / "m", variant="fp16")
    model = build(path, on_meta=True, lora=False, dtype=torch.bfloat16, keep_adapters=False)
    source = ModelCheckpoint.open(model, path)  # was: "tensor ... is in both"
    assert source.missing == [] and source.files == [f"{path}/model.safetensors"]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"weight_map": ["model-00001-of-00002.safetensors"]}, "'weight_map' must be an object"),
        ({"metadata": {}}, "it has no 'weight_map' object"),
        ({"weight_map": {"a.weight": 3}}, "'weight_map'['a.weight'] must be a file name"),
        ({"weight_map": {"a.weight": "../elsewhere.safetensors"}}, "must be a file name"),
        ({"weight_map": {"a.weight": "gone.safetensors"}}, "names files that do not exist"),
        ("{not json", "invalid JSON"),
    ],
)
def test_a_malformed_index_is_a_value_error_naming_file_and_field(tmp_path, index, message):
    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files

    path = tmp_path / "model.safetensors.index.json"
    path.write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(ValueError, match="model.safetensors.index.json") as caught:
        checkpoint_files(str(tmp_path))
    assert message in str(caught.value)


def test_a_directory_with_only_other_weights_names_what_it_holds(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin") as caught:
        ModelCheckpoint.open(torch.nn.Linear(2, 2), str(tmp_path))
    assert "model.safetensors" in str(caught.value)


def test_a_tied_config_whose_checkpoint_stores_another_head_is_untied_with_the_warning(
    tmp_path, caplog
):
    """As from_pretrained: both names stored with different values -> not tied, warned."""
    import transformers

    from fsdp2_ext.testing.tiny_checkpoints import tiny_config

    config = tiny_config("qwen2")
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "tie_word_embeddings": True})
    )
    reference = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path)
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight
    model = build(str(tmp_path), on_meta=True, lora=False, dtype=torch.float32, keep_adapters=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied from the config
    source = ModelCheckpoint.open(model, str(tmp_path))
    with caplog.at_level("WARNING", logger="fsdp2_ext"):
        assert source.apply_ties(model) == [("lm_head.weight", "model.embed_tokens.weight")]
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.is_meta and "lm_head.weight" not in model.all_tied_weights_keys
    assert any("so we will NOT tie them" in r.getMessage() for r in caplog.records)
    assert source.missing == []


def test_the_fingerprint_samples_a_file_larger_than_its_samples_as_its_note_says(tmp_path):
    """[Note: checkpoint fingerprint] on a file of 4 MiB of data, 64 times its 16 samples of 4 KiB
    (the distributed test's tiny checkpoint fits in its samples, so it never reaches the
    sampling): a byte changed inside any sampled page changes the fingerprint; a byte changed
    between samples does not (the Note's stated limit, held here so that it stays the claim); a
    changed header or size always does."""
    from safetensors.torch import save_file

    from fsdp2_ext.checkpoint.model_checkpoint import (
        _FINGERPRINT_SAMPLE_BYTES,
        _FINGERPRINT_SAMPLES,
        checkpoint_fingerprint,
    )

    path = str(tmp_path / "model.safetensors")
    save_file({"w": torch.arange(1 << 20, dtype=torch.int32)}, path, {"format": "pt"})
    with open(path, "rb") as f:
        original = f.read()
    data_begin = 8 + int.from_bytes(original[:8], "little")
    data_bytes = len(original) - data_begin
    assert (
        data_bytes == 4 << 20 and data_bytes > 16 * _FINGERPRINT_SAMPLES * _FINGERPRINT_SAMPLE_BYTES
    )
    before = checkpoint_fingerprint([path])

    def changed_at(offset: int) -> str:
        edited = bytearray(original)
        edited[offset] ^= 0xFF
        with open(path, "wb") as f:
            f.write(edited)
        try:
            return checkpoint_fingerprint([path])
        finally:
            with open(path, "wb") as f:
                f.write(original)

    sampled = [data_begin + data_bytes * i // _FINGERPRINT_SAMPLES for i in range(16)]
    for begin in sampled:  # the first and the last byte of every sampled page
        assert changed_at(begin) != before, begin
        assert changed_at(begin + _FINGERPRINT_SAMPLE_BYTES - 1) != before, begin
    between = sampled[5] + _FINGERPRINT_SAMPLE_BYTES + 1000  # in no sample
    assert changed_at(between) == before
    assert changed_at(10) != before  # the header
    assert checkpoint_fingerprint([path]) == before
