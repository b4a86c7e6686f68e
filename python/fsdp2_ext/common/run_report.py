"""A machine-readable record of what fsdp2_ext did in each process of a run.

    FSDP2_EXT_REPORT_DIR=/tmp/report python -m verl.trainer.main_ppo ...
    records = read_records("/tmp/report")   # [{"kind": "trainer", "rank": 0, ...}, ...]

Off unless ``FSDP2_EXT_REPORT_DIR`` is set. Each process writes its own JSON files there (atomically:
a reader never sees half a record): the trainer ranks after their sharded init (what loaded how,
where the no-placement tables live), the ``hf`` rollout servers after each weight sync (what was
synced, where their tables live). ``make demo`` and the ``main_ppo`` tests read them to check a
run from outside its processes.
"""

from __future__ import annotations

import glob
import json
import os

__all__ = ["REPORT_ENV", "read_records", "report_dir", "write_record"]

REPORT_ENV = "FSDP2_EXT_REPORT_DIR"


def report_dir() -> str | None:
    return os.environ.get(REPORT_ENV) or None


def write_record(name: str, record: dict) -> str | None:
    """Writes ``record`` as ``<name>.json`` in the report directory; None when reports are off."""
    directory = report_dir()
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.json")
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(partial, path)
    return path


def read_records(directory: str, prefix: str = "") -> list[dict]:
    """Every record in ``directory`` whose name starts with ``prefix``, sorted by name."""
    records = []
    for path in sorted(glob.glob(os.path.join(directory, f"{prefix}*.json"))):
        with open(path) as f:
            records.append(dict(json.load(f), _file=os.path.basename(path)))
    return records
