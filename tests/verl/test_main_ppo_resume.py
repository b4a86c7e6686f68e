"""A preempted main_ppo run continues bit for bit: the recipe's CPU variant for 4 steps
uninterrupted (the session's ``main_ppo_uninterrupted``), against the same command SIGKILLed
with everything it started right after the step-2 save, then started again (``resume_mode:
auto``): steps 3 and 4 report the same reward, policy loss, grad norm and learning rate, and the
final adapter is the same to the bit. The pair's checkpoint holds the toy's values in fp32, the
run's dtype, so its tables are views of the file (trainer and rollout servers: one page-cache
copy); the uninterrupted run's holds them in bf16 (one host-shared copy per table): the two ways
of holding a table train to the same bits.

And the same step-2 save resumed by ``main_ppo`` on another number of ranks (its files copied into
a fresh run of the same toy, the command given ``trainer.n_gpus_per_node``): on 1 rank it reshards
([Note: resharding a resume]), says so in one line, and continues at step 3 with the state it
saved: step 3's rollouts (generated with the restored adapter) score as the uninterrupted run's,
and the scheduler's learning rate is the same; the losses are another reduction's (printed). On 3
ranks, which do not divide the actor's mini-batch there, every rank refuses at the load, before
any step, naming the sizes.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import transformers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"), reason="no qwen4_exp"),
]
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr")


@pytest.fixture(scope="module")
def preempted_and_resumed(tmp_path_factory):
    from fsdp2_ext.verl_cpu.recipe_run import run_main_ppo
    from tests.verl import main_ppo_runs

    directory = str(tmp_path_factory.mktemp("main_ppo_preempted"))
    options = dict(config_dir=main_ppo_runs.RECIPE, overrides=main_ppo_runs.overrides())
    killed = run_main_ppo(directory, kill_after_save=2, log_name="preempted.log", **options)
    resumed = run_main_ppo(directory, write_toy=False, log_name="resumed.log", **options)
    return killed, resumed


def test_the_preempted_run_died_after_its_step_2_save(preempted_and_resumed):
    from fsdp2_ext.verl_cpu.recipe_run import parse_steps

    killed, _ = preempted_and_resumed
    assert killed.returncode == -9
    trained = sorted(s for s, m in parse_steps(killed.log()).items() if "actor/pg_loss" in m)
    assert trained and max(trained) <= 3, trained  # killed at the save, before step 4
    assert os.path.isdir(os.path.join(killed.checkpoint_dir, "global_step_2"))


def test_the_pair_s_tables_are_views_of_its_checkpoint_file(
    preempted_and_resumed, main_ppo_uninterrupted
):
    from fsdp2_ext.verl_cpu.recipe_run import check_tables

    for run in preempted_and_resumed:
        checks = check_tables(run, tables="views")
        assert len(checks) == 2 and all(passed for passed, _ in checks.values()), checks
    # The check can fail: the uninterrupted run's tables are no views of its (bf16) file.
    checks = check_tables(main_ppo_uninterrupted, tables="views")
    assert not all(passed for passed, _ in checks.values()), checks


def test_steps_3_and_4_equal_the_uninterrupted_run(preempted_and_resumed, main_ppo_uninterrupted):
    from fsdp2_ext.verl_cpu.recipe_run import parse_steps

    _, resumed = preempted_and_resumed
    assert resumed.returncode == 0, resumed.log()[-4000:]
    ours, reference = parse_steps(resumed.log()), parse_steps(main_ppo_uninterrupted.log())
    assert sorted(s for s in ours if "actor/pg_loss" in ours[s]) == [3, 4]  # resumed at step 3
    for step in (3, 4):
        assert {k: ours[step][k] for k in COMPARED} == {k: reference[step][k] for k in COMPARED}


def test_the_final_adapter_is_bit_identical(preempted_and_resumed, main_ppo_uninterrupted):
    from fsdp2_ext.verl_cpu.recipe_run import saved_adapter

    _, resumed = preempted_and_resumed
    ours = saved_adapter(os.path.join(resumed.checkpoint_dir, "global_step_4", "actor"))
    reference = saved_adapter(
        os.path.join(main_ppo_uninterrupted.checkpoint_dir, "global_step_4", "actor")
    )
    assert ours.keys() == reference.keys() and ours
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name


def _copy_of_the_step_2_save(directory: str, source) -> None:
    """A fresh toy run (the same model and tables: ``write_toy_run`` is seeded) whose checkpoint
    directory holds ``source``'s step-2 save alone, marked the latest, as VERL marks it."""
    from fsdp2_ext.verl_cpu.toy_run import environment, write_toy_run

    write_toy_run(directory)
    checkpoints = environment(directory)["CHECKPOINT_DIR"]
    shutil.copytree(
        os.path.join(source.checkpoint_dir, "global_step_2"),
        os.path.join(checkpoints, "global_step_2"),
    )
    with open(os.path.join(checkpoints, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")


def _resumed_on(tmp_path_factory, source, name: str, *overrides: str):
    from fsdp2_ext.verl_cpu.recipe_run import run_main_ppo
    from tests.verl import main_ppo_runs

    directory = str(tmp_path_factory.mktemp(name))
    _copy_of_the_step_2_save(directory, source)
    return run_main_ppo(
        directory, config_dir=main_ppo_runs.RECIPE, overrides=main_ppo_runs.overrides(*overrides),
        write_toy=False, log_name=f"{name}.log",
    )  # fmt: skip


def test_a_save_of_2_ranks_resumes_on_1_with_the_state_it_saved(
    tmp_path_factory, main_ppo_uninterrupted
):
    from fsdp2_ext.verl_cpu.recipe_run import parse_steps, saved_adapter

    run = _resumed_on(
        tmp_path_factory, main_ppo_uninterrupted, "resumed_on_1", "trainer.n_gpus_per_node=1"
    )
    log = run.log()
    assert run.returncode == 0, log[-4000:]
    assert "resumed a checkpoint saved by 2 ranks on 1: " in log, log[-4000:]
    assert "per-rank RNG not carried" in log
    ours, reference = parse_steps(log), parse_steps(main_ppo_uninterrupted.log())
    assert sorted(s for s in ours if "actor/pg_loss" in ours[s]) == [3, 4]
    for key in ("critic/score/mean", "actor/lr"):  # the restored adapter's rollouts, the schedule
        assert ours[3][key] == reference[3][key], key
    # The adapter trained on from the saved one: its step-4 state is the uninterrupted run's but
    # for another reduction order, far closer to it than the two steps between the saves are.
    # Not asserted at 0, although a run here gave 0: one rank sums the batch's gradients in
    # another order than two (grad_norm differed by 3.7e-9 at step 4), and whether that reaches
    # the adapter's bits after clipping and AdamW is not something the computation promises.
    saved = {
        s: saved_adapter(
            os.path.join(main_ppo_uninterrupted.checkpoint_dir, f"global_step_{s}", "actor")
        )
        for s in (2, 4)
    }
    final = saved_adapter(os.path.join(run.checkpoint_dir, "global_step_4", "actor"))
    assert final.keys() == saved[4].keys() and final
    gap = max((final[k] - saved[4][k]).abs().max().item() for k in final)
    steps = max((saved[4][k] - saved[2][k]).abs().max().item() for k in final)
    print(f"final adapter on 1 rank vs 2: {gap:.3e} (two steps move it {steps:.3e})")
    assert gap < steps / 100, (gap, steps)
    for step in (3, 4):  # for the record: one rank reduces the batch in another order
        gaps = {k: abs(ours[step][k] - reference[step][k]) for k in COMPARED}
        print(f"step {step} on 1 rank vs 2: {gaps}")


def test_a_resume_on_ranks_that_do_not_divide_the_mini_batch_is_refused_at_the_load(
    tmp_path_factory, main_ppo_uninterrupted
):
    """3 ranks, 3 prompts x 1 response a step (VERL's own check of the train batch passes) and a
    mini-batch of 2 x 1: VERL would stop at the first update (``train_mini_batch``'s assert),
    after the whole load; the shim refuses at the load, on every rank, before any step, naming
    the sizes."""
    from fsdp2_ext.common.run_report import read_records
    from fsdp2_ext.verl_cpu.recipe_run import parse_steps

    run = _resumed_on(
        tmp_path_factory, main_ppo_uninterrupted, "resumed_on_3", "trainer.n_gpus_per_node=3",
        "actor_rollout_ref.rollout.n=1", "data.train_batch_size=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    )  # fmt: skip
    log = run.log()
    assert run.returncode != 0, log[-4000:]
    assert "ReshardRefused" in log, log[-4000:]
    assert "saved by 2 ranks, resumed on 3, whose 3 data-parallel ranks do not divide" in log
    assert "actor.ppo_mini_batch_size 2 x rollout.n 1 = 2 sequences" in log
    assert not [s for s, m in parse_steps(log).items() if "actor/pg_loss" in m]
    # Ray carries one worker's exception to the driver: every rank's is on record, one message.
    refusals = read_records(run.report_dir, "refused-")
    assert sorted(r["rank"] for r in refusals) == [0, 1, 2], refusals
    assert len({r["message"] for r in refusals}) == 1, refusals
