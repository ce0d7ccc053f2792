"""The commit layer's front: the strategy of a store, and the calls a save makes through it.

``commit_strategy(store)`` picks how saves on ``store`` commit: ``RenameCommit`` on local disk
(staging dir + atomic rename/exchange), ``MarkerCommit`` on every fsspec store (in place,
LEASE first, COMMITTED last); ``commit.strategy`` describes the interface and its call order.
The functions below are that interface for callers holding a store: ``prepare``, ``publish``,
``abort`` / ``abort_own``, ``is_committed``; ``Heartbeat`` keeps a save's
lease fresh on a thread while it writes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from shardfmt.commit.marker import MarkerCommit
from shardfmt.commit.rename import RenameCommit
from shardfmt.commit.strategy import STEPS, CommitStrategy, StepHook
from shardfmt.errors import ShardfmtError
from shardfmt.format.manifest import CommitRecord, Manifest
from shardfmt.io.fsspec import FsspecStorage
from shardfmt.io.local import LocalStorage
from shardfmt.io.store import ByteStore

__all__ = ["STEPS", "CommitStrategy", "Heartbeat", "StepHook", "abort", "abort_own", "commit_strategy",
           "is_committed", "prepare", "publish"]


def commit_strategy(storage: ByteStore) -> CommitStrategy:
    """How saves on ``storage`` commit: by rename on local disk, by marker on fsspec stores."""
    if isinstance(storage, LocalStorage):
        return RenameCommit(storage)
    if isinstance(storage, FsspecStorage):
        return MarkerCommit(storage)
    raise TypeError(f"no commit strategy for a {type(storage).__name__}")


def prepare(storage: ByteStore, path: str, save_id: str, *, overwrite: bool,
            lease_seconds: float | None = None, now: float | None = None) -> str:
    """Check the destination, take the save's lease, and return where its files go."""
    return commit_strategy(storage).prepare(path, save_id, overwrite=overwrite, lease_seconds=lease_seconds,
                                            now=now)


def publish(storage: ByteStore, path: str, staging: str, manifest: Manifest,
            *, overwrite: bool = False, on_step: StepHook | None = None,
            required: Iterable[str] | None = None) -> CommitRecord:
    """Commit the files written under ``staging`` as the checkpoint at ``path``; ``required``
    names the files (relative to the checkpoint) that must still be there (default: the
    manifest's data files; a v2 root lists none, so its writer names them)."""
    return commit_strategy(storage).publish(path, staging, manifest, overwrite=overwrite, on_step=on_step,
                                            required=required)


def abort(storage: ByteStore, staging: str) -> None:
    """Remove a failed save's staging location with all in it (best effort; a leftover is
    ignorable). Where the save wrote in place, ``abort_own`` removes its own files only."""
    try:
        storage.remove_tree(staging)
    except (OSError, ShardfmtError):
        pass


def abort_own(storage: ByteStore, path: str, save_id: str) -> None:
    """Remove what the failed save ``save_id`` wrote in place under ``path``, and nothing else."""
    commit_strategy(storage).abort(path, path, save_id)


def is_committed(storage: ByteStore, path: str) -> bool:
    return commit_strategy(storage).is_committed(path)


class Heartbeat:
    """Keep a save's lease fresh while it runs, so collectors leave it alone.

    Every ``interval`` seconds the strategy's ``heartbeat`` (local disk: the staging dir's
    mtime; object stores: the ``LEASE`` object); ``lost`` once it says the lease is gone or
    another save's. ``stop`` joins the thread and, with ``release``, drops the lease.
    """

    def __init__(self, storage: ByteStore, path: str, lease_seconds: float, owner: str = "") -> None:
        self._strategy = strategy = commit_strategy(storage)
        self._path = path
        self._stop = threading.Event()
        self.lost = False  # the lease was gone or another save's at a heartbeat: never commit then
        # at least every 30 s whatever this save's lease: a collector of another job on the same
        # root judges it by its own lease (the defaults are 120 s and more), not by this one's
        self.interval = interval = max(0.5, min(lease_seconds, 120.0) / 4)

        def beat() -> None:
            while not self._stop.wait(interval):
                if strategy.heartbeat(path, owner) is False:
                    self.lost = True
                    return

        self._thread = threading.Thread(target=beat, name="shardfmt-lease", daemon=True)
        self._thread.start()

    def stop(self, *, release: bool = False) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if release:
            self._strategy.release(self._path)
