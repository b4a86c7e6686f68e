"""The compiled module shares torch's pybind11 internals: Tensors and ProcessGroups cross into C++."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp2_ext
from fsdp2_ext import _fsdp2_ext
from fsdp2_ext.testing.spawn import run_distributed


def test_built_against_the_imported_torch():
    assert _fsdp2_ext.__torch_version__ == torch.__version__
    assert fsdp2_ext.__version__


def test_tensor_and_process_group_reach_cpp(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        # A collective issued from C++ on the Python ProcessGroup object.
        assert _fsdp2_ext.agree_on_verdict(group, "bad", torch.device("cpu")) == "bad"
        assert _fsdp2_ext.agree_on_verdict(group, "", torch.device("cpu")) == ""
        table = torch.arange(10, dtype=torch.bfloat16)
        assert _fsdp2_ext.broadcast_in_chunks(group, table, chunk_bytes=4) == 20
        # Tensors by identity.
        a, b = torch.zeros(2), torch.zeros(2)
        assert _fsdp2_ext.group_by_identity(["x", "y", "z"], [a, b, a]) == [["x", "z"], ["y"]]
    finally:
        dist.destroy_process_group()


def _verdict_worker(rank, world_size):
    verdict = _fsdp2_ext.agree_on_verdict(
        dist.group.WORLD, "rank 1 is unhappy" if rank == 1 else "", torch.device("cpu")
    )
    assert verdict.endswith("rank 1 is unhappy")
    assert ("(reported by rank 1)" in verdict) == (rank != 1)
    table = torch.arange(1000, dtype=torch.float32) if rank == 0 else torch.empty(1000)
    _fsdp2_ext.broadcast_in_chunks(dist.group.WORLD, table, chunk_bytes=1000)
    assert torch.equal(table, torch.arange(1000, dtype=torch.float32))


def test_verdict_and_chunked_broadcast_on_two_ranks():
    run_distributed(2, _verdict_worker, timeout_s=120)


def test_a_group_given_as_none_is_refused_not_dereferenced():
    """Outside torch.distributed (VERL's checkpoint-manager tests run so) ``dist.group.WORLD`` is
    None; the collectives refuse it by name. Before, the null group was dereferenced: a segfault
    in VERL's own test_load_lora_only_checkpoint_merges under the shim."""
    import torch

    from fsdp2_ext import _fsdp2_ext

    cpu = torch.device("cpu")
    for call in (
        lambda: _fsdp2_ext.agree_on_verdict(None, "", cpu),
        lambda: _fsdp2_ext.figure_range(None, [1], stage="x"),
        lambda: _fsdp2_ext.bounded_first_collective(None, cpu),
        lambda: _fsdp2_ext.broadcast_in_chunks(None, torch.zeros(4), chunk_bytes=4),
        lambda: _fsdp2_ext.transport_device(None, cpu),
    ):
        with pytest.raises(ValueError, match="group is None: initialise torch.distributed"):
            call()
