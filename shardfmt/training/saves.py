"""The Checkpointer's background saves: the staging buffers they share and the handles not yet waited for.

A failed background save is kept until ``wait()`` raises its error (the first one's), and is
warned about once, at the next ``save``, so a training loop that never waits still hears of it.
The staging buffers (``saving.async_save.Stager``) are allocated by the first async save and
reused by every later one; ``release`` drops them.
"""

from __future__ import annotations

import warnings
import weakref

from shardfmt.errors import ShardfmtError
from shardfmt.saving.async_save import AsyncSave, Stager

_FAILURES = (ShardfmtError, OSError)


class PendingSaves:
    """Background saves of one Checkpointer, oldest first."""

    def __init__(self) -> None:
        self._stager: Stager | None = None  # async saves' staging buffers, created on the first one
        self._pending: list[AsyncSave] = []  # not yet waited for (failed ones until wait() raises)
        self._warned: weakref.WeakSet = weakref.WeakSet()  # failed saves already warned about

    def stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager()
        return self._stager

    def warn_failed(self) -> None:
        """Warn once about each background save that failed (``wait()`` raises it)."""
        for h in self._pending:
            if h.done() and h.exception() is not None and h not in self._warned:
                self._warned.add(h)
                warnings.warn(f"the background save to {h.path} failed (wait() raises it): {h.exception()}",
                              stacklevel=3)

    def add(self, handle: AsyncSave) -> None:
        # a failed save is kept until wait() raises it
        self._pending = [h for h in self._pending if not h.done() or h.exception() is not None] + [handle]

    def wait(self) -> None:
        """Block until every background save has finished; raise the first one's error."""
        pending, self._pending = self._pending, []
        errors = []
        for h in pending:
            try:
                h.wait()
            except _FAILURES as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def release(self) -> None:
        """Drop the staging buffers."""
        if self._stager is not None:
            self._stager.release()
