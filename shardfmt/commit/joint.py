"""A staging location several writers fill without talking to one another: the nodes of a save
on the node-local tier, each copying its own part to the shared tier (spec/ROOTS.md section 3).

Every writer, in any order, at any time::

    1) ``join`` the staging of save ``save_id`` at ``path``: on a filesystem the directory
       ``<path>.tmp-<save id>`` (made by whoever comes first), on an object store the prefix
       itself with its ``LEASE`` owned by that save (taken by whoever comes first: a LEASE of
       another save is another save's, and refused). Each writer keeps the lease fresh while
       it writes (``protocol.Heartbeat``, never releasing it: others may still be writing).
    2) write its files there, then its marker ``NODES/node_<k>`` (``mark``)
    3) ``complete``: list ``NODES/``; the writer that finds all ``count`` markers claims the
       commit by creating ``COMMITTER`` exclusively (O_EXCL; S3 If-None-Match), holding its
       name, so that exactly one commits: it writes what it alone was to write (the root
       manifest and the rank table), checks that every file is there at its size, and
       publishes as any save does (markers and claim stay, outside the manifest). A writer that
       finds fewer markers, or another's claim, is done: a later writer commits. A claimant
       that fails gives the claim up (``release``) before it raises; a retry of its own finds
       its name in the claim. A writer that retries before its marker was written takes
       nothing for granted and writes its files again; one whose marker is there writes
       nothing again (its files are whole) and goes on to 3).

A writer that dies leaves its marker unwritten: nobody commits, the lease expires, and the
collector removes the staging as any dead save's. The last marker written is always seen by
its own writer's listing (read-after-write), so a staging whose markers are all there is
always committed by someone, unless that one dies too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from shardfmt.commit import protocol as _commit
from shardfmt.commit.lease import lease_owner
from shardfmt.commit.rename import staging_path
from shardfmt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    StorageError,
)
from shardfmt.format.manifest import COMMITTED_NAME, DATA_DIR, INDEX_DIR, Manifest
from shardfmt.format.nodepart import COMMITTER_NAME, MARKS_DIR, mark_name
from shardfmt.format.parse import parse_commit
from shardfmt.io.store import Storage

EMPTY_CLAIM_LOOKS = 4  # a claim's file is made, then its few bytes written: seen empty this often, apart ...
EMPTY_CLAIM_WAIT = 0.25  # ... by this many seconds, its write failed


def committed_save(storage: Storage, path: str) -> str | None:
    """The save id committed at ``path`` (None: nothing committed there)."""
    if not _commit.is_committed(storage, path):
        return None
    raw = storage.read_bytes(storage.join(path, COMMITTED_NAME), limit=1 << 16, within=path)
    return parse_commit(raw, source=storage.url(storage.join(path, COMMITTED_NAME))).save_id


def join(storage: Storage, path: str, save_id: str) -> str | None:
    """1) Stage, or join the staging of, save ``save_id`` at ``path``; return where its files
    go (None: that save is committed there already). CheckpointExistsError when ``path`` holds
    another save's checkpoint or staging."""
    done = committed_save(storage, path)
    if done is not None:
        if done == save_id:
            return None
        raise CheckpointExistsError(f"{storage.url(path)}: holds another checkpoint (save {done}, not {save_id})")
    strategy = _commit.commit_strategy(storage)
    if not strategy.in_place:
        target = staging_path(path, save_id)
        storage.makedirs(storage.join(target, DATA_DIR))
        storage.makedirs(storage.join(target, INDEX_DIR))
        return target
    storage.makedirs(storage.join(path, DATA_DIR))
    try:
        strategy.take_lease(path, save_id)
    except CheckpointExistsError:
        owner = lease_owner(storage, path)
        if owner != save_id:
            raise CheckpointExistsError(f"{storage.url(path)}: another save ({owner}) is staged there") from None
    return path


