"""The project's logger: ``logging.getLogger("fsdp2_ext")``, shared with the C++ core.

Records go through Python's logging, so VERL's and Ray's handlers (on the root logger) see them;
the C++ core's messages are forwarded into the same logger. While nobody has configured logging
(no handler on the root logger), a fallback handler prints them to stderr as
``[fsdp2_ext I rank 0] ...``. Level from ``FSDP2_EXT_LOG_LEVEL`` (trace|debug|info|warn|error|off,
default info), or ``set_level``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext._fsdp2_ext import LogLevel

__all__ = ["LOGGER", "debug", "enabled", "error", "info", "set_level", "set_log_rank", "warn"]

LOGGER = logging.getLogger("fsdp2_ext")
TRACE = 5
_PYTHON_LEVEL = {
    LogLevel.TRACE: TRACE,
    LogLevel.DEBUG: logging.DEBUG,
    LogLevel.INFO: logging.INFO,
    LogLevel.WARN: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.OFF: logging.CRITICAL + 10,
}
_BY_NAME = {"trace": LogLevel.TRACE, "debug": LogLevel.DEBUG, "info": LogLevel.INFO,
            "warn": LogLevel.WARN, "warning": LogLevel.WARN, "error": LogLevel.ERROR,
            "off": LogLevel.OFF}  # fmt: skip
_SHORT = {TRACE: "T", logging.DEBUG: "D", logging.INFO: "I", logging.WARNING: "W",
          logging.ERROR: "E", logging.CRITICAL: "C"}  # fmt: skip
_rank = -1


class _PrefixFilter(logging.Filter):
    """Adds ``record.fsdp2_prefix``: ``fsdp2_ext I rank 0``."""

    def filter(self, record: logging.LogRecord) -> bool:
        short = _SHORT.get(record.levelno, record.levelname)
        record.fsdp2_prefix = f"fsdp2_ext {short}" + (f" rank {_rank}" if _rank >= 0 else "")
        return True


class _UnconfiguredHandler(logging.Handler):
    """Prints the records while the application has configured no logging (root has no
    handler); once it has, they reach its handlers by propagation and this one stays quiet."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(f"[{record.fsdp2_prefix}] {record.getMessage()}\n")
        except Exception:
            self.handleError(record)


def set_level(level: LogLevel | str) -> None:
    """Sets the level of both the Python logger and the C++ core."""
    level = _BY_NAME[level.lower()] if isinstance(level, str) else level
    _fsdp2_ext.set_log_level(level)
    LOGGER.setLevel(_PYTHON_LEVEL[level])


def set_log_rank(rank: int) -> None:
    """The rank shown in every line (``-1`` hides it)."""
    global _rank
    _rank = rank
    _fsdp2_ext.set_log_rank(rank)


def _from_cpp(level: int, text: str) -> None:
    LOGGER.log(_PYTHON_LEVEL[LogLevel(level)], text)


def _log(level: LogLevel, text: str) -> None:
    LOGGER.log(_PYTHON_LEVEL[level], text)


def debug(text: str) -> None:
    _log(LogLevel.DEBUG, text)


def info(text: str) -> None:
    _log(LogLevel.INFO, text)


def warn(text: str) -> None:
    _log(LogLevel.WARN, text)


def error(text: str) -> None:
    _log(LogLevel.ERROR, text)


def enabled(level: LogLevel) -> bool:
    return LOGGER.isEnabledFor(_PYTHON_LEVEL[level])


LOGGER.addFilter(_PrefixFilter())
LOGGER.addHandler(_UnconfiguredHandler())
set_level(_BY_NAME.get(os.environ.get("FSDP2_EXT_LOG_LEVEL", "info").lower(), LogLevel.INFO))
_fsdp2_ext.set_log_forwarder(_from_cpp)
atexit.register(_fsdp2_ext.set_log_forwarder, None)  # C++ messages after exit go to stderr
