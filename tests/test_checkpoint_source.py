"""fsdp2_ext.checkpoint_source: finding each model tensor's source in a checkpoint directory."""

from __future__ import annotations

import pytest
import torch

from fsdp2_ext.checkpoint_source import CheckpointSource
from test_checkpoint_load import build, save_qwen2


def test_a_tied_name_the_checkpoint_stores_under_its_alias_is_not_missing(tmp_path):
    """Negative control for new heads: a tied lm_head is the stored embed_tokens, so nothing is
    'missing' and rank 0 initialises nothing (it would cost a full head and break the tie)."""
    path = save_qwen2(str(tmp_path / "qwen2"))
    model = build(path, on_meta=True, lora=False, dtype=torch.float32, keep_adapters=False)
    source = CheckpointSource.open(model, path)
    assert "lm_head.weight" not in source.direct and source.missing == []


def test_a_directory_without_safetensors_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no \\*.safetensors"):
        CheckpointSource.open(torch.nn.Linear(2, 2), str(tmp_path))
