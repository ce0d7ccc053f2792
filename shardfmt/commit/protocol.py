"""The commit protocol: stage -> data files -> manifest -> COMMITTED -> publish.

Local disk (atomic rename)::

    1) every data file is written into ``<path>.tmp-<save_id>/data/`` and fsynced
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

A crash at any point leaves ``<path>`` absent or committed, never torn; after step 5 the
new checkpoint is the one at ``<path>``. Object stores cannot rename: there the files go
straight under ``<path>`` and the ``COMMITTED`` object, written last, is the commit.

``on_step`` is called with each step's name after it completes (tests raise from it to
simulate a crash at that point).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable

import orjson

from shardfmt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    ShardfmtError,
    StorageError,
)
from shardfmt.format import hashing
from shardfmt.format.manifest import (
    COMMITTED_NAME,
    DATA_DIR,
    LEASE_NAME,
    MANIFEST_NAME,
    MAX_COMMITTED_BYTES,
    MAX_MANIFEST_BYTES,
    QUARANTINED_NAME,
    CommitRecord,
    Manifest,
)
from shardfmt.format.parse import parse_commit
from shardfmt.io.fsspec import lease_identity, lease_owner, read_lease
from shardfmt.io.storage import Storage

StepHook = Callable[[str], None]

STEPS = (
    "files_written",
    "manifest_written",
    "committed_written",
    "staging_synced",
    "set_aside",
    "published",
    "parent_synced",
    "cleaned",
)


def staging_path(path: str, save_id: str) -> str:
    return f"{path}.tmp-{save_id}"


def aside_path(path: str, save_id: str) -> str:
    return f"{path}.old-{save_id}"


def _basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))


def is_committed(storage: Storage, path: str) -> bool:
    return storage.exists(storage.join(path, COMMITTED_NAME))


def prepare(storage: Storage, path: str, save_id: str, *, overwrite: bool,
            lease_seconds: float | None = None, now: float | None = None) -> str:
    """Check the destination, create the staging location, and return where files go.

    On an object store the files go straight under ``path``. An uncommitted prefix there is
    a dead save's leftover once its lease has expired, and is removed; while its lease is
    fresh it is a save in progress and this save refuses to start.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:  # names travel between ranks and into manifests as JSON (UTF-8)
        raise StorageError(f"{path!r}: a checkpoint path must be valid UTF-8; rename the directory") from None
    if not storage.atomic_rename and "/" not in path.strip("/"):
        raise StorageError(f"{storage.url(path)}: a checkpoint cannot live at a bucket's root; "
                           "give a prefix (e.g. s3://bucket/run1/step_000000100)")
    if storage.exists(path):
        if is_committed(storage, path):
            if not overwrite:
                raise CheckpointExistsError(
                    f"{storage.url(path)}: a committed checkpoint is already there "
                    "(pass overwrite=True / --overwrite to replace it)")
            if not storage.atomic_rename:
                raise CommitError(f"{storage.url(path)}: overwriting a checkpoint on this storage is not supported; "
                                  "save to a new path")
        elif not storage.atomic_rename:
            _clear_leftover(storage, path, overwrite=overwrite,
                            lease=storage.lease_seconds if lease_seconds is None else lease_seconds,
                            now=time.time() if now is None else now)
        elif not storage.isdir(path):  # never replaced, not even with overwrite: it is no checkpoint
            raise CheckpointExistsError(f"{path}: is a file, not a checkpoint directory; refusing to replace it")
        elif storage.listdir(path) and not overwrite:
            raise CheckpointExistsError(
                f"{path}: exists, is not empty and is not a committed checkpoint; refusing to replace it "
                "(pass overwrite=True / --overwrite)"
            )
    target = staging_path(path, save_id) if storage.atomic_rename else path
    if storage.atomic_rename and storage.exists(target):
        raise CommitError(f"{target}: staging location already exists (save id reused?)")
    storage.makedirs(storage.join(target, DATA_DIR))
    if not storage.atomic_rename:
        storage.take_lease(target, save_id)  # only if absent: of two saves starting together, one goes on
    return target


