"""fsdp2_ext.testing.spawn: the ranks' start and what a failed rank leaves the caller."""

from __future__ import annotations

import ctypes
import os
import time

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


def _mark_interpreter_exit(rank, world_size, directory, raising_rank):
    """An ``atexit`` mark: it is written only if the rank's interpreter finalizes (where C++
    static destructors run and Gloo's threads crashed), never on ``os._exit``."""
    import atexit

    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # Gloo's threads have worked, as in a test's rank
    atexit.register(lambda: open(os.path.join(directory, f"rank{rank}"), "w").close())
    if rank == raising_rank:
        raise ValueError(f"rank {rank} refuses, as a rank of a refusal test does")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_every_rank_leaves_without_finalizing_the_interpreter(tmp_path, monkeypatch, start_method):
    """[Note: how a rank leaves]: the rank that returns and the rank that raises both leave by
    ``os._exit``, so the interpreter's finalization, where Gloo's threads crashed (SIGSEGV, 1 run
    in 17), never runs. ``spawn`` is the negative control: the start method the ranks had when
    the crash was last seen, whose raising rank finalizes."""
    import fsdp2_ext.testing.spawn as spawn

    monkeypatch.setattr(spawn, "START_METHOD", start_method)
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 refuses"):
        run_distributed(2, _mark_interpreter_exit, str(tmp_path), 1, timeout_s=300)
    finalized = sorted(os.listdir(tmp_path))
    assert finalized == ([] if start_method == "forkserver" else ["rank1"]), finalized


def _stops_then_reports(rank, world_size):
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # continued, it would go on and report "ok"


def test_a_rank_stopped_on_purpose_is_killed_without_running_again(monkeypatch):
    """``run_with_faults`` kills a rank still stopped at the end; it must never run again before
    its kill and report. The scheduler's gap between the harness's two signals is made 0.5 s here
    (a fresh clone's run once showed the rank reporting in that gap); with the rank continued
    before its kill, rank 1 reports "ok" (the negative control, seen before the fix)."""
    import multiprocessing.process

    from fsdp2_ext.testing.spawn import run_with_faults

    kill = multiprocessing.process.BaseProcess.kill

    def slow_kill(process):
        time.sleep(0.5)
        kill(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "kill", slow_kill)
    reports = run_with_faults(2, _stops_then_reports, timeout_s=60)
    assert reports.get(0, ("",))[0] == "ok", reports
    assert 1 not in reports, reports
