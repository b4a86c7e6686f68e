"""A save from one number of ranks resumes on another, through VERL's own TrainingWorker and its
per-rank files ([Note: resharding a resume] in fsdp2_ext/verl/checkpoint_reshard.py).

Fresh processes on Gloo. The claims, as they can honestly be made:

- State identity: after the load at W2, every parameter and AdamW moment gathered in full, the
  step counters and the scheduler equal the saved W1 state bit for bit.
- Nothing lost: W1 -> W2 (load, save) -> W1 (load), then the remaining steps: loss, grad norm and
  lr equal (``==``) the uninterrupted W1 run's, and so does the final state.
- The W2 continuation is the W2 computation: the steps after the resharded load, and the state
  they end in, equal (``==``) those of a W2 run given the same state by an independent route,
  torch's own ``set_model_state_dict`` / ``set_optimizer_state_dict(..., full_state_dict=True,
  broadcast_from_rank0=True)`` of the full state torch's ``get_state_dict`` took at step k of the
  W1 run.
- For the record: the steps continued at W2 differ from the W1 continuation (another reduction
  order and split of the batch); the size of the gap is printed.

- Never a full tensor: under ``_ReshardSpy`` a rank assembles at most its padded chunk of any
  tensor and no ``full_tensor`` is called; what rank 0 assembled is the planner's
  ``reshard_rank_bytes_*`` figure to the byte (less the moments of adapters that never had a
  gradient; a tie is assembled once).

And what is refused, on every rank with one message. Through VERL's worker, the rank's state
checked against a snapshot taken before the load: another LoRA rank, a rank's files missing, a
save from or onto VERL's 2-D (HSDP) mesh, a save of other parameters (a full fine-tuning save
resumed with LoRA) or of adapters on other modules (the optimizer's parameter count), ranks that
see different files. As direct calls: a key sharded in the save and not live, more than one other
saved world or none, chunks off FSDP2's layout. ``tests/verl/test_main_ppo_resume.py`` resumes ``main_ppo`` itself on another number
of ranks.
"""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest
import torch
import transformers

from fsdp2_ext.testing.compare import assert_states_equal
from fsdp2_ext.testing.spawn import run_distributed, run_with_faults

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, SAVED_AT, BATCH = 4, 2, 24  # 24 sequences: 12, 8 or 6 per rank at 2, 3, 4 ranks
OPTIMIZER = {
    "lr": 1e-2, "weight_decay": 0.1, "clip_grad": 0.5, "total_training_steps": STEPS,
    "lr_warmup_steps": 3, "lr_scheduler_type": "cosine",
}  # fmt: skip
# kind -> (model, LoRA rank, save_lora_only)
KINDS = {
    "qwen4_exp": ("qwen4_exp", 16, True),
    "qwen4_exp_full_save": ("qwen4_exp", 16, False),
    "qwen2_tied": ("qwen2_tied", 0, False),
}


def _write_model(kind: str, directory: str) -> str:
    from fsdp2_ext.testing.tiny_models import save_resume_model

    return save_resume_model(kind, directory, kv_heads=1, hidden=24)


def _worker(
    model_path, kind, lora_rank=None, *, shim=True, fsdp_size=-1, targets="all-linear",
    dtype="fp32",
):  # fmt: skip
    import fsdp2_ext.testing.verl_engine as ve

    _, default_rank, lora_only = KINDS[kind]
    return ve.build_worker(
        model_path, shim=shim, lora_rank=default_rank if lora_rank is None else lora_rank,
        save_lora_only=lora_only, optimizer=OPTIMIZER, fsdp_size=fsdp_size, model_dtype=dtype,
        target_modules=targets,
    )  # fmt: skip


