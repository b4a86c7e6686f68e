"""init_sharded on spawned Gloo ranks: the spec's torchrun command (docs/SPEC.md), 4 ranks, the
local source, bit equality with torch's own loader, bad inputs on every rank, and the negative
control."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp2_ext.init.sharded_init import init_sharded
from fsdp2_ext.testing.compare import load_like_verl_today
from fsdp2_ext.testing.spawn import run_distributed
from fsdp2_ext.testing.tiny_models import build_qwen2, build_toy
from tests.special_distributed import test_fsdp2_full_state_load as checks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_spec_torchrun_command():
    """The spec's exact command, from the repo root."""
    env = dict(os.environ, PYTHONPATH=".")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "tests/special_distributed/test_fsdp2_full_state_load.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert "full-state load checks passed on 2 ranks" in result.stdout


def _toy(rank, world_size, source):
    checks.check_toy_model(rank, world_size, source=source)


def test_toy_model_four_ranks():
    run_distributed(4, _toy, "rank0")


def test_toy_model_local_source():
    run_distributed(2, _toy, "local")


def _tied_qwen2_four(rank, world_size):
    checks.check_tied_qwen2(rank, world_size)


@pytest.mark.slow
def test_tied_qwen2_four_ranks():
    run_distributed(4, _tied_qwen2_four)


def _equal_to_torch_loader(rank, world_size):
    """Our local shards == set_model_state_dict(full_state_dict, broadcast_from_rank0), bit for bit."""
    reference, ours = build_qwen2(rank, tied=False)
    _, theirs = build_qwen2(rank, tied=False)
    full_state = {k: v.clone() for k, v in reference.state_dict().items()}
    mesh = init_device_mesh("cpu", (world_size,))
    init_sharded(ours, full_state if rank == 0 else None, mesh=mesh)
    theirs.to_empty(device="meta")
    load_like_verl_today(theirs, full_state, mesh, rank)
    their_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        mine, other = param.to_local(), their_params[name].to_local()
        assert mine.shape == other.shape and mine.dtype == other.dtype, name
        assert torch.equal(mine.view(torch.uint8), other.view(torch.uint8)), name
    dist.barrier()


def test_shards_equal_torch_set_model_state_dict():
    run_distributed(2, _equal_to_torch_loader)


def _bad_input(rank, world_size, case):
    reference, model = build_toy(rank)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    if case == "missing":
        del state["layers.1.proj.weight"]
    elif case == "shape":
        state["embed.weight"] = torch.zeros(5, 3)
    elif case == "dtype":
        state["lm_head.bias"] = state["lm_head.bias"].double()
    elif case == "unexpected":
        state["not.a.param"] = torch.zeros(1)
    elif case == "meta":  # e.g. state_dict() of a model that is itself on meta
        state["layers.0.proj.bias"] = torch.empty(10, device="meta")
    mesh = init_device_mesh("cpu", (world_size,))
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        init_sharded(model, state if rank == 0 else None, mesh=mesh)
    assert time.monotonic() - start < 30
    expected = {
        "missing": "missing keys: layers.1.proj.weight",
        "shape": "embed.weight (5, 3) vs model (37, 10)",
        "dtype": "lm_head.bias Double vs model BFloat16",
        "unexpected": "unexpected keys: not.a.param",
        "meta": "tensors not on the CPU: layers.0.proj.bias (meta)",
    }[case]
    assert expected in str(error.value), str(error.value)
    if rank != 0:
        assert "(reported by rank 0)" in str(error.value)
    dist.barrier()  # every rank is still in step after the error


@pytest.mark.parametrize("case", ["missing", "shape", "dtype", "unexpected", "meta"])
def test_bad_full_state_fails_on_every_rank(case):
    run_distributed(2, _bad_input, case, timeout_s=120)


def test_negative_control_plain_assign_load_breaks_tie():
    mismatches = checks.check_negative_control(0, 1)
    assert mismatches > 0  # the spec (docs/SPEC.md) saw 489/512


def _from_safetensors(rank, world_size, directory):
    from fsdp2_ext.checkpoint.safetensors_source import map_safetensors_state

    reference, model = build_qwen2(rank, tied=True)
    state = map_safetensors_state(sorted(glob.glob(f"{directory}/*.safetensors")))
    mesh = init_device_mesh("cpu", (world_size,))
    init_sharded(model, state, mesh=mesh, source="local")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.full_tensor(), reference.get_parameter(name), atol=0, rtol=0
        )
    dist.barrier()


def test_local_source_from_mapped_safetensors(tmp_path):
    reference, _ = build_qwen2(0, tied=True)
    reference.save_pretrained(
        tmp_path
    )  # HF drops the tied lm_head.weight: the alias key is optional
    run_distributed(2, _from_safetensors, str(tmp_path))


