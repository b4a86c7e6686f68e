"""Session fixtures (the expensive runs several test modules read), and how ``make test``
shares the machine between two workers ([Note: two workers]).

[Note: two workers]
``make test`` runs the suite in two pytest calls. The first runs every test not marked ``alone``
on two pytest-xdist workers, one per core of this machine kind (``-n 2 --dist loadscope
--no-loadscope-reorder``): a serial run left a core idle a third of the time (single-process
tests, Ray's and VERL's start-up, a rank waiting for the other). The unit a worker takes is a
file (its module fixtures are computed once), except ``MAIN_PPO_FILES``, one unit: the files that
read the session's ``main_ppo_uninterrupted``, so it is computed once. The longest units go first
(``LONGEST``: that one, then VERL's own tests), so neither is left for the end beside an idle
worker (with VERL's own tests in the ``main_ppo`` unit, the other worker idled three minutes at
the end). Ray clusters may run side by side (VERL's own tests', the ``main_ppo`` runs'): each
``ray.init`` starts a local cluster of its own (no ``ray start`` here, so none joins another's),
and a run's teardown check asks for that run's processes alone (``recipe_run.processes_left``).
Nothing else runs beside this call: the machine is CPU-bound here (96% busy), and a third
stream only slows the two (``make vllm-check`` beside it took 704 s instead of 235, and the call
270 s more). The units are this conftest's scheduler's
(``pytest_xdist_make_scheduler``): xdist 3.8's own groups (``--dist loadgroup``,
``xdist_group``) rename ``item._nodeid``, which pytest 9 no longer reads (its node IDs are
structured), so they group nothing there. The second call runs the tests marked ``alone`` with
nothing beside them: the scale models and the fault tests, which bound a wait by time at a floor
scaled to this machine's own speed, which a neighbour would halve.
"""

import pytest

# The files that read the session's main_ppo_uninterrupted: one unit of work ([Note: two workers]).
MAIN_PPO_FILES = (
    "tests/verl/test_main_ppo.py",
    "tests/verl/test_main_ppo_resume.py",
)
# The longest units, in the order the workers take them first ([Note: two workers]).
LONGEST = ("main_ppo", "tests/verl/test_verl_own_tests.py")


def unit_of_work(nodeid: str) -> str:
    """The unit a worker takes for the test ``nodeid``: ``"main_ppo"`` for ``MAIN_PPO_FILES``,
    else its file."""
    path = nodeid.split("::")[0]
    return "main_ppo" if path in MAIN_PPO_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnitOfWork(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return ByUnitOfWork(config, log)


def pytest_collection_modifyitems(config, items):
    """``LONGEST`` first, in its order (stable: the files' order otherwise)."""

    def rank(item) -> int:
        unit = unit_of_work(item.nodeid)
        return LONGEST.index(unit) if unit in LONGEST else len(LONGEST)

    items.sort(key=rank)


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
