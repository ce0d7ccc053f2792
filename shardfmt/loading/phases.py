"""Where a load's (and a restore's) time goes: seconds per named phase."""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseClock:
    """Seconds spent in each named phase: ``with clock("read"): ...`` adds to ``seconds["read"]``
    (a phase entered more than once adds up; the time counts even when the block raises)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


__all__ = ["PhaseClock"]
