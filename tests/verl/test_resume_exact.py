"""A resume is exact, proven in fresh processes, through VERL's own TrainingWorker.

Two separate runs of 2 Gloo ranks each: a reference of N steps that calls VERL's
``save_checkpoint`` at step k and goes on, as a run with ``save_freq`` does; a fresh start that
``load_checkpoint``s that save and runs the remaining N-k steps. AdamW with weight decay, a cosine schedule with warmup (k inside it), gradient clipping,
batches that depend only on the step. Before the first resumed update the parameters, optimizer
tensors, scheduler step and RNG states equal the reference's at step k (atol=0); after it every
step's loss, grad norm and learning rate equal (``==``). For a tiny qwen4_exp with LoRA 16
(``save_lora_only`` on and off) and a tiny tied Qwen2 in full fine-tuning, both with row counts
that 2 ranks do not split evenly. Negative controls: a resume that skips the optimizer state, or
the scheduler and RNG state (VERL's ``extra``), is not exact.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import transformers

from fsdp2_ext.testing.compare import assert_states_equal
from fsdp2_ext.testing.spawn import run_distributed, run_with_faults

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD, STEPS, SAVED_AT = 2, 4, 2
OPTIMIZER = {  # AdamW with weight decay, cosine with 3 warmup steps, clipping
    "lr": 1e-2,
    "weight_decay": 0.1,
    "clip_grad": 0.5,
    "total_training_steps": STEPS,
    "lr_warmup_steps": 3,
    "lr_scheduler_type": "cosine",
}


def _write_model(kind: str, directory: str) -> str:
    from fsdp2_ext.testing.tiny_models import save_resume_model

    return save_resume_model(kind, directory)


def _worker(model_path, kind, save_lora_only, load_contents=None):
    import fsdp2_ext.testing.verl_engine as ve

    return ve.build_worker(
        model_path,
        shim=True,
        lora_rank=16 if kind == "qwen4_exp" else 0,
        save_lora_only=save_lora_only,
        load_contents=load_contents,
        optimizer=OPTIMIZER,
    )


def _step(worker, step: int, rank: int) -> dict:
    """One optimizer step on the step's own batch; (loss, grad_norm, lr) as VERL reports them."""
    from verl.utils import tensordict_utils as tu

    import fsdp2_ext.testing.verl_engine as ve

    batch = ve.rank_slice(ve.grpo_batch(4, 64, seed=1000 + step), rank, WORLD)
    tu.assign_non_tensor(batch, update_lr_scheduler=True)
    metrics = ve.train_step(worker, batch)
    return {key: metrics[key] for key in ("loss", "grad_norm", "lr")}


def _state(worker) -> dict:
    """What a resume must restore: parameters (in full), this rank's optimizer tensors, the
    scheduler's step, every RNG state VERL saves."""
    import fsdp2_ext.testing.verl_engine as ve

    module, optimizer = worker.engine.module, worker.engine.optimizer
    optim = {}
    for name, param in module.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            local = value.to_local() if hasattr(value, "to_local") else value
            optim[f"{name}:{key}"] = torch.as_tensor(local).detach().clone()
    return {
        "params": ve.full_state(worker),
        "optim": optim,
        "scheduler_step": worker.engine.lr_scheduler.state_dict()["last_epoch"],
        "lr": worker.engine.lr_scheduler.get_last_lr(),
        "rng": (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()),
    }


def _run(rank, world_size, model_path, kind, save_lora_only, mode, out, load_contents=None):
    """``reference``: N steps (state kept at k), saved at k as VERL saves mid-run (``save_freq``)
    and on to N; ``resume``: a fresh process loads that save and runs N-k steps."""
    # Every generator VERL saves starts alike in every run (LoRA's A draw among them; the resume
    # overwrites them from the checkpoint).
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    checkpoint = os.path.join(out, f"checkpoint_{kind}_{save_lora_only}")
    worker = _worker(model_path, kind, save_lora_only, load_contents)
    record = {"steps": {}}
    first = 1
    if mode == "resume":
        worker.load_checkpoint(checkpoint)
        record["state_at_k"] = _state(worker)
        first = SAVED_AT + 1
    for step in range(first, STEPS + 1):
        record["steps"][step] = _step(worker, step, rank)
        if mode == "reference" and step == SAVED_AT:
            record["state_at_k"] = _state(worker)
            worker.save_checkpoint(checkpoint, global_step=SAVED_AT)
    tag = f"{kind}_{save_lora_only}_{mode}_{'-'.join(load_contents or [])}_rank{rank}"
    torch.save(record, os.path.join(out, f"{tag}.pt"))