_SAVE_NAMES = (LEASE_NAME, MANIFEST_NAME, QUARANTINED_NAME)


def is_data_file(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint) is a data file a save writes: ``data/<x>.safetensors``."""
    return name.startswith(DATA_DIR + "/") and name.endswith(".safetensors") and "/" not in name[len(DATA_DIR) + 1:]


def is_save_leftover(storage: Storage, path: str, names: list[str] | None = None) -> bool:
    """Whether the uncommitted prefix ``path`` (holding ``names``, listed if not given) holds
    only what a shardfmt save writes, LEASE included (taken before its first data byte):
    anything else is not ours to remove."""
    names = storage.list_tree(path) if names is None else names
    return LEASE_NAME in names and all(n in _SAVE_NAMES or is_data_file(n) for n in names)


def _clear_leftover(storage: Storage, path: str, *, overwrite: bool, lease: float, now: float) -> None:
    """Object stores: remove a dead save's leftover at ``path``; refuse a live save's or anything else."""
    names = storage.list_tree(path)
    if not names:
        return
    if not is_save_leftover(storage, path, names):
        if not overwrite:
            raise CheckpointExistsError(
                f"{storage.url(path)}: holds objects that are not a shardfmt checkpoint; refusing to replace "
                "them (pass overwrite=True / --overwrite)")
    else:
        age = now - storage.mtime(path)
        if age <= lease and not _holder_is_dead(storage, path):
            raise CheckpointExistsError(
                f"{storage.url(path)}: another save is in progress there (its lease was refreshed "
                f"{age:.0f} s ago; a dead save's leftover is removed once its {lease:.0f} s lease expires)")
    storage.remove_tree(path)


def _holder_is_dead(storage: Storage, path: str) -> bool:
    """Whether the lease at ``path`` was taken by a process of this host (same hostname and
    pid namespace) that no longer runs: a job restarted on the same node need not wait out
    its dead predecessor's lease."""
    import os

    try:
        holder = read_lease(storage, path)
        me = lease_identity()
        if not isinstance(holder.get("pid"), int) \
                or any(holder.get(k) != me[k] for k in ("host", "pidns")):
            return False
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except (ShardfmtError, OSError, ValueError, AttributeError):
        return False
    return False


