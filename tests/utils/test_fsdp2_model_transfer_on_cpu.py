"""No-placement parameters stay on CPU, as the same objects, through every transfer helper."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp2_ext.model import no_placement
from fsdp2_ext.model.no_placement import (
    detached_no_placement_params,
    find_no_placement_params,
    ignored_params,
    offload,
    onload,
    register_no_placement_params,
    to_device,
)
from tests.special_distributed.test_fsdp2_full_state_load import module_to_forbidden


class _NoPlacementModel(nn.Module):
    _no_placement_params = ["large.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.large = nn.Embedding(64, 4).requires_grad_(False)
        self.small = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 2).requires_grad_(False)
        self.proj = nn.Linear(2, 2)


class _LayeredModel(nn.Module):
    _no_placement_params = ["table.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))


def test_registration_finds_the_parameter():
    model = _NoPlacementModel()
    (registration,) = find_no_placement_params(model)
    assert registration.module is model.large
    assert registration.name == "weight"
    assert registration.param is model.large.weight
    assert registration.fqn == "large.weight"
    assert ignored_params(model) == {model.large.weight}


def test_param_is_none_while_detached_and_the_same_object_after():
    model = _NoPlacementModel()
    table = model.large.weight
    register_no_placement_params(model)
    with detached_no_placement_params(model):
        assert model.large.weight is None
        assert "large.weight" not in dict(model.named_parameters())
    assert model.large.weight is table


def test_restored_even_when_the_block_raises():
    model = _NoPlacementModel()
    table = model.large.weight
    with pytest.raises(RuntimeError, match="boom"), detached_no_placement_params(model):
        raise RuntimeError("boom")
    assert model.large.weight is table


@pytest.mark.parametrize("helper", ["to_device", "offload", "onload"])
def test_transfers_move_everything_else_and_never_call_module_to(helper):
    model = _NoPlacementModel()
    table = model.large.weight
    values = table.detach().clone()
    register_no_placement_params(model)
    with module_to_forbidden():
        if helper == "to_device":
            # meta stands in for an accelerator here: everything else must really move.
            to_device(model, "meta")
            assert model.small.weight.is_meta and model.scale.is_meta
        elif helper == "offload":
            offload(model)
        else:
            onload(model, "cpu")
    assert model.large.weight is table
    assert table.device.type == "cpu" and torch.equal(table, values)


def test_trainable_no_placement_param_cannot_train():
    model = _NoPlacementModel()
    model.large.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="cannot train") as error:
        find_no_placement_params(model)
    assert "large.weight" in str(error.value)


def test_suffix_matching_nothing_registers_nothing_and_says_so(caplog):
    """A class declares its tables for every config; a model built without them (qwen4_exp with
    no PLE layers) has none, as Transformers treats it: no error, one INFO line naming it."""

    class WithoutTable(_NoPlacementModel):
        _no_placement_params = ["missing.weight"]

    with caplog.at_level("INFO", logger="fsdp2_ext"):
        assert register_no_placement_params(WithoutTable()) == []
    said = [r.getMessage() for r in caplog.records]
    assert any("WithoutTable._no_placement_params entry 'missing.weight'" in m for m in said)


def test_a_malformed_suffix_names_it_and_the_class():
    class Broken(_NoPlacementModel):
        _no_placement_params = [".weight"]

    with pytest.raises(ValueError) as error:
        find_no_placement_params(Broken())
    assert "Broken._no_placement_params" in str(error.value) and "'.weight'" in str(error.value)


def test_suffix_matching_several_registers_each():
    model = _LayeredModel()
    registrations = find_no_placement_params(model)
    assert [r.fqn for r in registrations] == [f"layers.{i}.table.weight" for i in range(3)]
    assert len(ignored_params(model)) == 3


def test_stale_registration_is_an_error():
    model = _NoPlacementModel()
    register_no_placement_params(model)
    model.large.weight = nn.Parameter(torch.zeros(64, 4), requires_grad=False)
    with pytest.raises(RuntimeError, match="re-register"), detached_no_placement_params(model):
        pass


def test_stale_registration_detaches_nothing():
    model = _LayeredModel()
    registrations = register_no_placement_params(model)
    model.layers[2].table.weight = nn.Parameter(torch.zeros(8, 2), requires_grad=False)
    with pytest.raises(RuntimeError, match="re-register"), detached_no_placement_params(model):
        pass
    assert model.layers[0].table.weight is registrations[0].param  # still attached


def test_fully_shard_ignores_it_and_transfers_keep_it(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _NoPlacementModel()
        table = model.large.weight
        register_no_placement_params(model)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)), ignored_params=ignored_params(model))
        assert model.large.weight is table and type(table.data) is torch.Tensor
        assert hasattr(model.small.weight, "full_tensor")  # sharded (DTensor)
        with module_to_forbidden():
            offload(model)
            onload(model, "cpu")
        assert model.large.weight is table and table.device.type == "cpu"
        assert no_placement.no_placement_params(model)[0].param is table
    finally:
        dist.destroy_process_group()
