"""The project's one logger, shared with the C++ core (spdlog, rank-prefixed).

Level from ``FSDP2_EXT_LOG_LEVEL`` (trace|debug|info|warn|error|off, default info).
"""

from __future__ import annotations

from fsdp2_ext._fsdp2_ext import LogLevel, log_enabled, set_log_rank
from fsdp2_ext._fsdp2_ext import log as _log

__all__ = ["debug", "info", "warn", "error", "set_log_rank", "enabled"]


def debug(text: str) -> None:
    _log(LogLevel.DEBUG, text)


def info(text: str) -> None:
    _log(LogLevel.INFO, text)


def warn(text: str) -> None:
    _log(LogLevel.WARN, text)


def error(text: str) -> None:
    _log(LogLevel.ERROR, text)


def enabled(level: LogLevel) -> bool:
    return log_enabled(level)
