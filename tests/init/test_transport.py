"""What the init path asks of the process group, seen from outside: torch's profiler records every
c10d operation under its backend's name (``gloo:scatter``, ``gloo:send``, ``gloo:all_reduce``...),
so the calls are counted as the group sees them, not as the library reports them.

[Note: the rank-0 transfer on NCCL] asks for no unbatched point-to-point (on NCCL each pair would
get a communicator of its own) and one agreement per load, not one per group of tensors. Both
loads (rank 0's state, and the checkpoint files) run twice on 2 ``cpu:gloo`` ranks (VERL's group
form on a CPU host), with buckets / groups of 1 MiB and of 1 GiB: the rank-0 path moves every bucket
as one scatter (more buckets, more scatters), neither path sends or receives point to point, and
the number of all-reduces (agreements) does not depend on how many buckets or groups the load
has. The values are checked bit for bit against ``from_pretrained`` each time.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

from fsdp2_ext.testing.spawn import gather_results

pytestmark = pytest.mark.distributed
WORLD = 2
SMALL, LARGE = 1 << 20, 1 << 30


def save_checkpoint(directory: str) -> str:
    """A tied Qwen2 of ~5 MiB: rows that do not divide by 2 and segments above kDirectBytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=4099,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _counted_load(rank, world_size, path, source, bucket_bytes):
    """One init_sharded under the profiler: (gloo op -> count, load_from_local calls)."""
    import transformers
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from fsdp2_ext import _fsdp2_ext
    from fsdp2_ext.init.sharded_init import init_sharded

    mesh = init_device_mesh("cpu", (world_size,))
    on_meta = rank != 0 or source == "checkpoint"
    if on_meta:
        with init_empty_weights():  # kernels off on meta: they follow rank 0's after the load
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16, use_kernels=False
            )
        model.tie_weights()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    calls = collections.Counter()
    assert hasattr(_fsdp2_ext, "load_from_local")  # the names the load paths call
    assert hasattr(_fsdp2_ext, "load_from_rank0")
    local, from_rank0 = _fsdp2_ext.load_from_local, _fsdp2_ext.load_from_rank0

    def counted(*args, **kwargs):
        calls["load_from_local"] += 1
        return local(*args, **kwargs)

    def counted_rank0(*args, **kwargs):
        result = from_rank0(*args, **kwargs)
        calls["load_from_rank0"] += 1  # one plan agreement each ([Note: rank-0 transfer])
        calls["buckets"] += result.buckets
        return result

    from fsdp2_ext.init.state_load import Rank0Load

    assert Rank0Load.loader is from_rank0  # the rank-0 plan's loader, bound at its class
    _fsdp2_ext.load_from_local = counted
    _fsdp2_ext.load_from_rank0 = counted_rank0  # the checkpoint path's (adapters, conversions)
    Rank0Load.loader = staticmethod(counted_rank0)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            init_sharded(
                model,
                None,
                mesh=mesh,
                source=source,
                checkpoint=path if source == "checkpoint" else None,
                bucket_bytes=bucket_bytes,
            )
    finally:
        _fsdp2_ext.load_from_local = local
        _fsdp2_ext.load_from_rank0 = from_rank0
        Rank0Load.loader = staticmethod(from_rank0)
    ops = collections.Counter(e.name for e in profiler.events() if e.name.startswith("gloo:"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), reference.get_parameter(name)), name
    return dict(ops), calls["load_from_local"], calls["load_from_rank0"], calls["buckets"]


def _loads(rank, world_size, path):
    from torch import distributed as dist

    from fsdp2_ext import _fsdp2_ext

    group = dist.group.WORLD
    transport = {
        str(d): str(_fsdp2_ext.transport_device(group, torch.device(d))) for d in ("cpu", "cuda")
    }
    # The group's backends as torch states them ("cpu:gloo", or VERL's "cpu:gloo,cuda:nccl"):
    # what the transport must follow ([Note: transport device]).
    backends = dict(
        pair.split(":") for pair in str(dist.get_backend_config(group)).split(",") if ":" in pair
    )
    counts = {
        (source, size): _counted_load(rank, world_size, path, source, size)
        for source in ("rank0", "checkpoint")
        for size in (SMALL, LARGE)
    }
    return {"counts": counts, "transport": transport, "backends": backends}


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    path = save_checkpoint(str(tmp_path_factory.mktemp("qwen2")))
    return gather_results(WORLD, _loads, path)


@pytest.mark.parametrize("rank", range(WORLD))
def test_the_init_path_sends_nothing_point_to_point(loads, rank):
    for (source, size), (ops, *_) in loads[rank]["counts"].items():
        assert ops.get("gloo:send", 0) == 0 and ops.get("gloo:recv", 0) == 0, (source, size, ops)