def mark(storage: Storage, staging: str, index: int, save_id: str) -> None:
    """2) Say that writer ``index`` has written all its files."""
    storage.makedirs(storage.join(staging, MARKS_DIR))
    storage.write_bytes(storage.join(staging, mark_name(index)), save_id.encode() + b"\n")


def marked(storage: Storage, staging: str, index: int, save_id: str) -> bool:
    """Whether writer ``index`` said it has written all its files of save ``save_id`` (an
    earlier try of it); a marker of another save (a reused prefix's leftover) is none."""
    try:
        raw = storage.read_bytes(storage.join(staging, mark_name(index)), limit=1024, within=staging)
    except CheckpointNotFoundError:
        return False
    return raw.strip() == save_id.encode()


def complete(storage: Storage, staging: str, count: int, owner: str, save_id: str) -> bool:
    """3) Whether all ``count`` markers are there and writer ``owner`` holds the claim to commit
    (won now, or by an earlier try of its own). A failure to write the claim that is not a
    claim already there raises (the caller retries)."""
    try:
        marks = storage.list_tree(storage.join(staging, MARKS_DIR))
    except CheckpointNotFoundError:
        return False
    if len(set(marks) & {mark_name(k).split("/", 1)[1] for k in range(count)}) < count:
        return False
    if not all(marked(storage, staging, k, save_id) for k in range(count)):
        return False  # a marker of another save: that writer has not written this one's files
    claim = storage.join(staging, COMMITTER_NAME)
    try:
        storage.write_bytes(claim, owner.encode() + b"\n", exclusive=True)
        return True
    except (CheckpointExistsError, StorageError):  # O_EXCL on a filesystem fails as a StorageError
        if not storage.exists(claim):
            raise  # not a claim there: a failure to retry (or the copy is committed and gone)
    holder = _holder(storage, claim, staging)
    if holder == b"":  # a claim whose write failed after its file was made: nobody's; gone, and retried
        storage.remove_tree(claim)
        raise CommitError(f"{storage.url(claim)}: an empty claim (a failed write): removed; the copy is retried")
    return holder == owner.encode()


def _holder(storage: Storage, claim: str, staging: str) -> bytes | None:
    """Who holds the claim (b"": a claim still empty a moment after it was seen: its write
    failed; None: given up meanwhile)."""
    for _ in range(EMPTY_CLAIM_LOOKS):
        try:
            got = storage.read_bytes(claim, limit=1024, within=staging).strip()
        except CheckpointNotFoundError:  # given up by a claimant that failed: a later writer claims
            return None
        if got:
            return got
        time.sleep(EMPTY_CLAIM_WAIT)
    return b""


def release(storage: Storage, staging: str, owner: str) -> None:
    """The claimant failed: give the claim up so that a retry (its own or another writer's) can commit."""
    claim = storage.join(staging, COMMITTER_NAME)
    try:
        if storage.read_bytes(claim, limit=1024, within=staging).strip() == owner.encode():
            storage.remove_tree(claim)
    except (CheckpointNotFoundError, StorageError):
        pass


def publish(storage: Storage, path: str, staging: str, manifest: Manifest, docs: dict[str, bytes],
            required: Mapping[str, int | None]) -> None:
    """The winner of the claim: write ``docs`` (name -> bytes), check that every ``required``
    file (name -> its size, None: any) is there, and commit. The markers and the claim stay
    (never part of the manifest): a writer that listed the markers before the commit then finds
    the claim taken, or the staging gone."""
    for name, raw in sorted(docs.items()):
        storage.write_bytes(storage.join(staging, name), raw)
    for name, size in sorted(required.items()):
        try:
            got = storage.size(storage.join(staging, name), within=staging)
        except CheckpointNotFoundError:
            raise CommitError(f"{storage.url(staging)}: {name} is missing; not committing the copy") from None
        if size is not None and got != size:
            raise CommitError(f"{storage.url(staging)}: {name} has {got} bytes, not {size}; not committing the copy")
    _commit.publish(storage, path, staging, manifest, required=sorted(required))
