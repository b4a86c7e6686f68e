"""Session fixtures: the expensive runs several test modules read."""

import pytest


@pytest.fixture(scope="session")
def main_ppo_uninterrupted(tmp_path_factory):
    """The recipe's CPU variant, 4 steps through main_ppo, probed in every process."""
    from fsdp2_ext.verl_cpu.recipe_run import run_main_ppo
    from tests.verl import main_ppo_runs

    directory = str(tmp_path_factory.mktemp("main_ppo_uninterrupted"))
    return run_main_ppo(
        directory,
        config_dir=main_ppo_runs.RECIPE,
        overrides=main_ppo_runs.overrides(probe=True),
        extra_env={"VERL_USE_EXTERNAL_MODULES": main_ppo_runs.PROBED_MODULES},
    )