def publish(storage: Storage, path: str, staging: str, manifest: Manifest,
            *, overwrite: bool = False, on_step: StepHook | None = None) -> CommitRecord:
    """Run steps 2-7 of the protocol for files already written under ``staging``.

    Without ``overwrite``, a checkpoint that appeared at ``path`` while this save was
    writing (a racing save of the same step) wins: this one raises CheckpointExistsError.
    """
    step = on_step or (lambda name: None)
    if not storage.atomic_rename and is_committed(storage, staging):
        raise CheckpointExistsError(f"{storage.url(path)}: another save committed here first")
    step("files_written")
    manifest_bytes = manifest.to_json()
    record = CommitRecord(save_id=manifest.save_id, manifest_digest=hashing.digest_bytes(manifest_bytes))
    mpath = storage.join(staging, MANIFEST_NAME)
    try:  # object stores: only if absent, so a stale save can never replace a racing save's manifest
        storage.write_bytes(mpath, manifest_bytes, exclusive=not storage.atomic_rename)
    except CheckpointExistsError:
        # ours if a retried PUT's first attempt landed (its reply lost)
        if storage.read_bytes(mpath, limit=MAX_MANIFEST_BYTES, within=staging) != manifest_bytes:
            raise CheckpointExistsError(f"{storage.url(path)}: another save wrote its manifest here (this save "
                                        "outlived its lease?); nothing of it was replaced") from None
    step("manifest_written")
    marker = storage.join(staging, COMMITTED_NAME)
    if not storage.atomic_rename:
        try:
            present = set(storage.listdir(storage.join(staging, DATA_DIR))) if manifest.files else set()
        except CheckpointNotFoundError:
            present = set()
        gone = sorted(f for f in manifest.files if posixpath.basename(f) not in present)
        if gone:  # removed under us (a collector that thought this save dead): never commit that
            raise CommitError(f"{storage.url(path)}: data file(s) {gone[:3]} vanished before the commit")
    try:
        storage.write_bytes(marker, record.to_json(), exclusive=not storage.atomic_rename)
    except CheckpointExistsError:
        # A retried PUT whose first attempt landed (its reply lost) also ends here: ours, then.
        if parse_commit(storage.read_bytes(marker, limit=MAX_COMMITTED_BYTES, within=staging), source=marker) != record:
            raise CheckpointExistsError(f"{storage.url(path)}: another save committed here first") from None
    step("committed_written")
    if not storage.atomic_rename:
        # Where the store cannot write "only if absent", a racing save could have replaced
        # our marker: read it back, so a save never reports a commit that is not its own.
        if parse_commit(storage.read_bytes(marker, limit=MAX_COMMITTED_BYTES, within=staging), source=marker) != record:
            raise CheckpointExistsError(f"{storage.url(path)}: another save committed here at the same time")
        step("published")
        return record
    storage.sync_dir(storage.join(staging, DATA_DIR))
    storage.sync_dir(staging)
    step("staging_synced")
    parent = posixpath.dirname(path.rstrip("/")) or "."
    if not storage.exists(path):
        try:
            storage.rename(staging, path)
        except StorageError:
            if storage.exists(path) and not overwrite:
                raise CheckpointExistsError(f"{path}: another save published here first") from None
            raise
        step("published")
        storage.sync_dir(parent)
        step("parent_synced")
        step("cleaned")
        return record
    if not overwrite and is_committed(storage, path):
        raise CheckpointExistsError(f"{path}: another save published here first")
    if storage.isdir(path) and not storage.listdir(path):
        storage.rename(staging, path)  # replaces an empty directory atomically
        step("published")
        storage.sync_dir(parent)
        step("parent_synced")
        step("cleaned")
        return record
    try:
        storage.exchange(staging, path)
        old = staging
    except StorageError:
        old = aside_path(path, manifest.save_id)
        storage.rename(path, old)
        step("set_aside")
        storage.rename(staging, path)
    step("published")
    storage.sync_dir(parent)
    step("parent_synced")
    storage.remove_tree(old)
    step("cleaned")
    return record


def abort(storage: Storage, staging: str) -> None:
    """Remove a failed save's staging dir (best effort; a leftover is ignorable)."""
    try:
        storage.remove_tree(staging)
    except (OSError, ShardfmtError):
        pass


def abort_own(storage: Storage, path: str, save_id: str) -> None:
    """Object stores: remove what the failed save ``save_id`` wrote under ``path``, and nothing
    else: another save may have taken the prefix over (this one outlived its lease). Its LEASE
    goes too once nothing of another save's is left."""
    try:
        names = storage.list_tree(path)
        tag = f".{save_id}.safetensors"
        mine = [n for n in names if is_data_file(n) and n.endswith(tag)]
        if MANIFEST_NAME in names:
            try:
                raw = storage.read_bytes(storage.join(path, MANIFEST_NAME), limit=MAX_MANIFEST_BYTES, within=path)
                if orjson.loads(raw).get("save_id") == save_id:
                    mine.append(MANIFEST_NAME)
            except (ShardfmtError, ValueError, AttributeError):
                pass
        for n in mine:
            storage.remove_tree(storage.join(path, n))
        if set(names) - set(mine) <= {LEASE_NAME}:
            if lease_owner(storage, path) in (save_id, None):  # never the LEASE of a save that took over
                storage.remove_tree(path)
    except (OSError, ShardfmtError):
        pass  # best effort: a leftover is collected once its lease expires


def committed_aside(storage: Storage, path: str) -> str | None:
    """Return a committed ``<path>.old-*`` left by a rename-aside overwrite that crashed."""
    parent = posixpath.dirname(path.rstrip("/")) or "."
    prefix = _basename(path) + ".old-"
    try:
        names = storage.listdir(parent)
    except ShardfmtError:
        return None
    for name in names:
        if name.startswith(prefix):
            cand = storage.join(parent, name)
            if is_committed(storage, cand):
                return cand
    return None
