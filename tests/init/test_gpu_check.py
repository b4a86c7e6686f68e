"""benchmarks/gpu_check.py stays runnable where no GPU is lent: ``--on-cpu`` runs the same code
(init sources, exactness, the c10d calls the profiler sees, the tables) on 2 CPU ranks over
``cpu:gloo``, and ``--help`` prints the prepared commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
pytestmark = pytest.mark.distributed


def test_help_prints_one_prepared_command_each():
    result = subprocess.run(
        [sys.executable, SCRIPT, "--help"], capture_output=True, text=True, check=True
    )
    assert "python benchmarks/gpu_check.py " in result.stdout
    assert "torchrun --standalone --nproc-per-node=2 benchmarks/gpu_check.py" in result.stdout


def test_the_multi_rank_variant_runs_on_cpu(tmp_path):
    output = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            SCRIPT,
            "--size-gib",
            "0.05",
            "--on-cpu",
            "--output",
            str(output),
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "goals met" in result.stdout
    report = json.loads(output.read_text())
    assert report["group"] == "cpu:gloo" and report["world_size"] == 2
    for path in ("rank0", "local", "checkpoint"):
        assert all(each["exact"] for each in report["paths"][path]), path
    calls = report["paths"]["rank0"][0]["calls"]
    assert calls.get("gloo:scatter", 0) >= 1 and not calls.get("gloo:send"), calls
    assert set(report["tables"]) == {"view", "host_shared"}
