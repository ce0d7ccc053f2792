"""The rename strategy (filesystems): stage in a ``.tmp-`` dir, publish with one atomic rename.

Steps of ``publish`` (each hook name after it completes; tests raise from it to crash there)::

    1) every data file was written into ``<path>.tmp-<save_id>/data/`` and fsynced
                                                                      step "files_written"
    2) ``manifest.json`` is written and fsynced                      step "manifest_written"
    3) ``COMMITTED`` (manifest digest + save id) is written, fsynced  step "committed_written"
    4) the staging dir and its data dir are fsynced                   step "staging_synced"
    5) publish: rename staging -> ``<path>``; if a committed checkpoint is already there
       (``overwrite=True``) the two are swapped atomically with renameat2(RENAME_EXCHANGE),
       falling back to rename-aside where unsupported: ``<path>`` -> ``<path>.old-<save_id>``
       ("set_aside"; readers that find no ``<path>`` use that committed aside copy), then
       staging -> ``<path>``                                          step "published"
    6) the parent dir is fsynced                                      step "parent_synced"
    7) the previous checkpoint, now in the staging name, is removed   step "cleaned"

A crash at any point leaves ``<path>`` absent or committed, never torn; after step 5 the new
checkpoint is the one at ``<path>``. A save's lease is its staging dir's mtime, touched by
its heartbeat; a staging dir whose lease expired is a dead save's, for the collector.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable

from shardfmt.commit.strategy import (
    LeftoverState,
    StepHook,
    is_save_file,
    require_utf8,
)
from shardfmt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    ShardfmtError,
    StorageError,
)
from shardfmt.format import hashing
from shardfmt.format.manifest import (
    BASES_NAME,
    COMMITTED_NAME,
    DATA_DIR,
    INDEX_DIR,
    MANIFEST_NAME,
    CommitRecord,
    Manifest,
)
from shardfmt.io.local import LocalStorage

_STAGING_RE = re.compile(r".+\.tmp-[0-9a-f]{16}")  # <name>.tmp-<save id> (spec section 2)


def staging_path(path: str, save_id: str) -> str:
    return f"{path}.tmp-{save_id}"


def aside_path(path: str, save_id: str) -> str:
    return f"{path}.old-{save_id}"


def _parent(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) or "."


class RenameCommit:
    """Commit on a filesystem by staging and atomic rename (see the module docstring)."""

    in_place = False

    def __init__(self, store: LocalStorage) -> None:
        self.store = store

    # -- 1) prepare
    def prepare(self, path: str, save_id: str, *, overwrite: bool,
                lease_seconds: float | None = None, now: float | None = None) -> str:
        """Check the destination, create ``<path>.tmp-<save_id>/data``; return the staging dir."""
        st = self.store
        require_utf8(path)
        if st.exists(path):
            if self.is_committed(path):
                if not overwrite:
                    raise CheckpointExistsError(f"{st.url(path)}: a committed checkpoint is already there "
                                                "(pass overwrite=True / --overwrite to replace it)")
            elif not st.isdir(path):  # never replaced, not even with overwrite: it is no checkpoint
                raise CheckpointExistsError(f"{path}: is a file, not a checkpoint directory; refusing to replace it")
            elif st.listdir(path) and not overwrite:
                raise CheckpointExistsError(
                    f"{path}: exists, is not empty and is not a committed checkpoint; refusing to replace it "
                    "(pass overwrite=True / --overwrite)")
        target = staging_path(path, save_id)
        if st.exists(target):
            raise CommitError(f"{target}: staging location already exists (save id reused?)")
        st.makedirs(st.join(target, DATA_DIR))
        return target

    # -- 3) publish
    def publish(self, path: str, staging: str, manifest: Manifest, *, overwrite: bool = False,
                on_step: StepHook | None = None, required: Iterable[str] | None = None) -> CommitRecord:
        """Run steps 2-7 for files already written under ``staging``.

        Without ``overwrite``, a checkpoint that appeared at ``path`` while this save was
        writing (a racing save of the same step) wins: this one raises CheckpointExistsError.
        """
        st, step = self.store, on_step or (lambda name: None)
        step("files_written")
        manifest_bytes = manifest.to_json()
        record = CommitRecord(save_id=manifest.save_id, manifest_digest=hashing.digest_bytes(manifest_bytes),
                              format_version=manifest.format_version)
        st.write_bytes(st.join(staging, MANIFEST_NAME), manifest_bytes)
        step("manifest_written")
        st.write_bytes(st.join(staging, COMMITTED_NAME), record.to_json())
        step("committed_written")
        st.sync_dir(st.join(staging, DATA_DIR))
        if manifest.format_version >= 2 and st.isdir(st.join(staging, INDEX_DIR)):
            st.sync_dir(st.join(staging, INDEX_DIR))
        st.sync_dir(staging)
        step("staging_synced")
        old = self._swap_in(path, staging, manifest.save_id, overwrite=overwrite, step=step)
        step("published")
        st.sync_dir(_parent(path))
        step("parent_synced")
        if old is not None:
            st.remove_tree(old)
        step("cleaned")
        return record

    def _swap_in(self, path: str, staging: str, save_id: str, *, overwrite: bool, step: StepHook) -> str | None:
        """Step 5: put ``staging`` at ``path``; return where the previous checkpoint went (None: there was none)."""
        st = self.store
        if not st.exists(path):
            try:
                st.rename(staging, path)
            except StorageError:
                if st.exists(path) and not overwrite:
                    raise CheckpointExistsError(f"{path}: another save published here first") from None
                raise
            return None
        if not overwrite and self.is_committed(path):
            raise CheckpointExistsError(f"{path}: another save published here first")
        if st.isdir(path) and not st.listdir(path):
            st.rename(staging, path)  # replaces an empty directory atomically
            return None
        try:
            st.exchange(staging, path)
            return staging
        except StorageError:
            old = aside_path(path, save_id)
            st.rename(path, old)
            step("set_aside")
            st.rename(staging, path)
            return old

    def abort(self, path: str, staging: str, save_id: str) -> None:
        """Remove a failed save's staging dir (best effort; a leftover is ignorable)."""
        try:
            self.store.remove_tree(staging)
        except (OSError, ShardfmtError):
            pass

    # -- 2) and 4): the lease is the staging dir's mtime; the staging dir is the save's own
    def heartbeat(self, staging: str, owner: str) -> bool:
        self.store.touch(staging)
        return True

    def release(self, staging: str) -> None:
        pass  # the staging dir is gone once published

    def lease_time(self, path: str) -> float:
        return self.store.mtime(path)

    # -- readers and root policy
    def is_committed(self, path: str) -> bool:
        return self.store.exists(self.store.join(path, COMMITTED_NAME))

    def resolve(self, path: str) -> str:
        """Return ``path``, or the committed ``<path>.old-*`` an interrupted overwrite left."""
        if self.store.exists(path):
            return path
        aside = self.committed_aside(path)
        if aside is not None:
            return aside
        raise CheckpointNotFoundError(f"{path}: no checkpoint there")

    def committed_aside(self, path: str) -> str | None:
        """Return a committed ``<path>.old-*`` left by a rename-aside overwrite that crashed."""
        prefix = posixpath.basename(path.rstrip("/")) + ".old-"
        try:
            names = self.store.listdir(_parent(path))
        except ShardfmtError:
            return None
        for name in names:
            cand = self.store.join(_parent(path), name)
            if name.startswith(prefix) and self.is_committed(cand):
                return cand
        return None

    def marked_quarantined(self, path: str) -> bool:
        return False  # a quarantined checkpoint is renamed: its name says so

    def quarantine(self, path: str, dest: str, reason: str) -> None:
        """Set ``path`` aside as unusable: rename it to ``dest`` (no longer a step dir)."""
        self.store.rename(path, dest)

    def marked_rolled_back(self, path: str) -> bool:
        return False  # a rolled-back checkpoint is renamed: its name says so

    def roll_back(self, path: str, dest: str, reason: str) -> None:
        """Set ``path`` aside after a rollback: rename it to ``dest`` (no longer a step dir)."""
        self.store.rename(path, dest)

    def may_be_leftover(self, name: str) -> bool:
        return ".tmp-" in name

    def leftover_state(self, root: str, name: str) -> LeftoverState:
        """"leftover" for a save's staging dir: its name, and nothing in it but what a save writes:
        a real directory (not a link) of regular files with a save's names (``list_tree`` refuses
        a link, FIFO or device anywhere in it: then it is kept); else "keep" ("notes.tmp-2024.txt",
        "photos.tmp-backup/": a user's, not a save's)."""
        path = self.store.join(root, name)
        if not _STAGING_RE.fullmatch(name) or not self.store.isdir(path):
            return "keep"
        names = self.store.list_tree(path, within=root)
        return "leftover" if all(n in (MANIFEST_NAME, COMMITTED_NAME, BASES_NAME) or is_save_file(n)
                                 for n in names) else "keep"

    def dead_uploads(self, root: str) -> list[tuple[str, str]]:
        return []  # a file is written in place: no upload outlives its writer

    def abort_upload(self, path: str, upload_id: str) -> None:
        raise StorageError(f"{path}: local disk has no uploads to abort")
