"""fsdp2_ext.testing.spawn: the ranks' start and what a failed rank leaves the caller."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch.multiprocessing as mp

from fsdp2_ext.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed


def _crash_on_rank_1(rank, world_size):
    if rank == 1:
        ctypes.string_at(0)  # a native crash: SIGSEGV reading address 0


def test_a_rank_that_dies_of_a_signal_names_its_stacks():
    """[Note: a rank that dies of a signal]: torch's error, with the rank's faulthandler stacks
    (the crashing frame among them), not only "terminated with signal"."""
    with pytest.raises(mp.ProcessExitedException) as raised:
        run_distributed(2, _crash_on_rank_1, timeout_s=120)
    message = str(raised.value)
    assert raised.value.error_index == 1 and raised.value.signal_name == "SIGSEGV", message
    assert "process 1 terminated with signal SIGSEGV" in message
    assert "Fatal Python error: Segmentation fault" in message, message
    assert "_crash_on_rank_1" in message, message


def _environment(rank, world_size, name):
    assert os.environ[name] == "from the caller", os.environ.get(name)
    assert os.getcwd() == os.environ["EXPECTED_CWD"]


def test_a_rank_takes_the_caller_s_environment_and_directory_at_the_call(monkeypatch, tmp_path):
    """[Note: ranks from a warm server]: the server started before this test set anything; each
    rank still sees the caller's environment and working directory as they are at the call."""
    monkeypatch.setenv("FSDP2_EXT_TEST_FROM_CALLER", "from the caller")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXPECTED_CWD", str(tmp_path))
    run_distributed(2, _environment, "FSDP2_EXT_TEST_FROM_CALLER", timeout_s=120)
