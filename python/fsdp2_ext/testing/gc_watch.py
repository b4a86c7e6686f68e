"""Which collections of Python's cyclic collector start inside given functions (tests of
[Note: the collector paused during an init])."""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
from collections.abc import Callable, Iterator

__all__ = ["collections_inside"]


@contextlib.contextmanager
def collections_inside(*functions: Callable) -> Iterator[list[tuple[str, int]]]:
    """Within the block, thresholds that make every allocation of a tracked object trip a
    collection; yields the (function name, generation) of each one that starts while one of
    ``functions`` (unwrapped from its decorators) is running. Thresholds and callbacks are
    restored afterwards."""
    codes = {inspect.unwrap(f).__code__: f.__name__ for f in functions}
    seen: list[tuple[str, int]] = []

    def callback(phase: str, info: dict) -> None:
        if phase != "start":
            return
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code in codes:
                seen.append((codes[frame.f_code], info["generation"]))
                return
            frame = frame.f_back

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*thresholds)
