"""A probe for tests of a real ``main_ppo`` run: is the shim installed in every process?

    VERL_USE_EXTERNAL_MODULES=fsdp2_ext.verl_cpu.plugin,fsdp2_ext.verl,fsdp2_ext.testing.actor_probe

Imported by VERL (after the shim) in every process of the run, it writes ``probe-<pid>.json``
into ``FSDP2_EXT_REPORT_DIR`` until the process ends: which Ray actor the process is, whether
``fsdp2_ext.verl`` is installed, and every loaded module global still holding one of VERL's
originals (``PatchSet.remaining_originals``; the shim must leave none). The last record a process
wrote is its state when it ended. Only for tests: it starts a thread in every process.

A snapshot reads every global of every loaded module (about 22 ms of CPU with VERL loaded). Taken
twice a second in each of a run's dozen processes it cost a probed ``main_ppo`` run about 90
CPU-s of the suite's two cores. So the thread looks twice a second at what makes a new holder
appear, a module imported (``len(sys.modules)``, the shim's waiting patches included), and takes a
snapshot when that changed, and at least every ``HEARTBEAT_S`` otherwise (a global rebound
without an import).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from fsdp2_ext.common.run_report import report_dir, write_record

__all__ = ["snapshot"]


def _actor_class() -> str:
    if "ray" not in sys.modules:
        return "driver"
    import ray

    if not ray.is_initialized():  # never ray's own auto-init: the driver has not started it yet
        return "driver"
    try:
        handle = ray.get_runtime_context().current_actor
    except Exception:  # not an actor: the driver, or a task
        return "driver"
    return handle._ray_actor_creation_function_descriptor.class_name


def snapshot() -> dict:
    import fsdp2_ext.verl as shim
    from fsdp2_ext.verl.targets import SHIM

    return {
        "kind": "probe",
        "pid": os.getpid(),
        "actor": _actor_class(),
        "shim_installed": bool(shim.installed()),
        "remaining_originals": SHIM.remaining_originals(),
        "verl_modules": sum(1 for name in list(sys.modules) if name.startswith("verl.")),
    }


POLL_S = 0.5
HEARTBEAT_S = 5.0


def _watch() -> None:
    modules, taken = -1, 0.0
    while True:
        if len(sys.modules) != modules or time.monotonic() - taken >= HEARTBEAT_S:
            modules, taken = len(sys.modules), time.monotonic()
            try:
                write_record(f"probe-{os.getpid()}", snapshot())
            except Exception as error:  # never take the process down
                write_record(f"probe-{os.getpid()}", {"kind": "probe", "error": repr(error)})
        time.sleep(POLL_S)


if report_dir() is not None:
    threading.Thread(target=_watch, name="fsdp2_ext-actor-probe", daemon=True).start()
