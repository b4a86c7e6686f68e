"""HSDP: VERL's 2-D ``("ddp", "fsdp")`` mesh (``fsdp_size`` below the world size) on 4 Gloo ranks
(2 x 2), in fresh processes, with every init source ([Note: HSDP loads] in
``fsdp2_ext/init/replica_broadcast.py``).

- ``init_sharded`` from rank 0: every parameter bit-equal to torch's ``set_model_state_dict(...,
  broadcast_from_rank0=True)`` on the same 2-D mesh; a tied Qwen2's tie through AdamW, the gather
  and an HF reload; the toy's table, buffer and nested embedding, from rank 0 and ``local``.
- ``checkpoint``: qwen4_exp + LoRA from its bf16 files into fp32 on the 2-D mesh equals the rank-0
  path (and that path equals ``from_pretrained`` + PEFT on the CPU); only what rank 0 makes (the
  adapters) is sent, none of it by the second replica; the tables one host-shared copy.
- VERL's own ``TrainingWorker`` with ``fsdp_size=2``: tied Qwen2 with the shim, from rank 0 and
  from the checkpoint, equals VERL alone after init and after a GRPO step, bit for bit, with one
  full build (rank 0's, from rank 0) or none; a save resumes on the same 2-D mesh in fresh
  processes and the next step is the uninterrupted one's; qwen4_exp + LoRA 16 loads from the
  checkpoint on every rank and trains.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

from fsdp2_ext.testing.compare import assert_states_equal, load_like_verl_today
from fsdp2_ext.testing.spawn import run_distributed, run_with_faults
from fsdp2_ext.testing.tiny_models import build_qwen2, save_tiny_qwen2, save_tiny_qwen4_exp
from tests.checkpoint import test_model_checkpoint_load as checkpoint_load
from tests.special_distributed import test_fsdp2_full_state_load as checks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD, HSDP = 4, (2, 2)
NAMES = ("ddp", "fsdp")


def _rank0_and_local_on_2d(rank, world_size):
    from fsdp2_ext.init.sharded_init import init_sharded, prepare_sharded

    mesh = init_device_mesh("cpu", HSDP, mesh_dim_names=NAMES)
    checks.check_tied_qwen2(rank, world_size, mesh_shape=HSDP)
    for source in ("rank0", "local"):
        checks.check_toy_model(rank, world_size, source, mesh_shape=HSDP)
    # Both sources, untied and tied, equal torch's set_model_state_dict on the same 2-D mesh:
    # placements, shapes, dtypes and bytes of every local shard.
    for tied in (False, True):
        for source in ("rank0", "local"):
            reference, ours = build_qwen2(rank, tied=tied)
            _, theirs = build_qwen2(rank, tied=tied)
            full_state = {k: v.clone() for k, v in reference.state_dict().items()}
            given = full_state if rank == 0 or source == "local" else None
            init_sharded(ours, given, mesh=mesh, source=source)
            theirs.to_empty(device="meta")
            load_like_verl_today(theirs, full_state, mesh, rank)
            their_params = dict(theirs.named_parameters())
            for name, param in ours.named_parameters():
                what = f"{name} ({source}, tied={tied})"
                assert tuple(param.placements) == tuple(their_params[name].placements), what
                mine, other = param.to_local(), their_params[name].to_local()
                assert mine.shape == other.shape and mine.dtype == other.dtype, what
                assert torch.equal(mine.view(torch.uint8), other.view(torch.uint8)), what
    # Ranks built under init_empty_weights (which splits the tie) learn it from rank 0, over
    # every rank of the mesh: the second replica's ranks too.
    from accelerate import init_empty_weights
    from transformers import Qwen2ForCausalLM

    from fsdp2_ext.testing.tiny_models import tiny_qwen2_config

    reference, model = build_qwen2(rank)
    if rank != 0:
        with init_empty_weights():
            model = Qwen2ForCausalLM(tiny_qwen2_config()).to(torch.bfloat16)
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    init_sharded(model, reference.state_dict() if rank == 0 else None, mesh=mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight, rank
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.full_tensor(), reference.get_parameter(name), atol=0, rtol=0, msg=name
        )
    with pytest.raises(ValueError, match=r"a 3-D mesh .* of \(1, 2, 2\)"):
        prepare_sharded(build_qwen2(rank)[1], mesh=init_device_mesh("cpu", (1, *HSDP)))
    # A 2-D mesh of part of the world (ranks 0 and 1 of 4) without cpu_group=: refused, naming
    # the fix, on the mesh's ranks (every rank builds the mesh: its groups are collective).
    from torch.distributed.device_mesh import DeviceMesh

    partial = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=NAMES)
    if rank < 2:
        with pytest.raises(
            ValueError, match=r"a 2-D mesh of 2 ranks in a world of 4: pass cpu_group="
        ):
            prepare_sharded(build_qwen2(rank)[1], mesh=partial)
    dist.barrier()


def test_rank0_and_local_sources_on_a_2d_mesh_equal_torch_s_loader():
    run_distributed(WORLD, _rank0_and_local_on_2d, timeout_s=300)


def _leader_stops_before_its_broadcast(rank, world_size):
    import signal

    from fsdp2_ext.init import sharded_init

    mesh = init_device_mesh("cpu", HSDP, mesh_dim_names=NAMES)
    reference, model = build_qwen2(rank, tied=False)
    if rank == 1:  # the leader of shard coordinate 1: its replica, rank 3, waits for it
        assert callable(sharded_init.broadcast_to_replicas)  # the name fill_sharded calls

        def stop(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGSTOP)

        sharded_init.broadcast_to_replicas = stop
    state = reference.state_dict() if rank == 0 else None
    sharded_init.init_sharded(model, state, mesh=mesh, timeout_s=5.0)


@pytest.mark.alone  # a 5 s bound on work of about a second ([Note: two workers])
def test_a_leader_that_stops_before_its_broadcast_is_named_by_its_replica_within_the_bound():
    """[Note: bounded waits] along ``ddp``: rank 3 raises within the load's bound (5 s plus its
    bytes at 64 MiB/s), naming rank 1; the other shard coordinate completes."""
    reports = run_with_faults(WORLD, _leader_stops_before_its_broadcast, timeout_s=120)
    assert 1 not in reports  # stopped
    kind, message, seconds = reports[3]
    assert kind == "RuntimeError", message
    # the replicate group's first collective (on NCCL: its communicator), bounded as a whole
    assert "first collective with rank 1 (their leader) did not complete" in message, message
    assert "rank 1's own load before it" in message and "died or stopped" in message
    assert seconds < 5.0 + 20
    assert reports[0][0] == reports[2][0] == "ok", reports


def test_checkpoint_source_on_a_2d_mesh_equals_the_rank0_path(tmp_path):
    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("no qwen4_exp")
    path = checkpoint_load.save_qwen4_exp(str(tmp_path / "qwen4"))
    shared = str(tmp_path / "host_shared")
    os.makedirs(shared)
    for source in ("rank0", "checkpoint"):
        run_distributed(  # positional: shared dir, allow_missing, two rank-0 switches, the mesh
            WORLD, checkpoint_load._load, path, source, True, torch.float32, str(tmp_path),
            shared, False, False, False, HSDP, timeout_s=300,
        )  # fmt: skip
    loads = {}
    for source in ("rank0", "checkpoint"):
        loads[source] = [
            torch.load(os.path.join(tmp_path, f"{source}_rank{r}.pt")) for r in range(WORLD)
        ]
    # The rank-0 path is from_pretrained + PEFT on rank 0's CPU, to the bit, on every rank.
    expected = checkpoint_load.build(
        path, on_meta=False, lora=True, dtype=torch.float32, keep_adapters=True
    )
    expected = {n: p.detach() for n, p in expected.named_parameters()}
    for rank in range(WORLD):
        assert_states_equal(loads["rank0"][rank]["state"], expected, f"rank0 path, rank {rank}")
        ours = loads["checkpoint"][rank]["state"]
        for name, tensor in loads["rank0"][rank]["state"].items():
            if "lora_A" in name:  # rank 0's own draw ([test_model_checkpoint_load]), everywhere
                assert ours[name].shape == tensor.shape and ours[name].std() > 0, name
                drawn = loads["checkpoint"][0]["state"][name]
                torch.testing.assert_close(ours[name], drawn, atol=0, rtol=0, msg=name)
                continue
            torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0, msg=name)
    # adapters only: at most every adapter's padded Shard(0) rows over the 2-way shard group
    lora = sum(
        -(-t.shape[0] // 2) * 2 * (t.nbytes // t.shape[0]) for n, t in expected.items()
        if "lora_" in n
    )  # fmt: skip
    sent = [load["sent"] for load in loads["checkpoint"]]
    assert sent[0] > 0 and all(s <= lora for s in sent), (sent, lora)
    assert sent[2] == sent[3] == 0, sent  # the second replica sends nothing
    inodes = {i for load in loads["checkpoint"] for i in load["inodes"].values()}
    assert len(inodes) == 1 and 0 not in inodes, inodes  # one host-shared copy, every rank


def _step(worker, rank: int, world_size: int, seed: int) -> dict:
    """One GRPO step over 16 sequences (4 per rank, one mini-batch, one optimizer step)."""
    from verl.utils import tensordict_utils as tu

    import fsdp2_ext.testing.verl_engine as ve

    batch = ve.rank_slice(ve.grpo_batch(16, 64, seed=seed), rank, world_size)
    tu.assign_non_tensor(batch, mini_batch_size=16, epochs=1)
    metrics = tu.get(worker.train_mini_batch(batch), "metrics")
    return {k: metrics[k] for k in ("loss", "grad_norm")}


def _worker_run(rank, world_size, model_path, shim, tag, resume_from=None):
    """VERL's TrainingWorker on VERL's 2-D mesh: init, a GRPO step, a save (or, with
    ``resume_from``: a load, then the same next step)."""
    from transformers import PreTrainedModel

    import fsdp2_ext.testing.verl_engine as ve

    built_in_full = []  # a spy on from_pretrained (it runs unchanged): a model off meta?
    from_pretrained = PreTrainedModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        model = from_pretrained(cls, *args, **kwargs)
        built_in_full.append(not any(p.is_meta for p in model.parameters()))
        return model

    PreTrainedModel.from_pretrained = classmethod(spy)
    torch.manual_seed(0)
    worker = ve.build_worker(model_path, shim=shim, fsdp_size=2, lora_rank=0)
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    # VERL builds the tied model in full on every rank; the shim from rank 0 on rank 0 alone, not
    # on the second replica's first rank too (VERL's rule for a mesh's last coordinate 0); the
    # shim from the checkpoint on none
    full = not shim or (rank == 0 and tag != "shim_ckpt")
    assert built_in_full == ([True] if full else []), (tag, rank, built_in_full)
    mesh = worker.engine.device_mesh
    assert mesh.mesh_dim_names == NAMES and tuple(mesh.mesh.shape) == HSDP, mesh
    record = {}
    if resume_from is None:
        record["init"] = ve.full_state(worker)
        record["step1"] = _step(worker, rank, world_size, seed=2)
        record["after_step1"] = ve.full_state(worker)
        worker.save_checkpoint(os.path.join(ve.test_dir(), f"{tag}_saved"), global_step=1)
    else:
        worker.load_checkpoint(os.path.join(ve.test_dir(), resume_from))
        record["after_step1"] = ve.full_state(worker)
    record["step2"] = _step(worker, rank, world_size, seed=3)
    record["after_step2"] = ve.full_state(worker)
    torch.save(record, os.path.join(ve.test_dir(), f"{tag}_rank{rank}.pt"))


def _qwen4_run(rank, world_size, model_path):
    import fsdp2_ext.testing.verl_engine as ve
    from fsdp2_ext.model.no_placement import no_placement_params

    torch.manual_seed(0)
    worker = ve.build_worker(model_path, shim=True, fsdp_size=2, lora_rank=16)
    module = worker.engine.module
    tables = no_placement_params(module)
    assert tables and all(t.param.device.type == "cpu" for t in tables)
    assert all(p.device_mesh.ndim == 2 for p in module.parameters() if hasattr(p, "device_mesh"))
    before = ve.full_state(worker)
    step = _step(worker, rank, world_size, seed=2)
    assert torch.isfinite(torch.tensor(step["loss"])).all(), step
    after = ve.full_state(worker)
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    assert moved and all("lora_" in n for n in moved), sorted(moved)[:5]  # only adapters train
    assert any("lora_B" in n for n in moved) and any("lora_A" in n for n in moved), sorted(moved)
    torch.save(after, os.path.join(ve.test_dir(), f"qwen4_rank{rank}.pt"))


def test_verl_training_worker_with_fsdp_size_2_equals_verl_alone_and_resumes(tmp_path):
    import fsdp2_ext.testing.verl_engine as ve

    model_path = save_tiny_qwen2(str(tmp_path / "qwen2"), tied=True)
    from_checkpoint = ve.env_for(str(tmp_path))  # the recipe's init source
    from_rank0 = dict(from_checkpoint, FSDP2_EXT_INIT_SOURCE="rank0")
    runs = [(False, "verl", None, from_rank0), (True, "shim", None, from_rank0),
            (True, "shim_ckpt", None, from_checkpoint),
            (True, "resumed", "shim_saved", from_rank0)]  # fmt: skip
    for shim, tag, resume_from, env in runs:
        run_distributed(
            WORLD, _worker_run, model_path, shim, tag, resume_from, env=env, timeout_s=400
        )
    for rank in range(WORLD):
        verl, shim, shim_ckpt, resumed = (
            torch.load(tmp_path / f"{tag}_rank{rank}.pt", weights_only=False)
            for tag in ("verl", "shim", "shim_ckpt", "resumed")
        )
        for ours in (shim, shim_ckpt):
            for key in ("init", "after_step1", "after_step2"):
                assert_states_equal(ours[key], verl[key], f"rank {rank} {key}: vs VERL alone")
            assert ours["step1"] == verl["step1"] and ours["step2"] == verl["step2"]
        assert_states_equal(resumed["after_step1"], shim["after_step1"], f"rank {rank} resumed")
        assert resumed["step2"] == shim["step2"], rank
        assert_states_equal(resumed["after_step2"], shim["after_step2"], f"rank {rank} resumed")


def test_verl_training_worker_with_fsdp_size_2_trains_qwen4_exp_from_the_checkpoint(tmp_path):
    """qwen4_exp + LoRA 16 from the checkpoint on VERL's 2-D mesh: the tables stay on the CPU;
    one GRPO step moves every adapter that has a gradient and no base weight; every rank gathers
    the same model."""
    import fsdp2_ext.testing.verl_engine as ve

    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("the installed Transformers has no qwen4_exp")
    from_checkpoint = ve.env_for(str(tmp_path))
    qwen4 = save_tiny_qwen4_exp(str(tmp_path / "qwen4"))
    run_distributed(WORLD, _qwen4_run, qwen4, env=from_checkpoint, timeout_s=400)
    states = [torch.load(tmp_path / f"qwen4_rank{r}.pt") for r in range(WORLD)]
    for rank in range(1, WORLD):  # every rank gathers the same trained model
        assert_states_equal(states[rank], states[0], f"qwen4_exp rank {rank}")