class _ReshardSpy:
    """During a resharded load: the bytes this rank assembles from the saved chunks (every
    ``SavedWorld.rows`` result, model and optimizer apart) and the most rows one call returned
    against the tensor's padded chunk at the live world size; a ``full_tensor`` call (a gather
    of a whole tensor) fails the load. What "never a full tensor" and the planner's reshard figure
    are held against."""

    def __init__(self, live_world: int):
        self.live_world = live_world
        self.assembled = {"model": 0, "optim": 0}
        self.widest = 0.0  # rows returned / ceil(total / live_world), the largest seen

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        from fsdp2_ext.verl import checkpoint_reshard

        self._rows, self._full = checkpoint_reshard.SavedWorld.rows, DTensor.full_tensor
        assert self._rows.__qualname__ == "SavedWorld.rows"  # the name the load calls
        spy, rows = self, self._rows

        def counted(saved, key, local_of, total, begin, end):
            result = rows(saved, key, local_of, total, begin, end)
            spy.assembled["optim" if ":" in key else "model"] += result.nbytes
            spy.widest = max(spy.widest, result.shape[0] / -(-total // spy.live_world))
            return result

        def refused(*args, **kwargs):
            raise AssertionError("a full tensor was gathered during the resharded load")

        checkpoint_reshard.SavedWorld.rows = counted
        DTensor.full_tensor = refused
        return self

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor

        from fsdp2_ext.verl import checkpoint_reshard

        checkpoint_reshard.SavedWorld.rows, DTensor.full_tensor = self._rows, self._full
        return False


def _local_state(worker) -> dict:
    """This rank's own shards of every parameter, its optimizer tensors and the scheduler's step
    (no collective): what a refused load must leave as it found it."""
    module, optimizer = worker.engine.module, worker.engine.optimizer
    state = {k: _local(v).detach().clone() for k, v in module.state_dict().items()}
    for name, param in module.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            state[f"{name}:{key}"] = torch.as_tensor(_local(value)).detach().clone()
    state["scheduler:last_epoch"] = torch.tensor(worker.engine.lr_scheduler.last_epoch)
    return state


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def _step(worker, step: int, rank: int, world: int) -> dict:
    from verl.utils import tensordict_utils as tu

    import fsdp2_ext.testing.verl_engine as ve

    batch = ve.rank_slice(ve.grpo_batch(BATCH, 64, seed=1000 + step), rank, world)
    tu.assign_non_tensor(batch, update_lr_scheduler=True, mini_batch_size=BATCH, epochs=1)
    metrics = tu.get(worker.train_mini_batch(batch), "metrics")
    return {key: metrics[key] for key in ("loss", "grad_norm", "lr")}


def _full_state(worker) -> dict:
    """Parameters and every optimizer tensor in full (collectives, same order on every rank),
    the scheduler's step; what is equal at any world size."""
    import fsdp2_ext.testing.verl_engine as ve

    module, optimizer = worker.engine.module, worker.engine.optimizer
    optim, shards = {}, {}
    for name, param in module.named_parameters():
        if hasattr(param, "to_local"):
            shards[name] = param.to_local().shape[0]
        for key, value in optimizer.state.get(param, {}).items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            optim[f"{name}:{key}"] = torch.as_tensor(full).detach().cpu().clone()
    return {
        "params": ve.full_state(worker),
        "optim": optim,
        "scheduler": worker.engine.lr_scheduler.state_dict(),
        "local_rows": shards,
    }


def _torch_full_state(worker, rank: int, path: str) -> None:
    """Torch's own full state of the model and optimizer (``get_state_dict``: collective, rank 0
    holds it) and the scheduler's, written by rank 0: the independent route's input."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(
        worker.engine.module, worker.engine.optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )  # fmt: skip
    if rank == 0:
        scheduler = worker.engine.lr_scheduler.state_dict()
        torch.save({"model": model, "optim": optim, "scheduler": scheduler}, path)


def _set_torch_full_state(worker, rank: int, path: str) -> None:
    """The independent route: torch's ``set_*_state_dict`` broadcasting rank 0's full state into
    FSDP2's shards at the live world size (every sharded parameter; the frozen tables stay as
    the model checkpoint built them, as in a resume), and the scheduler's state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module = worker.engine.module
    sharded = {k for k, v in module.state_dict().items() if hasattr(v, "to_local")}
    saved = torch.load(path, weights_only=False)  # every rank: the scheduler's state
    model = {k: v for k, v in saved["model"].items() if k in sharded} if rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    # (set_state_dict itself skips the model on ranks whose model dict is empty: torch's
    # ``optim_only=not model_state_dict``; the two halves as VERL calls them)
    set_model_state_dict(module, model, options=options)
    set_optimizer_state_dict(
        module, worker.engine.optimizer, saved["optim"] if rank == 0 else {}, options=options
    )
    worker.engine.lr_scheduler.load_state_dict(saved["scheduler"])


def _less_torch_s_empty_states(state: dict, like: dict) -> dict:
    """``state``'s optimizer tensors for ``like``'s keys: torch's ``set_optimizer_state_dict``
    first gives every parameter an AdamW state (``_init_optim_state``: one step of zero
    gradients), so a parameter that never had a gradient (the indexer's adapters here) has zero
    moments there (and that step's count, which AdamW never reads without a gradient)."""
    extra = {k: v for k, v in state["optim"].items() if k not in like["optim"]}
    moments = {k: v for k, v in extra.items() if not k.endswith(":step")}
    assert all(not v.any() for v in moments.values()), [k for k, v in moments.items() if v.any()]
    return {**state, "optim": {k: v for k, v in state["optim"].items() if k in like["optim"]}}


def _run(rank, world, model_path, kind, mode, out, load_from=None, save_to=None):
    """``reference``: N steps, state at k (and torch's full state, for the independent route),
    saved at k as VERL saves mid-run (``save_freq``), then on to N; ``save``: k steps, save;
    ``load``: load ``load_from``, state, optionally save to ``save_to`` at once, then the
    remaining steps; ``independent``: torch's ``set_state_dict`` of the
    reference's state at k, then the remaining steps."""
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    worker = _worker(model_path, kind)
    record = {"steps": {}}
    first, last = 1, STEPS
    torch_full = os.path.join(out, f"{kind}_torch_full_state.pt")
    if mode == "load":
        with _ReshardSpy(world) as spy:
            worker.load_checkpoint(os.path.join(out, load_from))
        record["assembled"], record["widest"] = spy.assembled, spy.widest
        record["dtype"] = str(next(worker.engine.module.parameters()).dtype)
        optimizer = worker.engine.optimizer
        record["stateless_bytes"] = sum(  # trainable, and no AdamW state (never a gradient)
            _local(p).nbytes for p in worker.engine.module.parameters()
            if p.requires_grad and hasattr(p, "to_local") and p not in optimizer.state
        )  # fmt: skip
        record["state_at_k"] = _full_state(worker)
        if save_to:
            worker.save_checkpoint(os.path.join(out, save_to), global_step=SAVED_AT)
        first = SAVED_AT + 1
    elif mode == "independent":
        _set_torch_full_state(worker, rank, torch_full)
        record["state_at_k"] = _full_state(worker)
        first = SAVED_AT + 1
    elif mode == "save":
        last = SAVED_AT
    for step in range(first, last + 1):
        record["steps"][step] = _step(worker, step, rank, world)
        if mode == "reference" and step == SAVED_AT:
            record["state_at_k"] = _full_state(worker)
            _torch_full_state(worker, rank, torch_full)
            worker.save_checkpoint(os.path.join(out, f"saved_{world}"), global_step=SAVED_AT)
    if mode in ("load", "independent", "reference"):
        record["state_at_end"] = _full_state(worker)
    if mode == "save":
        worker.save_checkpoint(os.path.join(out, f"saved_{world}"), global_step=SAVED_AT)
    if mode in ("load", "independent") or rank == 0:
        torch.save(record, os.path.join(out, f"{kind}_{mode}_{load_from}_{world}_rank{rank}.pt"))


def _record(out, kind, mode, world, load_from=None, rank=0):
    return torch.load(
        os.path.join(out, f"{kind}_{mode}_{load_from}_{world}_rank{rank}.pt"), weights_only=False
    )


def _assert_state_identity(ours, theirs, where):
    assert_states_equal(ours["params"], theirs["params"], f"{where} params")
    assert_states_equal(ours["optim"], theirs["optim"], f"{where} optimizer")
    assert ours["scheduler"] == theirs["scheduler"], where


@pytest.mark.parametrize(
    ("kind", "w1", "w2"),
    [("qwen4_exp", 2, 3), ("qwen4_exp_full_save", 4, 2), ("qwen2_tied", 2, 4)],
    ids=[
        "qwen4_exp-lora16-lora_only-2to3to2",
        "qwen4_exp-lora16-full_save-4to2to4",
        "qwen2_tied-full_ft-2to4to2",
    ],
)
def test_a_save_resumes_on_another_number_of_ranks_and_back_losing_nothing(tmp_path, kind, w1, w2):
    import fsdp2_ext.testing.verl_engine as ve

    if KINDS[kind][0] == "qwen4_exp" and not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("no qwen4_exp")
    model_path = _write_model(KINDS[kind][0], str(tmp_path / kind))
    env = ve.env_for(str(tmp_path))
    out = str(tmp_path)
    # the reference saves at k and goes on: the steps after k are those of a run that saved
    run_distributed(w1, _run, model_path, kind, "reference", out, env=env)
    run_distributed(
        w2, _run, model_path, kind, "load", out, f"saved_{w1}", f"resaved_{w2}", env=env
    )
    run_distributed(w1, _run, model_path, kind, "load", out, f"resaved_{w2}", env=env)
    run_distributed(w2, _run, model_path, kind, "independent", out, env=env)
    reference = _record(out, kind, "reference", w1)
    for rank in range(w2):  # state identity at W2, on every rank
        at_w2 = _record(out, kind, "load", w2, f"saved_{w1}", rank)
        _assert_state_identity(at_w2["state_at_k"], reference["state_at_k"], f"W{w2} rank {rank}")
        # never a full tensor: no call assembled more rows than the rank's padded chunk, and
        # none gathered one (``full_tensor`` fails the load under the spy)
        assert 0 < at_w2["widest"] <= 1.0, (rank, at_w2["widest"])
    # the planner's figure, held against what rank 0 (the largest chunks) assembled: every
    # adapter and its two AdamW moments (and the base's shard in a full save), less the moments
    # of the adapters that never had a gradient (no state to save or read)
    at_w2 = _record(out, kind, "load", w2, f"saved_{w1}", 0)
    planned = _planned_reshard_bytes(model_path, kind, w2, at_w2["dtype"])
    read = sum(at_w2["assembled"].values())
    print(
        f"{kind}: resharded {w1} -> {w2}: rank 0 assembled {at_w2['assembled']}, planned {planned}"
    )
    assert read + 2 * at_w2["stateless_bytes"] == planned, (at_w2["assembled"], planned)
    at_w2 = _record(out, kind, "load", w2, f"saved_{w1}", w2 - 1)
    rows = at_w2["state_at_k"]["local_rows"]  # the last rank of W2
    assert rows, "no sharded parameter"
    back = _record(out, kind, "load", w1, f"resaved_{w2}")  # W1 -> W2 -> W1
    _assert_state_identity(back["state_at_k"], reference["state_at_k"], f"back at W{w1}")
    after = range(SAVED_AT + 1, STEPS + 1)
    for step in after:
        assert back["steps"][step] == reference["steps"][step], step
    # nothing lost: the round trip's final state is the uninterrupted run's, every parameter and
    # optimizer tensor at atol 0, and the scheduler
    _assert_state_identity(back["state_at_end"], reference["state_at_end"], f"end, back at W{w1}")
    at_w2 = _record(out, kind, "load", w2, f"saved_{w1}")
    independent = _record(out, kind, "independent", w2)  # torch's own route to W2
    torch_at_k = _less_torch_s_empty_states(independent["state_at_k"], reference["state_at_k"])
    _assert_state_identity(torch_at_k, reference["state_at_k"], "torch's route")
    continued = at_w2["steps"]
    for step in after:  # the W2 continuation is the W2 computation
        assert continued[step] == independent["steps"][step], step
    ours_at_end = at_w2["state_at_end"]
    torch_at_end = _less_torch_s_empty_states(independent["state_at_end"], ours_at_end)
    assert_states_equal(ours_at_end["params"], torch_at_end["params"], "end params")
    assert_states_equal(ours_at_end["optim"], torch_at_end["optim"], "end optimizer")
    gap = max(
        (torch.tensor(continued[s]["loss"]) - torch.tensor(reference["steps"][s]["loss"]))
        .abs().max().item()
        for s in after
    )  # fmt: skip
    print(f"{kind}: W{w2} continuation vs W{w1}: largest loss difference {gap:.3e}")
    assert [continued[s] for s in after] != [reference["steps"][s] for s in after]
    if kind == "qwen2_tied":  # 6 rows over 4 ranks (2, 2, 2, 0): the last rank's shard is empty
        assert any(r == 0 for r in rows.values()), rows


def _planned_reshard_bytes(model_path: str, kind: str, world: int, dtype: str) -> int:
    """``plan_memory``'s bytes a rank reads and assembles resuming ``kind``'s save at ``world``
    ranks, the model built on meta from its config as the planner builds it."""
    from fsdp2_ext.plan.planner import plan_memory

    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    _, lora_rank, lora_only = KINDS[kind]
    plan = plan_memory(
        model, world_size=world, dtype=getattr(torch, dtype.removeprefix("torch.")),
        lora_rank=lora_rank, target_modules="all-linear" if lora_rank else (),
    )  # fmt: skip
    return plan.reshard_rank_bytes_lora_only if lora_only else plan.reshard_rank_bytes_full


def _load_only(
    rank, world, model_path, out, directory, kind="qwen2_tied", lora_rank=None, fsdp_size=-1,
    targets="all-linear", dtype="fp32",
):  # fmt: skip
    """A load expected to be refused: this rank's state after the refusal is the state it was
    built with, bit for bit ("before any state is touched"); an AssertionError says otherwise."""
    worker = _worker(model_path, kind, lora_rank, fsdp_size=fsdp_size, targets=targets, dtype=dtype)
    before = _local_state(worker)
    try:
        worker.load_checkpoint(os.path.join(out, directory))
    except Exception:
        assert_states_equal(_local_state(worker), before, f"rank {rank} after the refusal")
        raise


def _save_hsdp(rank, world, model_path, out):
    """VERL alone (no shim) with ``fsdp_size=2``: its 2-D ``("ddp", "fsdp")`` mesh, saved after two
    steps, so that the save differs from the state a live model is built with: a refused load that
    wrote any of it would show in ``_load_only``'s comparison (without the step it could not)."""
    torch.manual_seed(1234)
    worker = _worker(model_path, "qwen2_tied", shim=False, fsdp_size=2)
    built = _local_state(worker)
    for step in (1, 2):  # the scheduler's warm-up gives step 1 a learning rate of 0
        _step(worker, step, rank, world)
    stepped = _local_state(worker)
    changed = [k for k in built if not torch.equal(built[k], stepped[k])]
    assert any(":" not in k for k in changed), f"rank {rank}: the steps changed no parameter"
    worker.save_checkpoint(os.path.join(out, f"saved_hsdp_{world}"), global_step=2)


def test_a_save_from_or_onto_verl_s_2d_hsdp_mesh_is_refused_naming_both_meshes(tmp_path):
    """VERL's HSDP layout (``fsdp_size`` below the world size) is not resharded, either way: an
    HSDP save (VERL alone, 4 ranks, fsdp_size 2) on 2 ranks, and a 1-D save of 2 ranks on the
    shim's HSDP mesh of 4; every rank refuses before touching state, with one message naming the
    saved and the live mesh."""
    import fsdp2_ext.testing.verl_engine as ve

    model_path = _write_model("qwen2_tied", str(tmp_path / "qwen2"))
    env = ve.env_for(str(tmp_path))
    run_distributed(4, _save_hsdp, model_path, str(tmp_path), env=env)
    run_distributed(2, _run, model_path, "qwen2_tied", "save", str(tmp_path), env=env)
    flat, hsdp = "1-D mesh ('fsdp',) of (2,)", "2-D mesh ('ddp', 'fsdp') of (2, 2)"
    cases = {  # (world, fsdp_size, save, its mesh, the live mesh)
        "from HSDP": (2, -1, "saved_hsdp_4", hsdp, flat),
        "onto HSDP": (4, 2, "saved_2", flat, hsdp),
    }
    for case, (world, fsdp_size, directory, saved, live) in cases.items():
        outcome = run_with_faults(
            world, _load_only, model_path, str(tmp_path), directory, "qwen2_tied", None,
            fsdp_size, env=env,
        )  # fmt: skip
        assert set(outcome) == set(range(world)), (case, outcome)
        messages = {message for _, message, _ in outcome.values()}
        assert len(messages) == 1, (case, messages)
        kind, message, _ = outcome[0]
        assert kind == "ReshardRefused", (case, message)
        assert f"saved on a {saved}" in message and f"the live mesh is {live}" in message, message


def test_a_save_with_another_lora_rank_is_refused_naming_the_key_and_both_shapes(tmp_path):
    import fsdp2_ext.testing.verl_engine as ve

    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("no qwen4_exp")
    model_path = _write_model("qwen4_exp", str(tmp_path / "qwen4"))
    env = ve.env_for(str(tmp_path))
    run_distributed(2, _run, model_path, "qwen4_exp", "save", str(tmp_path), env=env)
    outcome = run_with_faults(
        3, _load_only, model_path, str(tmp_path), "saved_2", "qwen4_exp", 8, env=env
    )  # a LoRA-only save of rank 16, loaded with rank 8
    assert set(outcome) == {0, 1, 2}, outcome
    messages = {message for _, message, _ in outcome.values()}
    assert len(messages) == 1, messages  # one message, on every rank
    kind, message, _ = outcome[0]
    assert kind == "ReshardRefused", message
    assert "lora_A" in message and "(16, " in message and "(8, " in message, message
    assert "LoRA rank) the checkpoint was trained with" in message


def test_a_save_in_another_dtype_is_refused_naming_the_key_and_both_dtypes(tmp_path):
    """A save of fp32 parameters resumed on 3 ranks by a model built in bf16
    (``model_dtype``): every rank refuses with one message naming a key and both dtypes, state
    untouched, instead of casting the save's values into the live shards."""
    import fsdp2_ext.testing.verl_engine as ve

    model_path = _write_model("qwen2_tied", str(tmp_path / "qwen2"))
    env = ve.env_for(str(tmp_path))
    run_distributed(2, _run, model_path, "qwen2_tied", "save", str(tmp_path), env=env)
    outcome = run_with_faults(
        3, _load_only, model_path, str(tmp_path), "saved_2", "qwen2_tied", None, -1,
        "all-linear", "bf16", env=env,
    )  # fmt: skip
    message = _refused_on_every_rank(outcome, 3)
    assert "torch.float32, the live model has" in message and "torch.bfloat16" in message, message
    assert "resume with the model (and LoRA rank) the checkpoint was trained with" in message


def test_a_save_with_a_rank_s_files_missing_is_refused_on_every_rank(tmp_path):
    """A local-disk save seen from elsewhere: rank 1's files are not there. Every rank refuses
    before touching state, naming the missing rank and what to do."""
    import fsdp2_ext.testing.verl_engine as ve

    model_path = _write_model("qwen2_tied", str(tmp_path / "qwen2"))
    env = ve.env_for(str(tmp_path))
    run_distributed(2, _run, model_path, "qwen2_tied", "save", str(tmp_path), env=env)
    saved = tmp_path / "saved_2"
    for name in os.listdir(saved):
        if name.endswith("_rank_1.pt"):
            os.remove(saved / name)
    outcome = run_with_faults(3, _load_only, model_path, str(tmp_path), "saved_2", env=env)
    assert set(outcome) == {0, 1, 2}, outcome
    for rank, (kind, message, _) in outcome.items():
        assert kind == "ReshardRefused", (rank, message)
        assert "saved by 2 ranks" in message and "rank(s) [1]" in message, message
        assert "where every rank can read them" in message


def _refused_on_every_rank(outcome: dict, world: int) -> str:
    """The one ReshardRefused message every rank raised."""
    assert set(outcome) == set(range(world)), outcome
    messages = {message for _, message, _ in outcome.values()}
    assert len(messages) == 1, messages
    kinds = {kind for kind, _, _ in outcome.values()}
    assert kinds == {"ReshardRefused"}, outcome
    return messages.pop()


def test_a_save_of_another_model_or_other_adapters_is_refused_on_every_rank(tmp_path):
    """Two saves the live model cannot take, each refused on every rank of 3 with one message,
    state untouched: a full fine-tuning save (qwen2, no LoRA) resumed with LoRA adapters (every
    saved key is the base's, the live ones PEFT's), and a LoRA-only save of adapters on q_proj
    alone resumed with adapters on every linear layer (the saved keys are all live ones, so
    only the optimizer's parameter count tells)."""
    import fsdp2_ext.testing.verl_engine as ve

    model_path = _write_model("qwen2_tied", str(tmp_path / "qwen2"))
    env = ve.env_for(str(tmp_path))
    out = str(tmp_path)
    run_distributed(2, _run, model_path, "qwen2_tied", "save", out, env=env)
    outcome = run_with_faults(3, _load_only, model_path, out, "saved_2", "qwen2_tied", 8, env=env)
    message = _refused_on_every_rank(outcome, 3)
    assert "the saved parameters differ from the live model's (first: 'model." in message
    assert "saved, not in the live model" in message, message
    unexpected, missing = map(int, re.search(r"(\d+) unexpected, (\d+) missing", message).groups())
    assert unexpected > 0 and missing > 0, message  # the base's keys, and PEFT's
    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("no qwen4_exp")
    model_path = _write_model("qwen4_exp", str(tmp_path / "qwen4"))
    run_distributed(2, _save_with_targets, model_path, out, ["q_proj"], env=env)
    outcome = run_with_faults(
        3, _load_only, model_path, out, "saved_q_proj_2", "qwen4_exp", None, -1, "all-linear",
        env=env,
    )  # fmt: skip
    message = _refused_on_every_rank(outcome, 3)
    assert "the saved optimizer has " in message and "parameters, the live one" in message


def _save_with_targets(rank, world, model_path, out, targets):
    worker = _worker(model_path, "qwen4_exp", targets=targets)
    _step(worker, 1, rank, world)  # trained values and AdamW moments: a load would change state
    worker.save_checkpoint(os.path.join(out, f"saved_{'_'.join(targets)}_{world}"), global_step=1)


def _reshard_unsharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fsdp2_ext.verl.checkpoint_reshard import ReshardRefused, _resharded

    mesh = init_device_mesh("cpu", (world,))
    saved = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    for template, named in ((None, "no such key"), (torch.ones(4, 3), "it unsharded")):
        with pytest.raises(ReshardRefused, match=f"'w' is sharded in the save, .* has {named}"):
            _resharded("w", None, lambda r: saved, template, "/step")


def test_a_key_sharded_in_the_save_and_not_in_the_live_model_is_refused():
    """The live model must hold a sharded key as a DTensor to take a resharded one: a key it
    lacks, or holds whole (a table kept off the mesh), is refused naming it."""
    run_distributed(2, _reshard_unsharded)


def _load_own_copy(rank, world, model_path, out, directories):
    _load_only(rank, world, model_path, out, directories[rank])


def test_ranks_that_see_different_files_refuse_together_before_any_state_changes(tmp_path):
    """Host-local copies of a step directory that differ: on 3 ranks, rank 2's copy lacks saved
    rank 1's files, ranks 0 and 1 see them all. The verdicts are agreed before any state is
    touched: every rank raises the same ReshardRefused naming rank 2 and the missing files.
    Negative control, run once: with the agreement removed (and the last barrier as before), rank
    2 raised alone and ranks 0 and 1 failed in that barrier with Gloo's "Connection closed by
    peer" once rank 2's process had exited; where the failed rank's process lives on, they block
    there."""
    import shutil

    import fsdp2_ext.testing.verl_engine as ve

    model_path = _write_model("qwen2_tied", str(tmp_path / "qwen2"))
    env = ve.env_for(str(tmp_path))
    run_distributed(2, _run, model_path, "qwen2_tied", "save", str(tmp_path), env=env)
    stale = tmp_path / "host_b_copy"
    shutil.copytree(tmp_path / "saved_2", stale)
    for name in os.listdir(stale):
        if name.endswith("_rank_1.pt"):
            os.remove(stale / name)
    directories = ["saved_2", "saved_2", "host_b_copy"]
    outcome = run_with_faults(
        3, _load_own_copy, model_path, str(tmp_path), directories, env=env, timeout_s=240
    )
    assert set(outcome) == {0, 1, 2}, outcome
    messages = {message for _, message, _ in outcome.values()}
    assert len(messages) == 1, messages  # one message, on every rank
    kind, message, _ = outcome[0]
    assert kind == "ReshardRefused", message
    assert message.startswith("rank 2: ") and "rank(s) [1]" in message, message
    # Another host's copy holds rank 2's own files at the live world size (a stale save of a
    # 3-rank run beside it): rank 2 alone would take VERL's load, the others reshard. Agreed
    # first: every rank refuses, naming what differs.
    mixed = tmp_path / "host_c_copy"
    shutil.copytree(tmp_path / "saved_2", mixed)
    for name in os.listdir(mixed):
        if name.endswith("_world_size_2_rank_1.pt"):
            shutil.copy(
                mixed / name, mixed / name.replace("_world_size_2_rank_1", "_world_size_3_rank_2")
            )
    outcome = run_with_faults(
        3, _load_own_copy, model_path, str(tmp_path), ["saved_2", "saved_2", "host_c_copy"],
        env=env, timeout_s=240,
    )  # fmt: skip
    assert set(outcome) == {0, 1, 2}, outcome
    for rank, (kind, message, _) in outcome.items():
        assert kind == "ReshardRefused", (rank, message)
        assert "the ranks see different saves" in message and "reshard from 2" in message


def test_a_resumed_rank_opens_only_the_saved_files_that_overlap_its_rows(tmp_path):
    """``SavedWorld`` opens a saved rank's file on first use: live rank l of 2 reading a tensor
    saved by 8 ranks opens rank 0's (keys and metadata) and the 4 that hold its rows, and the
    rows equal the full tensor's."""
    from fsdp2_ext.verl.checkpoint_reshard import SavedWorld, _file, chunk_rows

    full = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    saved_world, live_world = 8, 2
    for r in range(saved_world):
        first, last = chunk_rows(40, saved_world, r)
        torch.save({"w": full[first:last].clone()}, _file(str(tmp_path), "model", saved_world, r))
    for live in range(live_world):
        saved = SavedWorld(str(tmp_path), "model", saved_world)
        saved.file(0)
        begin, end = chunk_rows(40, live_world, live)
        rows = saved.rows("w", lambda r, s=saved: s.file(r)["w"], 40, begin, end)
        assert torch.equal(rows, full[begin:end])
        assert saved.opened == sorted({0, *range(4 * live, 4 * live + 4)}), (live, saved.opened)


def test_more_than_one_other_saved_world_or_a_chunk_off_fsdp2s_layout_is_refused(tmp_path):
    """Two of the refusals without a process group: a directory with the files of two other world
    sizes (which to reshard from is not known), and saved chunks that are not FSDP2's Shard(0)
    layout at the saved world size."""
    from fsdp2_ext.verl.checkpoint_reshard import (
        ReshardRefused,
        SavedWorld,
        _agreed,
        _file,
        chunk_rows,
        saved_world_size,
    )  # fmt: skip

    for world in (2, 3):
        for r in range(world):
            torch.save({}, _file(str(tmp_path), "model", world, r))
    with pytest.raises(ReshardRefused, match=r"more than one other world size .* 2, 3"):
        saved_world_size(str(tmp_path), ["model"], 4, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReshardRefused, match=r"no other world size .* \(saved world sizes: none\)"):
        saved_world_size(str(tmp_path / "empty"), ["model"], 4, 0)
    # a process of its own (VERL's checkpoint manager tests): its verdict is the verdict
    with pytest.raises(ReshardRefused, match=r"^rank 0: unreadable$"):
        _agreed("rank 0: unreadable", 0, "reading the saved files")
    _agreed("", 0, "loaded")
    full = torch.arange(10 * 2, dtype=torch.float32).view(10, 2)
    off = tmp_path / "off"
    off.mkdir()
    for r, (first, last) in enumerate([(0, 4), (4, 10)]):  # 4 + 6 rows: FSDP2 puts 5 + 5
        torch.save({"w": full[first:last].clone()}, _file(str(off), "model", 2, r))
    assert chunk_rows(10, 2, 0) == (0, 5)
    saved = SavedWorld(str(off), "model", 2)
    with pytest.raises(ReshardRefused, match=r"'w' on saved rank 0 holds 4 rows where FSDP2"):
        saved.rows("w", lambda r: saved.file(r)["w"], 10, 0, 10)
