"""Spawn helper for multi-rank CPU tests (Gloo), after pplx's ``parallel_launch``.

``run_distributed(world_size, worker, *args)`` starts ``world_size`` fresh processes, initialises a
Gloo process group in each (``cpu:gloo,cuda:nccl`` when a GPU is present), calls
``worker(rank, world_size, *args)`` and destroys the group. A failure on any rank fails the test
with that rank's traceback; a hang fails it after ``timeout_s``. ``run_with_faults`` is its
counterpart for fault tests: ranks may die or stop, and each survivor's outcome is returned.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, env: dict, worker: Callable, args: tuple) -> None:
    faulthandler.enable(all_threads=True)  # a crash in native code prints every thread's stack
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    # Leave without running C++ static destructors: at interpreter exit, Gloo's background threads
    # can still be torn down as joinable std::threads ("terminate called without an active
    # exception", then SIGSEGV), about 1 run in 20 here, after the test has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    world_size: int, worker: Callable, *args, timeout_s: float = 300.0, env: dict | None = None
) -> None:
    context = mp.start_processes(
        _entry,
        args=(world_size, free_port(), dict(env or {}), worker, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"distributed test did not finish within {timeout_s:.0f} s")


def _fault_entry(rank, world_size, port, results, worker, args, env=None) -> None:
    faulthandler.enable(all_threads=True)
    os.environ.update(env or {})
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.set_num_threads(1)
    # A long group timeout: the waits under test must be bounded by fsdp2_ext, not by this.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=30)
    )
    start = time.monotonic()
    try:
        worker(rank, world_size, *args)
        outcome = ("ok", "")
    except Exception as error:
        outcome = (type(error).__name__, str(error))
    results.put((rank, outcome[0], outcome[1], time.monotonic() - start))
    sys.stdout.flush()
    os._exit(0)  # never wait on a peer that is gone


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): it will report nothing until continued."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def run_with_faults(
    world_size: int, worker: Callable, *args, timeout_s: float = 180.0, env: dict | None = None
) -> dict:
    """Runs ``worker(rank, world_size, *args)`` on spawned Gloo ranks that may die or stop on
    purpose; returns rank -> (exception name or "ok", message, seconds in the worker) for the
    ranks that came back. Ranks still alive (or stopped) after ``timeout_s`` are killed."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=_fault_entry, args=(r, world_size, port, results, worker, args, env))
        for r in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    reports: dict = {}
    while time.monotonic() < deadline and any(p.is_alive() for p in processes):
        while not results.empty():
            rank, *report = results.get()
            reports[rank] = tuple(report)
        if all(
            r in reports or not p.is_alive() or _stopped(p.pid) for r, p in enumerate(processes)
        ):
            break
        time.sleep(0.2)
    for process in processes:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.join()
    while not results.empty():
        rank, *report = results.get()
        reports[rank] = tuple(report)
    return reports
