"""What our results are compared against: PyTorch's own full-state load, and exact equality."""

from __future__ import annotations

import torch
from torch import nn

from fsdp2_ext.model.wrap_targets import select_wrap_targets


def load_like_verl_today(
    model: nn.Module, full_state: dict | None, mesh, rank: int, *, tied: bool | None = None
) -> None:
    """The baseline: ``fully_shard`` a meta model, allocate it, then
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (what VERL's
    ``fsdp2_load_full_state_dict`` does). ``full_state`` is read on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    for module in select_wrap_targets(model, tied=tied):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    set_model_state_dict(
        model,
        full_state if rank == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )


def assert_states_equal(actual: dict, expected: dict, what: str) -> None:
    """The same keys, and every tensor equal bit for bit (atol=0, rtol=0)."""
    assert actual.keys() == expected.keys(), what
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=0, rtol=0, msg=f"{what}: {name}"
        )
