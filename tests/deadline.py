"""Turn a hang into a test failure: ``with deadline(5, "load"): ...``."""

from __future__ import annotations

import contextlib
import signal
import threading


class Hang(BaseException):
    """A call that did not finish in time: not an Exception, so nothing swallows it."""


@contextlib.contextmanager
def deadline(seconds: int, what: str):
    """Raise Hang if the block runs longer than ``seconds`` (SIGALRM; a no-op where unavailable)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise Hang(f"{what} still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
