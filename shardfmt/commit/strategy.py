"""The commit interface: how a save becomes a checkpoint all at once, whatever the store.

A checkpoint is committed when its ``COMMITTED`` marker is there (spec section 7); before
that, nothing of a save is a checkpoint. Two strategies keep that promise (as Orbax's
``AtomicRenameTemporaryPath`` and ``CommitFileTemporaryPath`` do, behind one interface):

- ``commit.rename.RenameCommit`` (filesystems): the save is staged in ``<path>.tmp-<save_id>``
  and published by one atomic rename, or ``renameat2(RENAME_EXCHANGE)`` over a previous
  checkpoint; its lease is the staging dir's mtime.
- ``commit.marker.MarkerCommit`` (object stores: no rename): the save writes in place under
  ``<path>``, takes a ``LEASE`` object first and writes ``COMMITTED`` last, only if absent.

``commit.protocol.commit_strategy(store)`` picks one per store; no caller outside ``commit/``
asks which. Call order of one save::

    1) staging = s.prepare(path, save_id, overwrite=...)   check the destination, take the lease
    2) data files go under ``staging``; s.heartbeat(staging, save_id) keeps the lease fresh
       (``commit.protocol.Heartbeat``); False: the lease was lost, never commit
    3) s.publish(path, staging, manifest, on_step=...)     manifest, COMMITTED, publish
       or, on any failure, s.abort(path, staging, save_id)  removes only this save's files
    4) s.release(staging)                                  drop the lease of a finished save

Root policy (spec/ROOTS.md) asks the strategy which names under a root may be a dead save's
leftover (``may_be_leftover``), what one is (``leftover_state``: "committed", "keep" — not
ours — or "leftover", judged by ``lease_time``), which uploads were never completed
(``dead_uploads``) and how to set a checkpoint aside (``quarantine``, ``marked_quarantined``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Literal, Protocol

from shardfmt.errors import StorageError
from shardfmt.format.manifest import (
    BASES_NAME,
    DATA_DIR,
    LEASE_NAME,
    MANIFEST_NAME,
    QUARANTINED_NAME,
    ROLLED_BACK_NAME,
    CommitRecord,
    Manifest,
)
from shardfmt.format.nodepart import is_joint_file
from shardfmt.io.store import ByteStore

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

LeftoverState = Literal["committed", "keep", "leftover"]


class CommitStrategy(Protocol):
    """One way to commit on one store (see the module docstring for the call order).

    ``in_place``: files are written at their final path (no staging location), so data file
    names carry the save id and a save's leftover is judged under its checkpoint's own name.
    """

    store: ByteStore
    in_place: bool

    def prepare(self, path: str, save_id: str, *, overwrite: bool,
                lease_seconds: float | None = None, now: float | None = None) -> str: ...
    def publish(self, path: str, staging: str, manifest: Manifest, *, overwrite: bool = False,
                on_step: StepHook | None = None, required: Iterable[str] | None = None) -> CommitRecord: ...
    def abort(self, path: str, staging: str, save_id: str) -> None: ...
    def heartbeat(self, staging: str, owner: str) -> bool: ...
    def release(self, staging: str) -> None: ...
    def lease_time(self, path: str) -> float: ...
    def is_committed(self, path: str) -> bool: ...
    def resolve(self, path: str) -> str: ...
    def marked_quarantined(self, path: str) -> bool: ...
    def quarantine(self, path: str, dest: str, reason: str) -> None: ...
    def marked_rolled_back(self, path: str) -> bool: ...
    def roll_back(self, path: str, dest: str, reason: str) -> None: ...
    def may_be_leftover(self, name: str) -> bool: ...
    def leftover_state(self, root: str, name: str) -> LeftoverState: ...
    def dead_uploads(self, root: str) -> list[tuple[str, str]]: ...
    def abort_upload(self, path: str, upload_id: str) -> None: ...


def require_utf8(path: str) -> None:
    """Refuse a path that is not valid UTF-8: names travel between ranks and into manifests as JSON."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise StorageError(f"{path!r}: a checkpoint path must be valid UTF-8; rename the directory") from None


SAVE_NAMES = (LEASE_NAME, MANIFEST_NAME, QUARANTINED_NAME, BASES_NAME, ROLLED_BACK_NAME)


_INDEX_RE = re.compile(r"index/(rank_[0-9]{5}|ranks_[0-9]{8})(\.[A-Za-z0-9_-]{1,128})?\.json")


def is_save_file(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint) is a file a save writes below the checkpoint:
    a data file, or (v2) a rank index or rank-table part, or a joint copy's marker or claim
    (``commit.joint``)."""
    return is_data_file(name) or bool(_INDEX_RE.fullmatch(name)) or is_joint_file(name)


def is_data_file(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint) is a data file a save writes: ``data/<x>.safetensors``."""
    return name.startswith(DATA_DIR + "/") and name.endswith(".safetensors") and "/" not in name[len(DATA_DIR) + 1:]