def _load(out, kind, save_lora_only, mode, rank, load_contents=None):
    tag = f"{kind}_{save_lora_only}_{mode}_{'-'.join(load_contents or [])}_rank{rank}"
    return torch.load(os.path.join(out, f"{tag}.pt"), weights_only=False)


def _two_runs(tmp_path, kind, save_lora_only):
    import fsdp2_ext.testing.verl_engine as ve

    model_path = _write_model(kind, str(tmp_path / kind))
    env = ve.env_for(str(tmp_path))
    # two separate runs, fresh processes: the reference saves at k and goes on (the steps after
    # k are those of a run that saved), the resume loads that save
    for mode in ("reference", "resume"):
        run_distributed(WORLD, _run, model_path, kind, save_lora_only, mode, str(tmp_path), env=env)
    return model_path, env


@pytest.mark.parametrize(
    ("kind", "save_lora_only"),
    [("qwen4_exp", True), ("qwen4_exp", False), ("qwen2_tied", False)],
    ids=["qwen4_exp-lora16-lora_only", "qwen4_exp-lora16-full_save", "qwen2_tied-full_ft"],
)
def test_a_resume_in_a_fresh_process_is_exact(tmp_path, kind, save_lora_only):
    if kind == "qwen4_exp" and not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("no qwen4_exp")
    model_path, env = _two_runs(tmp_path, kind, save_lora_only)
    for rank in range(WORLD):
        reference = _load(tmp_path, kind, save_lora_only, "reference", rank)
        resumed = _load(tmp_path, kind, save_lora_only, "resume", rank)
        ours, theirs = resumed["state_at_k"], reference["state_at_k"]
        assert_states_equal(ours["params"], theirs["params"], f"rank {rank} params")
        assert_states_equal(ours["optim"], theirs["optim"], f"rank {rank} optimizer")
        assert ours["scheduler_step"] == theirs["scheduler_step"] == SAVED_AT
        assert ours["lr"] == theirs["lr"] and 0 < ours["lr"][0] < OPTIMIZER["lr"]  # in warmup
        assert torch.equal(ours["rng"][0], theirs["rng"][0])
        assert (ours["rng"][1] == theirs["rng"][1]).all() and ours["rng"][2] == theirs["rng"][2]
        for step in range(SAVED_AT + 1, STEPS + 1):
            assert resumed["steps"][step] == reference["steps"][step], (rank, step)
    if kind == "qwen4_exp" and save_lora_only:
        # Negative controls: a resume that leaves out the optimizer, or the scheduler and RNG.
        for contents in (["model", "extra"], ["model", "optimizer"]):
            run_distributed(
                WORLD, _run, model_path, kind, save_lora_only, "resume", str(tmp_path), contents,
                env=env,
            )  # fmt: skip
            reference = _load(tmp_path, kind, save_lora_only, "reference", 0)["steps"]
            resumed = _load(tmp_path, kind, save_lora_only, "resume", 0, contents)["steps"]
            after = range(SAVED_AT + 1, STEPS + 1)
            assert [resumed[s] for s in after] != [reference[s] for s in after], contents


def _save_once(rank, world_size, model_path, out):
    worker = _worker(model_path, "qwen4_exp", True)
    _step(worker, 1, rank)
    worker.save_checkpoint(os.path.join(out, "checkpoint_tables"), global_step=1)


def _resume_elsewhere(rank, world_size, model_path, out):
    worker = _worker(model_path, "qwen4_exp", True)
    worker.load_checkpoint(os.path.join(out, "checkpoint_tables"))


def test_a_resume_from_a_model_path_with_other_tables_is_refused_on_every_rank(tmp_path):
    """The checkpoint records each frozen table by content; MODEL_PATH now holds a table of the
    same name and shape with other values: every rank refuses, naming it and both sources."""
    import fsdp2_ext.testing.verl_engine as ve

    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("no qwen4_exp")
    first = _write_model("qwen4_exp", str(tmp_path / "first"))
    other = str(tmp_path / "other")
    torch.manual_seed(7)
    config = transformers.AutoConfig.from_pretrained(first)
    transformers.Qwen4ExpForCausalLM(config).save_pretrained(other)
    env = ve.env_for(str(tmp_path))
    run_distributed(WORLD, _save_once, first, str(tmp_path), env=env)
    outcome = run_with_faults(WORLD, _resume_elsewhere, other, str(tmp_path), env=env)
    for rank in range(WORLD):
        kind, message, _ = outcome[rank]
        assert kind == "ValueError", outcome
        assert "ngram_embedding" in message and first in message and other in message, message
