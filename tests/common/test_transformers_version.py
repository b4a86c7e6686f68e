"""[Note: the Transformers range]: one outside it refused at ``import fsdp2_ext``, with the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp2_ext.common.transformers_version import BELOW, LOWEST, problem


@pytest.mark.parametrize("version", [LOWEST, "5.24.0", "5.25.0", "5.25.7"])
def test_the_range_is_accepted(version):
    assert problem(version) == ""


@pytest.mark.parametrize("version", ["5.18.2", "5.19.0rc1", "5.26.0.dev0", "5.26.0", "6.0.0"])
def test_outside_the_range_is_refused_naming_the_fix(version):
    assert f"found {version}: install 'transformers>={LOWEST},<{BELOW}'" in problem(version)


def test_the_import_refuses_a_transformers_outside_the_range():
    """A fresh interpreter whose Transformers reads as 5.26.0: ``import fsdp2_ext`` fails with
    the project's message, before anything imports Transformers itself."""
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '5.26.0' if name == 'transformers' else real(name)\n"
        "import fsdp2_ext\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "ImportError: fsdp2_ext supports Transformers" in done.stderr
    assert "found 5.26.0" in done.stderr
    installed = subprocess.run([sys.executable, "-c", "import fsdp2_ext"], capture_output=True)
    assert installed.returncode == 0, installed.stderr  # the installed one is in the range
