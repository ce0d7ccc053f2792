"""The Checkpointer's archive tier: which committed steps to copy, copied in the background, retried.

Rank 0 queues a copy of a committed checkpoint whenever ⌊step / every⌋ exceeds that of the last
one archived (the archive is listed once, at the first save; again after a failed copy, so the
next save of the bucket tries again). One thread copies (``archive.copy_checkpoint``: streamed,
verified by hashes there, then committed there); a failed copy is retried with backoff and
reported as a warning and in ``errors``, never raised into training. Retention leaves a
checkpoint alone while it is being copied (``busy``).
"""

from __future__ import annotations

import warnings

from shardfmt.commit.names import parse_step_dir, step_dir_name
from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import ShardfmtError
from shardfmt.io.store import Storage
from shardfmt.training.archive import copy_checkpoint, copy_with_retries
from shardfmt.training.copies import BackgroundCopies
from shardfmt.training.options import ArchivePolicy
from shardfmt.training.roots import checkpoint_status, collect_garbage

_FAILURES = (ShardfmtError, OSError)


class Archiver(BackgroundCopies):
    """Copy committed checkpoints of ``storage`` to ``archive_root`` on ``archive_storage`` per ``policy``."""

    def __init__(self, storage: Storage, archive_storage: Storage, archive_root: str, policy: ArchivePolicy) -> None:
        super().__init__("archive")
        self.storage = storage
        self.archive_storage, self.archive_root = archive_storage, archive_root
        self.policy = policy
        self._last_archived_bucket: int | None = None

    def _archived_steps(self) -> list[int]:
        st, root = self.archive_storage, self.archive_root
        if not st.exists(root):
            return []
        return sorted(s for name in st.listdir(root) if (s := parse_step_dir(name)) is not None
                      and checkpoint_status(st, st.join(root, name), markers_only=True)[0] == "committed")

    def schedule(self, step: int, path: str) -> None:
        """Queue a background copy of ``step`` (at ``path``) when its ⌊step / every⌋ is new."""
        with self._lock:
            if self._last_archived_bucket is None:
                try:
                    done = self._archived_steps()
                except _FAILURES as e:
                    done = []
                    warnings.warn(f"{self.archive_root}: cannot list the archive: {e}", stacklevel=3)
                self._last_archived_bucket = max((s // self.policy.every for s in done), default=-1)
            bucket = step // self.policy.every
            if bucket <= self._last_archived_bucket:
                return
            self._last_archived_bucket = bucket
        self.submit(path, lambda: self.copy(step, path))

    def copy(self, step: int, path: str) -> None:
        """Copy ``step`` (at ``path``) to the archive, with retries; report a failure, never raise it."""
        dst = self.archive_storage.join(self.archive_root, step_dir_name(step))
        where = self.archive_storage.url(dst)

        def retry(i: int, e: BaseException) -> None:
            warnings.warn(f"archiving step {step} to {where} failed (attempt {i} of {self.policy.attempts}, "
                          f"retrying): {e}", stacklevel=2)

        try:  # a copy killed part-way (its lease expired) would block copying that checkpoint again;
            if not commit_strategy(self.archive_storage).in_place:  # in place: prepare() clears dst's dead leftover
                collect_garbage(self.archive_storage, self.archive_root)
        except _FAILURES as e:
            warnings.warn(f"{self.archive_storage.url(self.archive_root)}: collecting leftovers failed: {e}",
                          stacklevel=2)
        try:
            strategy = commit_strategy(self.archive_storage)
            if strategy.marked_rolled_back(dst) or strategy.marked_quarantined(dst):  # set aside in place: replaced
                self.archive_storage.remove_tree(dst)
            copy_with_retries(lambda: copy_checkpoint(self.storage, path, self.archive_storage, dst),
                              attempts=self.policy.attempts, backoff=self.policy.backoff, on_retry=retry)
        except Exception as e:  # noqa: BLE001 - never into training: reported instead
            self.fail(f"archiving step {step} to {where} failed: {type(e).__name__}: {e}")
            with self._lock:  # the bucket has no copy: the next save (re-listing the archive) tries again
                self._last_archived_bucket = None

    def forget(self) -> None:
        """List the archive again at the next save (after a rollback set archived steps aside)."""
        with self._lock:
            self._last_archived_bucket = None
