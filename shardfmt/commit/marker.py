"""The marker strategy (object stores): write in place, take a LEASE first, COMMITTED last.

Object stores cannot rename a prefix, so there is no staging location: a save writes its
data objects (named with its save id) and manifest straight under ``<path>``, and the
``COMMITTED`` object, written last and only if absent, is the commit (spec section 7)::

    1) prepare: refuse a committed ``<path>`` (no overwrite here) or a live save's; remove a
       dead save's leftover; take ``<path>/LEASE`` only if absent (of two saves starting
       together, one goes on)
    2) data objects; the heartbeat rewrites LEASE while this save still holds it
    3) publish: ``manifest.json`` only if absent                       step "manifest_written"
       every data file of the manifest still there (a collector that thought this save dead
       removed nothing), then ``COMMITTED`` only if absent, read back   step "committed_written"
                                                                        step "published"
    4) release: LEASE removed

An uncommitted prefix holding only what a save writes, LEASE included, is a save's: dead
once its lease expired (or its holder, on this host, no longer runs), live before. Anything
else there is not ours to remove.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import orjson

from shardfmt.commit.lease import holder_is_dead, lease_owner, lease_record
from shardfmt.commit.names import parse_step_dir
from shardfmt.commit.strategy import (
    SAVE_NAMES,
    LeftoverState,
    StepHook,
    is_data_file,
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
    LEASE_NAME,
    MANIFEST_NAME,
    MAX_COMMITTED_BYTES,
    MAX_MANIFEST_BYTES,
    QUARANTINED_NAME,
    ROLLED_BACK_NAME,
    CommitRecord,
    Manifest,
)
from shardfmt.format.parse import parse_commit
from shardfmt.io.fsspec import FsspecStorage


class MarkerCommit:
    """Commit on an object store with COMMITTED written last (see the module docstring)."""

    in_place = True

    def __init__(self, store: FsspecStorage) -> None:
        self.store = store

    # -- 1) prepare
    def prepare(self, path: str, save_id: str, *, overwrite: bool,
                lease_seconds: float | None = None, now: float | None = None) -> str:
        """Check the destination, take its lease; return ``path`` (files go straight there).

        An uncommitted prefix is a dead save's leftover once its lease has expired, and is
        removed; while its lease is fresh it is a save in progress and this save refuses to start.
        """
        st = self.store
        require_utf8(path)
        if "/" not in path.strip("/"):
            raise StorageError(f"{st.url(path)}: a checkpoint cannot live at a bucket's root; "
                               "give a prefix (e.g. s3://bucket/run1/step_000000100)")
        if st.exists(path):
            if self.is_committed(path):
                if not overwrite:
                    raise CheckpointExistsError(
                        f"{st.url(path)}: a committed checkpoint is already there "
                        "(pass overwrite=True / --overwrite to replace it)")
                raise CommitError(f"{st.url(path)}: overwriting a checkpoint on this storage is not supported; "
                                  "save to a new path")
            self._clear_leftover(path, overwrite=overwrite,
                                 lease=st.lease_seconds if lease_seconds is None else lease_seconds,
                                 now=time.time() if now is None else now)
        st.makedirs(st.join(path, DATA_DIR))
        self.take_lease(path, save_id)
        return path

    def take_lease(self, path: str, owner: str) -> None:
        """Take the lease on ``path`` for save ``owner``: create its LEASE object only if absent
        (of two saves starting together, one goes on)."""
        try:
            self.store.write_bytes(self.store.join(path, LEASE_NAME), lease_record(owner), exclusive=True)
        except CheckpointExistsError:
            raise CheckpointExistsError(f"{self.store.url(path)}: another save started here at the same time") from None

    def _clear_leftover(self, path: str, *, overwrite: bool, lease: float, now: float) -> None:
        """Remove a dead save's leftover at ``path``; refuse a live save's or anything else."""
        st = self.store
        names = st.list_tree(path)
        if not names:
            return
        if not is_save_leftover(st, path, names):
            if not overwrite:
                raise CheckpointExistsError(
                    f"{st.url(path)}: holds objects that are not a shardfmt checkpoint; refusing to replace "
                    "them (pass overwrite=True / --overwrite)")
        else:
            age = now - self.lease_time(path)
            if age <= lease and not holder_is_dead(st, path):
                raise CheckpointExistsError(
                    f"{st.url(path)}: another save is in progress there (its lease was refreshed "
                    f"{age:.0f} s ago; a dead save's leftover is removed once its {lease:.0f} s lease expires)")
        st.remove_tree(path)

    # -- 3) publish
    def publish(self, path: str, staging: str, manifest: Manifest, *, overwrite: bool = False,
                on_step: StepHook | None = None, required: Iterable[str] | None = None) -> CommitRecord:
        """Write the manifest and then COMMITTED under ``staging`` (= ``path``), each only if absent.

        A save that outlived its lease never replaces a racing save's manifest or marker, and
        never commits once a data file of its own has vanished (collected as dead)."""
        st, step = self.store, on_step or (lambda name: None)
        if self.is_committed(staging):
            raise CheckpointExistsError(f"{st.url(path)}: another save committed here first")
        step("files_written")
        manifest_bytes = manifest.to_json()
        record = CommitRecord(save_id=manifest.save_id, manifest_digest=hashing.digest_bytes(manifest_bytes),
                              format_version=manifest.format_version)
        mpath = st.join(staging, MANIFEST_NAME)
        try:
            st.write_bytes(mpath, manifest_bytes, exclusive=True)
        except CheckpointExistsError:
            # ours if a retried PUT's first attempt landed (its reply lost)
            if st.read_bytes(mpath, limit=MAX_MANIFEST_BYTES, within=staging) != manifest_bytes:
                raise CheckpointExistsError(f"{st.url(path)}: another save wrote its manifest here (this save "
                                            "outlived its lease?); nothing of it was replaced") from None
        step("manifest_written")
        self._require_files(path, staging, manifest.files if required is None else required)
        marker = st.join(staging, COMMITTED_NAME)
        try:
            st.write_bytes(marker, record.to_json(), exclusive=True)
        except CheckpointExistsError:
            # A retried PUT whose first attempt landed (its reply lost) also ends here: ours, then.
            if self._marker(staging) != record:
                raise CheckpointExistsError(f"{st.url(path)}: another save committed here first") from None
        step("committed_written")
        # Where the store cannot write "only if absent", a racing save could have replaced
        # our marker: read it back, so a save never reports a commit that is not its own.
        if self._marker(staging) != record:
            raise CheckpointExistsError(f"{st.url(path)}: another save committed here at the same time")
        step("published")
        return record

    def _marker(self, staging: str) -> CommitRecord:
        marker = self.store.join(staging, COMMITTED_NAME)
        return parse_commit(self.store.read_bytes(marker, limit=MAX_COMMITTED_BYTES, within=staging), source=marker)

    def _require_files(self, path: str, staging: str, required: Iterable[str]) -> None:
        """Refuse to commit when a file the save wrote was removed under us (a collector that
        thought this save dead)."""
        st = self.store
        required = sorted(required)
        if not required:
            return
        try:
            present = set(st.list_tree(staging))
        except CheckpointNotFoundError:
            present = set()
        gone = [f for f in required if f not in present]
        if gone:
            raise CommitError(f"{st.url(path)}: file(s) {gone[:3]} vanished before the commit")

    def abort(self, path: str, staging: str, save_id: str) -> None:
        """Remove what the failed save ``save_id`` wrote under ``path``, and nothing else: another
        save may have taken the prefix over (this one outlived its lease). Its LEASE goes too
        once nothing of another save's is left. Never a committed checkpoint."""
        st = self.store
        try:
            if self.is_committed(path):
                return
            names = st.list_tree(path)
            tag = f".{save_id}.safetensors"
            mine = [n for n in names if is_data_file(n) and n.endswith(tag)
                    or n.startswith(INDEX_DIR + "/") and n.endswith(f".{save_id}.json")]  # v2 indexes
            if MANIFEST_NAME in names and self._manifest_save_id(path) == save_id:
                mine.append(MANIFEST_NAME)
            for n in mine:
                st.remove_tree(st.join(path, n))
            if set(names) - set(mine) <= {LEASE_NAME, BASES_NAME}:
                if lease_owner(st, path) in (save_id, None):  # never the LEASE of a save that took over
                    st.remove_tree(path)
        except (OSError, ShardfmtError):
            pass  # best effort: a leftover is collected once its lease expires

    def _manifest_save_id(self, path: str) -> object:
        try:
            raw = self.store.read_bytes(self.store.join(path, MANIFEST_NAME), limit=MAX_MANIFEST_BYTES, within=path)
            return orjson.loads(raw).get("save_id")
        except (ShardfmtError, ValueError, AttributeError):
            return None

    # -- 2) and 4): the lease is the LEASE object
    def heartbeat(self, staging: str, owner: str) -> bool:
        """Refresh the lease of save ``owner`` under ``staging`` (its LEASE object); False, writing
        nothing, when the lease is gone or another save's: this save outlived its lease and the
        prefix was collected or taken over."""
        st = self.store
        try:
            if owner and lease_owner(st, staging) != owner:
                return False
            st.write_bytes(st.join(staging, LEASE_NAME), lease_record(owner))
        except StorageError:
            pass  # a missed heartbeat shortens the lease; the save itself reports real failures
        return True

    def release(self, staging: str) -> None:
        self.store.discard(self.store.join(staging, LEASE_NAME))  # a leftover LEASE of a committed checkpoint is harmless

    def lease_time(self, path: str) -> float:
        """The lease time of ``path``: its LEASE object's, else its newest object's LastModified."""
        try:
            return self.store.object_time(self.store.join(path, LEASE_NAME))
        except CheckpointNotFoundError:
            return self.store.newest_time(path)

    # -- readers and root policy
    def is_committed(self, path: str) -> bool:
        return self.store.exists(self.store.join(path, COMMITTED_NAME))

    def resolve(self, path: str) -> str:
        return path  # no renames, so no aside copies; a missing marker says "no checkpoint"

    def marked_quarantined(self, path: str) -> bool:
        return self.store.exists(self.store.join(path, QUARANTINED_NAME))

    def quarantine(self, path: str, dest: str, reason: str) -> None:
        """Set ``path`` aside in place (no rename): a ``QUARANTINED`` object saying why."""
        self.store.write_bytes(self.store.join(path, QUARANTINED_NAME), reason.encode())

    def marked_rolled_back(self, path: str) -> bool:
        return self.store.exists(self.store.join(path, ROLLED_BACK_NAME))

    def roll_back(self, path: str, dest: str, reason: str) -> None:
        """Set ``path`` aside after a rollback, in place (no rename): a ``ROLLED_BACK`` object saying why."""
        self.store.write_bytes(self.store.join(path, ROLLED_BACK_NAME), reason.encode())

    def may_be_leftover(self, name: str) -> bool:
        return ".tmp-" in name or parse_step_dir(name) is not None

    def leftover_state(self, root: str, name: str) -> LeftoverState:
        path = self.store.join(root, name)
        if self.is_committed(path):
            return "committed"  # retention's business, never gc's
        return "leftover" if is_save_leftover(self.store, path) else "keep"

    def dead_uploads(self, root: str) -> list[tuple[str, str]]:
        """Multipart uploads begun and never completed under ``root``: (path, upload id)."""
        return [(path, upload_id) for path, upload_id, _ in self.store.list_uploads(root)]

    def abort_upload(self, path: str, upload_id: str) -> None:
        self.store.abort_upload(path, upload_id)


def is_save_leftover(storage: FsspecStorage, path: str, names: list[str] | None = None) -> bool:
    """Whether the uncommitted prefix ``path`` (holding ``names``, listed if not given) holds
    only what a shardfmt save writes, LEASE included (taken before its first data byte):
    anything else is not ours to remove."""
    names = storage.list_tree(path) if names is None else names
    return LEASE_NAME in names and all(n in SAVE_NAMES or is_save_file(n) for n in names)
