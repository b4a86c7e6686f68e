"""The FSDP2 internals the sharded init relies on are present, and a torch without one of them
is refused at import, naming the version and the member ([Note: FSDP2 internals])."""

from __future__ import annotations

import pytest
import torch

from fsdp2_ext.common import fsdp2_internals


def test_this_torch_has_every_internal():
    assert fsdp2_internals.missing_members() == []


def test_a_missing_internal_is_named_with_the_torch_version(monkeypatch):
    key = ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam")
    members = fsdp2_internals.REQUIRED[key]
    monkeypatch.setitem(fsdp2_internals.REQUIRED, key, members + ("no_such_method", "_no_such"))
    with pytest.raises(ImportError) as raised:
        fsdp2_internals.check()
    message = str(raised.value)
    assert torch.__version__ in message
    assert "FSDPParam.no_such_method" in message and "FSDPParam._no_such" in message
    assert "FSDPParam._sharded_param_data" not in message


def test_the_sharded_init_uses_the_named_internals():
    from fsdp2_ext.init import sharded_init

    assert sharded_init.fsdp_params_by_fqn is fsdp2_internals.fsdp_params_by_fqn
    assert sharded_init.adopt_padded_shard is fsdp2_internals.adopt_padded_shard
