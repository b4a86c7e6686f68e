"""Spawning Gloo ranks on this machine: the one helper of the tests, the benchmarks and the demo.

    run_distributed(2, worker, *args)            # worker(rank, world_size, *args); fails loudly
    reports = gather_results(2, worker, *args)   # rank -> what worker returned (or its error)
    outcomes = run_with_faults(2, worker, *args) # ranks may die or stop on purpose

Each starts ``world_size`` fresh processes (forked from a warm server, [Note: ranks from a warm
server]), initialises a process group in each (the form VERL makes, [Note: the tests' process
group]), calls ``worker(rank, world_size, *args)``, then leaves without C++ static destructors
(``leave_cleanly``). Ranks run one torch thread each.

[Note: ranks from a warm server]
A rank that imports torch, Transformers and VERL's third-party dependencies from nothing spends
about 9 of its 11 CPU seconds of start-up there (``python -X importtime``: torch 1.4 s,
Transformers 1.4 s, then peft, tensordict, datasets, ray, ...); four ranks on this machine's two
cores wait 20 s before their first line of work, and a resume test starts ranks five times. So
ranks start from multiprocessing's ``forkserver``, which imports ``PRELOAD`` once per test session
and forks every rank from that state: each rank is still a new process (nothing of an earlier
run survives), and it holds those modules exactly as a fresh import leaves them. What stays
per-rank is what may depend on the run: VERL, fsdp2_ext's VERL side and the worker's own module
are imported in the rank, after its environment is set (VERL resolves its platform from
``VERL_*`` at import). A forked rank would otherwise see the server's environment and working
directory, fixed when it started; each rank takes the caller's (``os.environ`` and ``os.getcwd()``
at the call) before ``env`` is applied, as a spawned rank would. Only modules whose import reads
no per-run setting are preloaded. The benchmarks keep ``spawn``: they time cold starts.

[Note: the tests' process group]
VERL makes its group with a device-qualified string, ``f"cpu:gloo,{device}:{nccl}"``
(``verl/utils/distributed.py``): ``cpu:gloo,cuda:nccl`` on the cluster. Torch then reports the
group's backend as that string, never ``"gloo"``, and some of its own calls refuse such a group
(``monitored_barrier`` on torch 2.11-2.13). So every rank here uses the device-qualified form too:
``cpu:gloo`` on a CPU host (VERL's own string would be ``cpu:gloo,cpu:gloo`` there, which torch
rejects as a duplicate device type), ``cpu:gloo,cuda:nccl`` where a GPU is present. It differs from
the users' group only in having no CUDA backend. A test about the plain form passes
``backend="gloo"``.

[Note: a rank that dies of a signal]
A rank killed by a signal (a native crash: SIGSEGV, SIGABRT) leaves torch's
``ProcessExitedException`` ("process N terminated with signal S") and, from ``faulthandler``,
every thread's stack, which pytest captures with the test's output and drops when the test is
not shown. Each rank of ``run_distributed`` writes its stacks to a file of the run's own
directory instead, and the caller raises torch's exception with that rank's stacks appended: the
crash names its own place in any log that shows the error. The test fails: nothing reruns it
([Note: how a rank leaves]). The directory goes when the run ends. ``run_with_faults`` kills
ranks on purpose and keeps stderr.

[Note: how a rank leaves]
The suite's one native crash was a rank's interpreter finalizing after its work: C++ static
destructors tearing down Gloo's threads as joinable ``std::thread``s ("terminate called without
an active exception", then SIGSEGV), about 1 run in 17 of a 2-rank toy test when it was
reproduced (e99f522). So no rank finalizes: a rank that returns destroys its group and leaves
by ``os._exit`` (``leave_cleanly``); a rank that raises destroys its group and re-raises, torch's
``_wrap`` records the error for the caller and calls ``sys.exit(1)``, and the forkserver's child
leaves by ``os._exit(code)`` (``multiprocessing/forkserver.py:265-281``, Python 3.11: the forked
child of ``main``).
Under the ``spawn`` start method the ranks had before [Note: ranks from a warm server], a raising
rank finalized. ``tests/common/test_spawn.py`` checks both ways out with an ``atexit`` mark, with
``spawn`` as its negative control. The last crash seen (a 4-rank run of ``test_resume_reshard``
at c0c8873, under ``spawn``) left no stacks in the log that kept it; it has not recurred in the
fresh-clone runs since, nor in the stress runs of the files that showed it (tests/README.md).
``make test`` therefore reruns nothing: a rank that dies of a signal fails its test, with its
stacks, so that a crash is found here rather than hours into a run on the cluster.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib.util
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "DEFAULT_BACKEND",
    "free_port",
    "gather_results",
    "leave_cleanly",
    "run_distributed",
    "run_with_faults",
]


DEFAULT_BACKEND = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "cpu:gloo"
# Imported once by the fork server ([Note: ranks from a warm server]): none reads a per-run setting
# at import. Not VERL, not fsdp2_ext.verl (both resolve VERL's platform from the environment).
PRELOAD = (
    "torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint",
    "transformers", "transformers.modeling_utils", "safetensors", "peft", "accelerate",
    "tensordict", "datasets", "pandas", "pyarrow", "ray", "omegaconf", "hydra",
)  # fmt: skip
START_METHOD = "forkserver"


def _context():
    """The multiprocessing context every rank starts from; the server's preload is set before
    its first start (later calls find it running and change nothing)."""
    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload([m for m in PRELOAD if _importable(m)])
    return context


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that is missing
        return False


def _caller() -> dict:
    """What a forked rank takes from its caller, as a spawned one inherits it."""
    return {"environ": dict(os.environ), "cwd": os.getcwd()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def leave_cleanly(code: int = 0) -> None:
    """Destroys the group and exits without C++ static destructors: at interpreter exit, Gloo's
    background threads can still be torn down as joinable std::threads ("terminate called without
    an active exception", then SIGSEGV), about 1 run in 20 here, after the work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_FAULT_FILE = None  # the rank's faulthandler file, kept open for the process's life


def _rank_environment(
    rank: int, world_size: int, port: int, env: dict | None, caller: dict
) -> None:
    global _FAULT_FILE
    # A crash in native code writes every thread's stack: to a file the caller reads when the
    # rank died of a signal ([Note: a rank that dies of a signal]), else to stderr.
    if caller.get("faults"):
        _FAULT_FILE = open(os.path.join(caller["faults"], f"rank{rank}.txt"), "w")  # noqa: SIM115
        faulthandler.enable(file=_FAULT_FILE, all_threads=True)
    else:
        faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(caller["environ"])
    os.chdir(caller["cwd"])
    os.environ.update(env or {})
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)


