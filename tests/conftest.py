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


_SESSION = {}  # the pytest config, for the terminal reporter


def pytest_configure(config):
    _SESSION["config"] = config


def pytest_runtest_logreport(report):
    """A test rerun after a rank died of a signal (``make test``'s ``--reruns``) prints its error
    in the log: the crashed rank's faulthandler stacks ([Note: a rank that dies of a signal] in
    fsdp2_ext/testing/spawn.py), which the rerun's pass would otherwise drop."""
    if report.outcome != "rerun" or "config" not in _SESSION:
        return
    reporter = _SESSION["config"].pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nRERUN {report.nodeid} ({report.when}), its error:")
        reporter.write_line(report.longreprtext[-12000:])
