"""A preempted main_ppo run continues bit for bit: the recipe's CPU variant for 4 steps
uninterrupted (the session's ``main_ppo_uninterrupted``), against the same command SIGKILLed
with everything it started right after the step-2 save, then started again (``resume_mode:
auto``): steps 3 and 4 report the same reward, policy loss, grad norm and learning rate, and the
final adapter is the same to the bit.
"""

from __future__ import annotations

import os

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
    from tests import main_ppo_runs

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
