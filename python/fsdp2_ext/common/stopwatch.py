"""Named laps of one clock: the per-stage seconds an init records (``stage_seconds``)."""

from __future__ import annotations

import time

__all__ = ["Stopwatch"]


class Stopwatch:
    """Each ``lap(name)`` stores the seconds since the previous lap (or the start) in ``stages``."""

    def __init__(self, stages: dict[str, float]) -> None:
        self.stages, self.clock = stages, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = now - self.clock
        self.clock = now
