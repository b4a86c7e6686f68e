"""A pytest plugin that imports the shim before anything else: ``pytest -p
fsdp2_ext.testing.verl_shim_first ...`` runs a test suite (VERL's own) with ``fsdp2_ext.verl``
installed, as ``VERL_USE_EXTERNAL_MODULES`` would install it. With ``REPORT_ENV`` set, it writes
there, one per line, every VERL holder the shim rewrote, so the caller can tell that it was in
place for the whole session."""

from __future__ import annotations

import os

import fsdp2_ext.verl as shim

REPORT_ENV = "FSDP2_EXT_SHIM_FIRST_REPORT"


def pytest_sessionfinish(session, exitstatus) -> None:
    if os.environ.get(REPORT_ENV):
        with open(os.environ[REPORT_ENV], "w") as report:
            report.write("\n".join(shim.installed()))
