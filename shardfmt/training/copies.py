"""Copies of checkpoints behind the training: one thread, the paths being copied, the failures.

The two tiers the Checkpointer copies to share this: the archive (``archiving.Archiver``:
rank 0 copies the root's checkpoints) and the root behind a node-local tier
(``replicate.Replicator``: each node's leader copies its node's parts). Copies run one at a
time in submission order; a failed one is reported (``fail``: a warning and ``errors``),
never raised into training; retention asks ``busy(path)`` before removing a source.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundCopies:
    """One copying thread (named ``shardfmt-<name>``), started at the first ``submit``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors: list[str] = []
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future] = []
        self._busy: set[str] = set()  # sources queued or being copied: retention leaves them alone
        self._lock = threading.Lock()

    def submit(self, path: str, copy: Callable[[], None]) -> None:
        """Run ``copy`` (of the source at ``path``) on the copying thread, after those queued."""
        with self._lock:
            self._busy.add(path)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shardfmt-{self.name}")
            self._jobs.append(self._pool.submit(self._run, path, copy))

    def _run(self, path: str, copy: Callable[[], None]) -> None:
        try:
            copy()
        finally:
            with self._lock:
                self._busy.discard(path)

    def fail(self, msg: str) -> None:
        """Report a copy that failed (every retry): a warning, and kept in ``errors``."""
        self.errors.append(msg)
        warnings.warn(msg, stacklevel=3)

    def busy(self, path: str) -> bool:
        """True while the source at ``path`` is queued or being copied."""
        with self._lock:
            return path in self._busy

    def any_busy(self) -> bool:
        with self._lock:
            return bool(self._busy)

    def wait(self) -> None:
        """Block until every queued copy has finished."""
        jobs, self._jobs = self._jobs, []
        for f in jobs:
            f.result()

    def close(self) -> None:
        """Wait for the copies and stop the copying thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
