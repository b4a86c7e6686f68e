"""VERL's own CPU tests as a standing guard of [Note: do no harm]: every test the same outcome
with ``fsdp2_ext.verl`` imported first as without it.

VERL's source distribution on PyPI carries its tests (``verl-0.9.1/tests/``; the wheel does not).
It is downloaded once (pinned by its sha256) into ``FSDP2_EXT_CACHE`` (default
``~/.cache/fsdp2_ext``) and only its ``tests/`` folder is unpacked there; nothing of it is kept in
this repository. The files run are those that reach what the shim or the CPU support replaces:
the protocol's nested tensors and position IDs, the checkpoint engine and managers (LoRA-only
checkpoints, global steps), the platform abstraction, the worker/placement plumbing on CPU, GRPO's
advantage and losses; ``VERL_CPU_TEST_FILES`` lists them. Failing alike is no pass: the plain
run's failures are pinned (``PLAIN_FAILURES``: a new one is noticed), the tests that reach a
replaced name (``MUST_PASS``) pass in both runs, and a plugin loaded in both runs (outside the
package) lists the fsdp2_ext modules each run loaded: none in the plain one.

VERL's ``tests/utils/`` (its FSDP wrap test among them) is not in the source distribution;
``tests/verl/test_verl.py::test_wrap_selection_decides_ties_as_verl_does`` holds the shim's wrap
selection against VERL's own function instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed", allow_module_level=True)

from fsdp2_ext.common.verl_version import SUPPORTED_VERSIONS  # noqa: E402
from fsdp2_ext.testing.verl_shim_first import REPORT_ENV  # noqa: E402

pytestmark = pytest.mark.slow

VERL_VERSION = "0.9.1"
SDIST_SHA256 = "3e03d8816b2546b2c5580705671b8d0bb3f79b8364e7b5c56dbfc1245536ba22"
VERL_CPU_TEST_FILES = [
    "tests/test_protocol_on_cpu.py",
    "tests/test_protocol_v2_on_cpu.py",
    "tests/test_base_config_on_cpu.py",
    "tests/checkpoint_engine/test_fsdp_lora_only_checkpoint_on_cpu.py",
    "tests/checkpoint_engine/test_global_steps_on_cpu.py",
    "tests/checkpoint_engine/test_utils.py",
    "tests/checkpoint_engine/test_sharded_delta.py",
    "tests/checkpoint_engine/test_block_placement.py",
    "tests/experimental/agent_loop/test_multimodal_position_ids_on_cpu.py",
    "tests/plugin/test_platform_abstraction.py",
    "tests/single_controller/test_auto_padding_on_cpu.py",
    "tests/single_controller/test_decorator_on_cpu.py",
    "tests/single_controller/test_get_set_dispatch_collect_cpu.py",
    "tests/single_controller/test_ray_utils_on_cpu.py",
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
]


# The tests that reach names the shim replaces (the LoRA-only checkpoint manager, the protocol's
# nested tensordicts and position IDs): they pass in both runs (classname prefixes in the JUnit
# report).
MUST_PASS = (
    "tests.test_protocol_on_cpu",
    "tests.checkpoint_engine.test_fsdp_lora_only_checkpoint_on_cpu",
    "tests.test_protocol_v2_on_cpu",
    "tests.experimental.agent_loop.test_multimodal_position_ids_on_cpu",
)
# What fails here in the plain run, pinned (VERL 0.9.1's protocol v2 tests against the tensordict
# this environment installs for the Transformers that ships qwen4_exp); a new one is noticed.
PLAIN_FAILURES = [
    "tests.test_protocol_v2_on_cpu::test_chunk_concat",
    "tests.test_protocol_v2_on_cpu::test_concat_tensordict",
    "tests.test_protocol_v2_on_cpu::test_contiguous",
]


def _cache() -> Path:
    return Path(os.environ.get("FSDP2_EXT_CACHE", Path.home() / ".cache" / "fsdp2_ext"))


def verl_tests_dir() -> Path:
    """VERL's own ``tests/`` from its PyPI source distribution, downloaded and unpacked once."""
    root = _cache() / f"verl-{VERL_VERSION}-tests"
    if (root / "tests" / "__init__.py").exists():
        return root
    sdist = _cache() / f"verl-{VERL_VERSION}.tar.gz"
    if not sdist.exists():
        download = _cache() / "download"
        download.mkdir(parents=True, exist_ok=True)
        requirement = download / "requirement.txt"
        requirement.write_text(f"verl=={VERL_VERSION} --hash=sha256:{SDIST_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--require-hashes", "-r", str(requirement), "-d", str(download)],
            check=True, timeout=600,
        )  # fmt: skip
        (download / sdist.name).rename(sdist)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    assert digest == SDIST_SHA256, f"{sdist}: sha256 {digest}, expected {SDIST_SHA256}"
    staging = root.with_suffix(".partial")
    with tarfile.open(sdist) as archive:
        prefix = f"verl-{VERL_VERSION}/tests/"
        members = [m for m in archive.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for member in members:
            member.name = member.name[len(f"verl-{VERL_VERSION}/") :]
        archive.extractall(staging, members=members, filter="data")
    staging.rename(root)
    return root


# A reporting plugin loaded in both runs, kept outside the fsdp2_ext package (importing it must
# not import fsdp2_ext): at the session's end it lists every fsdp2_ext module then loaded.
MODULE_REPORT_PLUGIN = """
import os, sys

REPORT = os.environ["FSDP2_EXT_MODULE_REPORT"]  # read at load: a test may change the environment


def pytest_sessionfinish(session, exitstatus):
    with open(REPORT, "w") as report:
        report.write("\\n".join(sorted(m for m in sys.modules if m.split(".")[0] == "fsdp2_ext")))
"""


def start_verl_tests(root: Path, junit: Path, *, shim: bool) -> subprocess.Popen:
    """VERL's CPU test files in a pytest of their own (its JUnit report to ``junit``), started:
    the plain run and the shim's run go side by side (each leaves a core idle half the time, in
    Ray's start-up and VERL's single-controller tests); ``finish`` waits for one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "FSDP2_EXT_"))}
    env.pop("PYTHONPATH", None)
    env[REPORT_ENV] = str(junit.with_suffix(".installed"))
    plugin_dir = junit.parent / "module_report_plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "fsdp2_ext_module_report.py").write_text(MODULE_REPORT_PLUGIN)
    env["PYTHONPATH"] = str(plugin_dir)
    env["FSDP2_EXT_MODULE_REPORT"] = str(junit.with_suffix(".modules"))
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
        "-p", "fsdp2_ext_module_report", f"--rootdir={root}", f"--junitxml={junit}",
        *VERL_CPU_TEST_FILES,
    ]  # fmt: skip
    if shim:
        command[3:3] = ["-p", "fsdp2_ext.testing.verl_shim_first"]
    with junit.with_suffix(".log").open("w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(run: subprocess.Popen, junit: Path, timeout_s: float = 1200) -> str:
    """Waits for the run of ``start_verl_tests`` that reports to ``junit`` (killed after
    ``timeout_s``); its output."""
    try:
        run.wait(timeout=timeout_s)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return junit.with_suffix(".log").read_text()


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from pytest's JUnit XML."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[f"{case.get('classname')}::{case.get('name')}"] = (
            {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
        )
    return found


def test_verl_cpu_tests_have_the_same_outcome_with_the_shim(tmp_path):
    assert VERL_VERSION in SUPPORTED_VERSIONS
    root = verl_tests_dir()
    plain = start_verl_tests(root, tmp_path / "plain.xml", shim=False)
    shim = start_verl_tests(root, tmp_path / "shim.xml", shim=True)
    finish(plain, tmp_path / "plain.xml")
    shimmed = finish(shim, tmp_path / "shim.xml")
    assert (tmp_path / "shim.xml").exists(), (shim.returncode, shimmed[-3000:])
    # Seen by a plugin loaded in both runs: the plain run loaded no fsdp2_ext module at all.
    plain_modules = (tmp_path / "plain.modules").read_text().split()
    shim_modules = (tmp_path / "shim.modules").read_text().split()
    assert plain_modules == [], plain_modules
    assert "fsdp2_ext.verl" in shim_modules, shim_modules
    rebound = (tmp_path / "shim.installed").read_text().split()
    assert "verl.utils.fsdp_utils._select_fsdp2_wrap_targets" in rebound, rebound
    before, after = outcomes(tmp_path / "plain.xml"), outcomes(tmp_path / "shim.xml")
    assert len(before) > 150 and sum(o == "passed" for o in before.values()) > 100, before
    differ = {t: (before.get(t), after.get(t)) for t in before.keys() | after.keys()
              if before.get(t) != after.get(t)}  # fmt: skip
    assert not differ, f"(plain, with the shim) per VERL test: {differ}\n{shimmed[-3000:]}"
    # Failing alike is no pass: the plain run's failures are pinned (a new one is noticed), and
    # the tests that reach a replaced name must pass in both runs.
    failed = sorted(t for t, o in before.items() if o in ("failed", "error"))
    print("VERL's own tests failing plain (and alike with the shim):", failed)
    assert failed == PLAIN_FAILURES, failed
    violations = must_pass_violations(before, after)
    assert not violations, violations
    for module in MUST_PASS:  # each file ran (a renamed file would pass every check above)
        assert any(_in_module(t, module) for t in before), module


def must_pass_violations(before: dict, after: dict) -> dict:
    """The tests of ``MUST_PASS`` files (less the pinned plain failures) that did not pass in
    both runs: test id -> (plain outcome, outcome with the shim)."""
    return {
        test: (before[test], after.get(test))
        for test in before
        if any(_in_module(test, module) for module in MUST_PASS)
        and test not in PLAIN_FAILURES
        and not before[test] == after.get(test) == "passed"
    }


def _in_module(test: str, module: str) -> bool:
    """Whether a JUnit test id (``classname::name``; a class's tests add ``.Class``) is
    ``module``'s."""
    classname = test.split("::")[0]
    return classname == module or classname.startswith(f"{module}.")


def test_a_replaced_name_s_test_failing_alike_in_both_runs_is_caught():
    """The negative control of ``MUST_PASS``: a test of each listed file failing in both runs
    (no difference between them) is still reported, by id; a pinned plain failure is not."""
    for module in MUST_PASS:
        test = f"{module}::test_x"
        assert must_pass_violations({test: "failed"}, {test: "failed"}) == {
            test: ("failed", "failed")
        }
        assert must_pass_violations({f"{module}.TestX::test_y": "error"}, {}) != {}
    assert must_pass_violations({"tests.test_protocol_on_cpu::t": "passed"}, {}) == {
        "tests.test_protocol_on_cpu::t": ("passed", None)
    }
    assert must_pass_violations({PLAIN_FAILURES[0]: "failed"}, {PLAIN_FAILURES[0]: "failed"}) == {}
    assert (
        must_pass_violations({"tests.test_other::t": "failed"}, {"tests.test_other::t": "failed"})
        == {}
    )