def _entry(rank, world_size, port, env, caller, backend, worker, args, results) -> None:
    _rank_environment(rank, world_size, port, env, caller)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        value = worker(rank, world_size, *args)
    except BaseException as error:
        traceback.print_exc()
        if results is not None:
            results.put((rank, {"error": f"{type(error).__name__}: {error}"}))
        dist.destroy_process_group()
        raise
    if results is not None:
        results.put((rank, value))
    leave_cleanly()


def run_distributed(
    world_size: int,
    worker: Callable,
    *args,
    timeout_s: float = 300.0,
    env: dict | None = None,
    backend: str = DEFAULT_BACKEND,
) -> None:
    """Runs ``worker`` on every rank; a failure on any rank fails the caller with that rank's
    traceback, a hang after ``timeout_s``."""
    _run(world_size, worker, args, timeout_s, env, backend, results=None)


def gather_results(
    world_size: int,
    worker: Callable,
    *args,
    timeout_s: float = 600.0,
    env: dict | None = None,
    backend: str = DEFAULT_BACKEND,
) -> dict:
    """Runs ``worker`` on every rank; rank -> its return value (``{"error": ...}`` if it raised,
    after which the caller fails as ``run_distributed`` does)."""
    results = _context().SimpleQueue()
    _run(world_size, worker, args, timeout_s, env, backend, results=results)
    return dict(results.get() for _ in range(world_size))


def _run(world_size, worker, args, timeout_s, env, backend, results) -> None:
    _context()
    faults = tempfile.mkdtemp(prefix="fsdp2_ext_faults_")
    caller = dict(_caller(), faults=faults)
    try:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), dict(env or {}), caller, backend, worker, args, results),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        deadline = time.monotonic() + timeout_s
        while not _joined(context, faults):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"distributed run did not finish within {timeout_s:.0f} s")
    finally:
        shutil.rmtree(faults, ignore_errors=True)


def _joined(context, faults: str) -> bool:
    """``context.join``; a rank that died of a signal raises torch's error with that rank's
    faulthandler stacks appended ([Note: a rank that dies of a signal])."""
    try:
        return context.join(timeout=1.0)
    except mp.ProcessExitedException as error:
        if not error.signal_name:
            raise
        try:
            with open(os.path.join(faults, f"rank{error.error_index}.txt")) as f:
                stacks = f.read().strip() or "(empty: the signal came before any stack was written)"
        except OSError as missing:
            stacks = f"(none: {missing})"
        raise mp.ProcessExitedException(
            f"{error}; its faulthandler stacks:\n{stacks}",
            error_index=error.error_index, error_pid=error.error_pid, exit_code=error.exit_code,
            signal_name=error.signal_name,
        ) from error  # fmt: skip


def _fault_entry(rank, world_size, port, results, worker, args, env, caller, backend) -> None:
    _rank_environment(rank, world_size, port, env, caller)
    # A long group timeout: the waits under test must be bounded by fsdp2_ext, not by this.
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=30)
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
    world_size: int,
    worker: Callable,
    *args,
    timeout_s: float = 180.0,
    env: dict | None = None,
    backend: str = DEFAULT_BACKEND,
) -> dict:
    """Runs ``worker(rank, world_size, *args)`` on spawned Gloo ranks that may die or stop on
    purpose; returns rank -> (exception name or "ok", message, seconds in the worker) for the
    ranks that came back. Ranks still alive (or stopped) after ``timeout_s`` are killed."""
    context = _context()
    results = context.SimpleQueue()
    port, caller = free_port(), _caller()
    processes = [
        context.Process(
            target=_fault_entry,
            args=(r, world_size, port, results, worker, args, env, caller, backend),
        )
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
            # SIGKILL ends a stopped process as it is. Continued first (SIGCONT, as before
            # b8617dc), a rank stopped on purpose ran again before the kill and reported what its
            # stop returned (a fresh clone's run: rank 1's "TypeError" 5.19 s in).
            process.kill()
        process.join()
    while not results.empty():
        rank, *report = results.get()
        reports[rank] = tuple(report)
    return reports
