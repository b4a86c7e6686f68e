import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Spawned ranks inherit sys.path: the spawn helper and the torchrun script's checks import from here.
for path in (
    HERE,
    os.path.join(HERE, "special_distributed"),
    os.path.join(HERE, "utils"),
    os.path.dirname(HERE),
):
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def main_ppo_uninterrupted(tmp_path_factory):
    """The recipe's CPU variant, 4 steps through main_ppo, probed in every process."""
    import main_ppo_runs
    from fsdp2_ext.verl_cpu.recipe_run import run_main_ppo

    directory = str(tmp_path_factory.mktemp("main_ppo_uninterrupted"))
    return run_main_ppo(
        directory,
        config_dir=main_ppo_runs.RECIPE,
        overrides=main_ppo_runs.overrides(probe=True),
        extra_env={"VERL_USE_EXTERNAL_MODULES": main_ppo_runs.PROBED_MODULES},
    )