def test_safetensors_key_mismatch_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    from fsdp2_ext import _fsdp2_ext
    from fsdp2_ext.checkpoint.safetensors_source import map_safetensors_state

    save_file({"wrong.name": torch.ones(3, dtype=torch.bfloat16)}, str(tmp_path / "a.safetensors"))
    state = map_safetensors_state([tmp_path / "a.safetensors"])
    assert torch.equal(state["wrong.name"], torch.ones(3, dtype=torch.bfloat16))
    like = torch.empty(3, dtype=torch.bfloat16, device="meta")
    verdict = _fsdp2_ext.describe_state_mismatch(
        [_fsdp2_ext.TargetSpec("right.name", like, _fsdp2_ext.Placement.SHARD0)],
        list(state),
        list(state.values()),
    )
    assert "missing keys: right.name" in verdict and "unexpected keys: wrong.name" in verdict


class _LargeUneven(torch.nn.Module):
    """A table large enough for direct transfers (> 1 MiB per rank) with uneven rows."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(1001, 600)  # 2.4 MB fp32
        self.small = torch.nn.Linear(300, 7)


def _large_uneven(rank, world_size):
    from fsdp2_ext.init.sharded_init import fsdp_params_by_fqn

    torch.manual_seed(3)
    reference = _LargeUneven()
    if rank == 0:
        model = _LargeUneven()
        model.load_state_dict(reference.state_dict())
    else:
        with torch.device("meta"):
            model = _LargeUneven()
    mesh = init_device_mesh("cpu", (world_size,))
    init_sharded(
        model, reference.state_dict() if rank == 0 else None, mesh=mesh, bucket_bytes=1 << 20
    )
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), reference.get_parameter(name)), name
    for fqn, fsdp_param in fsdp_params_by_fqn(model).items():
        padded = fsdp_param._sharded_param_data.view(fsdp_param.padded_sharded_param_size)
        rows = fsdp_param.sharded_size[0]
        assert padded.data_ptr() == fsdp_param.sharded_param.to_local().data_ptr() or rows == 0, fqn
        assert torch.count_nonzero(padded[rows:]) == 0, f"{fqn}: padding must be zeros"
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 4])
def test_direct_transfers_of_large_uneven_tables(world_size):
    run_distributed(world_size, _large_uneven)


def _collections_while_preparing(rank, world_size):
    """[Note: the collector paused during an init]: with thresholds that make every allocation
    trip a collection, none starts inside ``prepare_sharded`` (``fully_shard``'s objects), and
    the collector comes back as it was: on, or still off when the caller had turned it off; on
    again after an error. The values are exact either way."""
    import gc

    from fsdp2_ext.init.sharded_init import fill_sharded, prepare_sharded
    from fsdp2_ext.testing.gc_watch import collections_inside

    mesh = init_device_mesh("cpu", (world_size,))
    try:
        for collector_on in (True, False):
            (gc.enable if collector_on else gc.disable)()
            reference, model = build_toy(rank)
            with collections_inside(prepare_sharded) as collections:
                prepare_sharded(model, mesh=mesh)
                assert gc.isenabled() is collector_on
            assert not collections, f"{len(collections)} collections in the init: {collections[:4]}"
            fill_sharded(model, reference.state_dict() if rank == 0 else None)
            assert gc.isenabled() is collector_on
            for name, param in model.named_parameters():
                expected = reference.get_parameter(name)
                actual = param.full_tensor() if hasattr(param, "full_tensor") else param
                assert torch.equal(actual, expected), name
        gc.enable()
        with pytest.raises(ValueError, match="1-D shard mesh"):  # 1-D or 2-D (HSDP) only
            prepare_sharded(build_toy(rank)[1], mesh=init_device_mesh("cpu", (1, 1, world_size)))
        assert gc.isenabled()
    finally:
        gc.enable()
    dist.barrier()


def test_no_automatic_collection_while_preparing():
    run_distributed(2, _collections_while_preparing)


def test_hub_kernels_go_to_the_compute_device_under_cpu_offload():
    """Under ``CPUOffloadPolicy`` the shards rest on the CPU (``device``) while the forward runs
    on the mesh's accelerator; hub kernels are chosen for the latter, as Transformers' own
    offloaded ``device_map`` does ([Note: hub kernels once the weights are real]). A stand-in
    mesh names the accelerator this CPU machine lacks."""
    from types import SimpleNamespace

    from fsdp2_ext.init.sharded_init import PreparedModel

    prepared = PreparedModel(
        mesh=SimpleNamespace(device_type="cuda"),
        group=None,
        cpu_group=None,
        device=torch.device("cpu"),  # what prepare_sharded sets under CPUOffloadPolicy
        registrations=[],
        aliases=None,
        buffers={},
        wrap=None,
        stage_seconds={},
    )
    assert prepared.compute_device_type == "cuda"