@pytest.mark.parametrize("rank", range(WORLD))
def test_the_rank0_path_moves_each_bucket_as_one_scatter(loads, rank):
    """Scatters = buckets, exactly, at both bucket sizes (and more buckets at the smaller)."""
    counts = loads[rank]["counts"]
    for size in (SMALL, LARGE):
        ops, _, _, buckets = counts["rank0", size]
        assert ops.get("gloo:scatter", 0) == buckets >= 1, (size, ops, buckets)
    assert counts["rank0", SMALL][3] > counts["rank0", LARGE][3]
    assert counts["checkpoint", LARGE][0].get("gloo:scatter", 0) == 0  # every tensor is direct


@pytest.mark.parametrize("source", ["rank0", "checkpoint"])
def test_one_agreement_per_load_whatever_the_number_of_groups(loads, source):
    for rank in range(WORLD):
        counts = loads[rank]["counts"]
        (small, small_calls, small_plans, _) = counts[source, SMALL]
        (large, large_calls, large_plans, _) = counts[source, LARGE]
        if source == "checkpoint":
            assert small_calls > large_calls == 1, (small_calls, large_calls)
        # exactly one transfer-plan agreement per load (no adapters here: none from the files)
        assert small_plans == large_plans == (1 if source == "rank0" else 0)
        assert small.get("gloo:all_reduce", 0) == large.get("gloo:all_reduce", 0), (small, large)


def test_the_transport_follows_the_groups_backends(loads):
    """The load's data travels on the load's device where the group has a backend for it, else on
    the CPU ([Note: transport device]): on ``cpu:gloo`` a GPU load travels on the CPU, on VERL's
    ``cpu:gloo,cuda:nccl`` on the GPU. The expectation is derived from the group's backends."""
    for rank in range(WORLD):
        backends = loads[rank]["backends"]
        assert "cpu" in backends, backends
        expected = {d: d if d in backends else "cpu" for d in ("cpu", "cuda")}
        assert loads[rank]["transport"] == expected, (backends, loads[rank]["transport"])


def test_the_counts_come_from_a_real_profile():
    """A negative control of the counting itself: a point-to-point pair is seen."""
    gather_results(WORLD, _send_and_count)


def _send_and_count(rank, world_size):
    from torch import distributed as dist
    from torch.profiler import ProfilerActivity, profile

    tensor = torch.zeros(4)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        if rank == 0:
            dist.send(tensor, 1)
        else:
            dist.recv(tensor, 0)
    names = {e.name for e in profiler.events()}
    assert ("gloo:send" if rank == 0 else "gloo:recv") in names, sorted(names)
    return os.getpid()


def _staged_model():
    from torch import nn

    return nn.Sequential(*[nn.Linear(1024, 512, bias=False) for _ in range(48)])  # 2 MiB each


def _allocated_by_the_load(rank, world_size):
    """A rank-0 load whose segments are all staged (2 MiB weights over 4 ranks: 512 KiB each, far
    below a direct bucket's part), as every bucket of a load onto GPUs is: what the loader
    allocated on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.init.sharded_init import init_sharded
    from fsdp2_ext.init.state_load import Rank0Load

    torch.manual_seed(0)
    if rank == 0:
        model = _staged_model()
        state = model.state_dict()
    else:
        with torch.device("meta"):
            model = _staged_model()
        state = None
    real, held = Rank0Load.loader, {}

    def recorded(*args, **kwargs):
        result = real(*args, **kwargs)
        held.update(
            device=result.device_bytes_allocated, host=result.host_staging_bytes_allocated,
            buckets=result.buckets,
        )  # fmt: skip
        return result

    Rank0Load.loader = staticmethod(recorded)
    try:
        init_sharded(model, state, mesh=init_device_mesh("cpu", (world_size,)))
    finally:
        Rank0Load.loader = staticmethod(real)
    return held


def test_the_planned_peak_of_a_rank0_load_is_what_the_loader_allocates():
    """The planner's peak per GPU during a rank-0 load (``peak_gpu_bytes_during_load``, rank 0's
    ``peak_rank0_gpu_bytes_during_load``: the shards and the two staging slots) against what the
    loader allocated up front and held through the transfer, on 4 ranks, to the byte. On a CPU
    group the transport is the host, so nothing is pinned for a device (the plan's host staging
    is a device load's). Negative control, run once: the planner's former rule (rank 0 one part
    per receiving rank, W - 1) fell short of rank 0's allocation by two parts."""
    from fsdp2_ext.plan.planner import plan_memory

    held = gather_results(4, _allocated_by_the_load)
    with torch.device("meta"):
        plan = plan_memory(_staged_model(), world_size=4, dtype=torch.float32)
    print({rank: held[rank] for rank in sorted(held)}, plan.peak_rank0_gpu_bytes_during_load)
    assert held[0]["buckets"] >= 2, held  # staged: two slots in use
    assert held[0]["device"] == plan.peak_rank0_gpu_bytes_during_load, (held[0], plan)
    for rank in (1, 2, 3):
        assert held[rank]["device"] == plan.peak_gpu_bytes_during_load, (rank, held[rank], plan)
    assert all(h["host"] == 0 for h in held.values()), held
