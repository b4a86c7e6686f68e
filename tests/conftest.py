"""Session fixtures: the expensive runs several test modules read."""

import pytest


@pytest.fixture(scope="session")
def main_ppo_uninterrupted(tmp_path_factory):
    """The recipe's CPU variant, 4 steps through main_ppo, probed in every process, on a
    checkpoint stored in bf16 (the toy's values are bf16 ones): the fp32 run's tables cannot be
    views of the file and the trainer's ranks share one host-shared copy of each. The resumes in
    tests/verl/test_main_ppo_resume.py run on the same values stored in fp32 (tables as views)
    and compare against this run to the bit."""
    from fsdp2_ext.verl_cpu.recipe_run import run_main_ppo
    from tests.verl import main_ppo_runs

    directory = str(tmp_path_factory.mktemp("main_ppo_uninterrupted"))
    return run_main_ppo(
        directory,
        config_dir=main_ppo_runs.RECIPE,
        overrides=main_ppo_runs.overrides(probe=True),
        extra_env={"VERL_USE_EXTERNAL_MODULES": main_ppo_runs.PROBED_MODULES},
        stored_dtype="bfloat16",
    )
