"""Checkpoint roots: what is under one (status of each checkpoint) and collecting what dead saves left.

A root holds ``step_NNNNNNNNN`` checkpoints (spec/ROOTS.md section 1). Listing opens each one
quickly (COMMITTED, manifest, file sizes: no data). Garbage collection removes only what a
dead save left, judged by its lease (spec/ROOTS.md section 1): staging dirs (``.tmp-``), uncommitted
checkpoint prefixes (object stores write in place), and multipart uploads never completed.
A live save keeps its lease fresh, so a collector never touches it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shardfmt.commit.names import is_quarantined_dir, is_rolled_back_dir, parse_step_dir
from shardfmt.commit.protocol import commit_strategy
from shardfmt.commit.strategy import CommitStrategy
from shardfmt.errors import (
    CheckpointNotFoundError,
    FormatVersionError,
    ShardfmtError,
    SpecialFileError,
    StorageError,
)
from shardfmt.format import refs
from shardfmt.format.manifest import (
    COMMITTED_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    QUARANTINED_NAME,
    ROLLED_BACK_NAME,
)
from shardfmt.format.nodepart import MAX_PART_BYTES, NODE_PART_NAME, PartRecord
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.loading.reader import open_checkpoint
from shardfmt.loading.resolve import file_sizes
from shardfmt.training.retention import lease_expired


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    step: int
    path: str
    status: str  # committed | incomplete | corrupt | quarantined | unsupported | rolled_back | node_part
    reason: str = ""  # why it is not committed


def _node_part_reason(storage: Storage, path: str) -> str:
    """What ``ls`` says of a node part (spec/ROOTS.md section 3)."""
    try:
        rec = PartRecord.parse(storage.read_bytes(storage.join(path, NODE_PART_NAME), limit=MAX_PART_BYTES,
                                                  within=path), source=NODE_PART_NAME)
    except ShardfmtError as e:
        return f"a node part whose record is unreadable: {e}"
    return (f"node {rec.part.index} of {rec.part.count} of save {rec.commit.save_id} on the node-local tier "
            f"(ranks {rec.part.ranks[0]}-{rec.part.ranks[-1]}; the other parts are on the other nodes' disks)")


def checkpoint_status(storage: Storage, path: str, *, markers_only: bool = False
                      ) -> tuple[str, int | None, int | None, str]:
    """Return (status, step, size, reason) of one checkpoint directory, quickly.

    "unsupported" is a committed checkpoint of a format version this reader cannot read (a
    newer release's): neither usable nor corrupt, so never quarantined nor removed (spec/ROOTS.md section 1).
    ``markers_only``: look at the COMMITTED and QUARANTINED markers alone (one or two requests
    on an object store), not at the manifest and the files' sizes."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if ".tmp-" in name:
        return "incomplete", None, None, "staging dir of an unfinished save"
    if is_quarantined_dir(name):
        return "quarantined", None, None, "renamed aside by a restore that found it unusable"
    if is_rolled_back_dir(name):
        return "rolled_back", None, None, "renamed aside by a rollback to an earlier step"
    if not storage.exists(storage.join(path, COMMITTED_NAME)):
        if storage.exists(storage.join(path, NODE_PART_NAME)):
            return "node_part", parse_step_dir(name), None, _node_part_reason(storage, path)
        return "incomplete", None, None, f"no {COMMITTED_NAME}"
    strategy = commit_strategy(storage)
    if strategy.marked_quarantined(path):
        return "quarantined", None, None, f"{QUARANTINED_NAME} marker"
    if strategy.marked_rolled_back(path):
        return "rolled_back", None, None, f"{ROLLED_BACK_NAME} marker: set aside by a rollback to an earlier step"
    if markers_only:
        return "committed", None, None, ""
    try:
        ckpt = open_checkpoint(path, storage=storage, whole=False)
        sizes = file_sizes(storage, ckpt.path, ckpt.manifest)
    except StorageError:
        raise  # a failed read (network, throttling, permission) says nothing about the checkpoint
    except FormatVersionError as e:
        return "unsupported", None, None, unsupported_reason(e)
    except ShardfmtError as e:
        return "corrupt", None, None, str(e)
    m = ckpt.manifest
    for fname, want in sizes.items():
        try:
            full, within = refs.location(storage.join, path, fname)
            size = storage.size(full, within=within)
        except CheckpointNotFoundError:
            return "corrupt", m.step, None, refs.missing_file(fname)
        except SpecialFileError as e:  # a FIFO, a device, a link (spec section 2)
            return "corrupt", m.step, None, str(e)
        if size != want:
            return "corrupt", m.step, None, f"{fname} is {size} bytes, manifest says {want}"
    own = sum(n for f, n in sizes.items() if refs.split(f)[0] is None)  # an incremental one's: not its bases'
    return "committed", m.step, own, ""


def unsupported_reason(e: FormatVersionError) -> str:
    """Why a checkpoint is "unsupported", naming both versions."""
    if e.version is not None and e.version > FORMAT_VERSION:
        return f"format version {e.version}; this reader supports up to {FORMAT_VERSION}"
    return str(e)


def require_root(storage: Storage, root: str) -> None:
    """Raise CheckpointNotFoundError unless ``root`` is a directory: a misspelled root is an
    error, not an empty one."""
    if not storage.isdir(root):
        raise CheckpointNotFoundError(f"{storage.url(root)}: not a directory")


def _parent_dir(root: str) -> str:
    return root.rstrip("/").rsplit("/", 1)[0] or "/"


def _bucket(root: str) -> str:
    return root.lstrip("/").split("/", 1)[0]


def root_parent(storage: Storage, root: str) -> str:
    """The URL of what must exist for a missing ``root`` to be a first run: its parent directory,
    or on an object store (where prefixes exist only by holding objects) its bucket."""
    return storage.url(_bucket(root) if storage.remote else _parent_dir(root))


def probe_root(storage: Storage, root: str) -> str:
    """What ``root`` is to a Checkpointer (spec/ROOTS.md section 1): "root" (a directory), "new" (missing,
    its parent exists: a first run) or "orphan" (missing, and so is its parent: a misspelled path?).

    Raise CheckpointNotFoundError when ``root`` is a checkpoint itself (named ``step_N``, or
    holding ``manifest.json`` or ``COMMITTED``) or a file."""
    name = root.rstrip("/").rsplit("/", 1)[-1]
    is_dir = storage.isdir(root)
    if parse_step_dir(name) is not None or (is_dir and any(storage.exists(storage.join(root, n))
                                                           for n in (COMMITTED_NAME, MANIFEST_NAME))):
        raise CheckpointNotFoundError(f"{storage.url(root)}: is a checkpoint, not a Checkpointer root (the "
                                      "directory holding step_NNNNNNNNN checkpoints): pass its parent "
                                      f"{storage.url(_parent_dir(root))}")
    if is_dir:
        return "root"
    if storage.exists(root):
        if storage.isdir(root):  # another rank of the job made it since the first look
            return "root"
        raise CheckpointNotFoundError(f"{storage.url(root)}: is a file, not a Checkpointer root (a directory)")
    if storage.remote:  # prefixes exist only by holding objects: what must exist is the bucket
        return "new" if storage.bucket_exists(root) else "orphan"
    return "new" if storage.isdir(_parent_dir(root)) else "orphan"


def list_checkpoints(root: str, storage_options: dict | None = None) -> list[dict]:
    """Every checkpoint-like directory under ``root`` (a path or fsspec URL) with its status."""
    storage, root = get_storage(root, storage_options)
    require_root(storage, root)
    out = []
    for name in storage.listdir(root):
        path = storage.join(root, name)
        if not storage.isdir(path):
            continue
        inner = set(storage.listdir(path))
        if not inner & {COMMITTED_NAME, MANIFEST_NAME, "data"} and ".tmp-" not in name:
            continue
        status, step, size, reason = checkpoint_status(storage, path)
        out.append({"name": name, "path": storage.url(path), "status": status, "step": step, "size": size,
                    "reason": reason})
    return out


def checkpoint_at(path: str, step: int | None, storage_options: dict | None = None) -> str:
    """``path`` itself (``step`` None), or the committed checkpoint of ``step`` in the Checkpointer
    root ``path`` (a ``--step`` option): an error naming the committed steps there when there is
    none (a rolled-back or quarantined one is not committed)."""
    if step is None:
        return path
    storage, root = get_storage(path, storage_options)
    require_root(storage, root)
    infos = list_steps(storage, root)
    for i in infos:
        if i.step == step and i.status == "committed":
            return storage.url(i.path)
    have = [i.step for i in infos if i.status == "committed"]
    listed = ", ".join(map(str, have[-8:])) + (f" ({len(have)} in all)" if len(have) > 8 else "") if have else "none"
    raise CheckpointNotFoundError(f"{storage.url(root)}: no committed checkpoint of step {step} (committed steps: "
                                  f"{listed})")


def step_paths(storage: Storage, root: str) -> list[tuple[int, str]]:
    """Every ``step_*`` under ``root``, oldest first, as (step, path): one listing, nothing opened."""
    if not storage.exists(root):
        if not storage.bucket_exists(root):  # an empty root is fine; a misspelled bucket is an error
            raise StorageError(f"{storage.url(root)}: the bucket {_bucket(root)!r} does not exist")
        return []
    found = [(parse_step_dir(name), storage.join(root, name)) for name in storage.listdir(root)]
    return sorted((step, path) for step, path in found if step is not None)


def set_aside_in_place(storage: Storage, root: str) -> set[int]:
    """The steps whose checkpoint an object store's root holds set aside in place (quarantined
    or rolled back: marked, not renamed); none on a filesystem or when the root cannot be listed."""
    if not commit_strategy(storage).in_place:
        return set()
    try:
        return {step for step, path in step_paths(storage, root)
                if checkpoint_status(storage, path, markers_only=True)[0] in ("quarantined", "rolled_back")}
    except (ShardfmtError, OSError):
        return set()


def list_steps(storage: Storage, root: str) -> list[CheckpointInfo]:
    """Every ``step_*`` under ``root``, oldest first, with its status."""
    out = []
    for step, path in step_paths(storage, root):
        status, _, _, reason = checkpoint_status(storage, path)
        out.append(CheckpointInfo(step=step, path=path, status=status, reason=reason))
    return out


def newest_committed(storage: Storage, root: str) -> str | None:
    """The newest committed checkpoint under ``root``: checked newest first, stopping at the first
    that passes (the cost does not grow with the number of checkpoints kept)."""
    for _, path in reversed(step_paths(storage, root)):
        if checkpoint_status(storage, path)[0] == "committed":
            return path
    return None


@dataclass(frozen=True, slots=True)
class LeasedSave:
    """A save's staging under a root whose lease is fresh: ``collect_garbage`` leaves it alone
    until ``expires_at`` (seconds since the epoch), unless its writer renews the lease."""

    url: str
    expires_at: float


def leased_saves(storage: Storage, root: str, *, lease_seconds: float | None = None,
                 now: float | None = None) -> list[LeasedSave]:
    """The saves under ``root`` that ``collect_garbage`` would leave alone for their fresh lease
    (a live save, or one that died less than a lease ago), in name order."""
    lease = storage.lease_seconds if lease_seconds is None else lease_seconds
    now = time.time() if now is None else now
    if not storage.exists(root):
        return []
    strategy = commit_strategy(storage)
    out = []
    for name in sorted(storage.listdir(root)):
        if strategy.may_be_leftover(name):
            state, since = _leftover(storage, strategy, root, name, lease, now)
            if state == "keep" and since is not None:
                out.append(LeasedSave(url=storage.url(storage.join(root, name)), expires_at=since + lease))
    return out


def _leftover(storage: Storage, strategy: CommitStrategy, root: str, name: str, lease: float,
              now: float) -> tuple[str, float | None]:
    """What lies under ``root/name`` for the collector: ("committed", None), ("dead", lease
    time) for a save whose lease expired, ("keep", lease time) for one whose lease holds, or
    ("keep", None) for anything it cannot judge (left alone)."""
    try:
        state = strategy.leftover_state(root, name)
        if state != "leftover":
            return state, None
        since = strategy.lease_time(storage.join(root, name))
    except ShardfmtError:
        return "keep", None
    return ("dead" if lease_expired(since, now, lease) else "keep"), since


def collect_garbage(storage: Storage, root: str, *, lease_seconds: float | None = None,
                    now: float | None = None, dry_run: bool = False) -> list[str]:
    """Remove what dead saves left under ``root``; return the URLs removed (or, dry, to remove)."""
    lease = storage.lease_seconds if lease_seconds is None else lease_seconds
    now = time.time() if now is None else now
    if not storage.exists(root):
        return []
    strategy = commit_strategy(storage)
    removed: list[str] = []
    states: dict[str, str] = {}

    def state(name: str) -> str:
        """What lies under ``root/name``: "committed", "dead" (a dead save's) or "keep"."""
        if name not in states:
            states[name] = _leftover(storage, strategy, root, name, lease, now)[0]
        return states[name]

    for name in storage.listdir(root):
        if not strategy.may_be_leftover(name) or state(name) != "dead":
            continue
        path = storage.join(root, name)
        try:
            if not dry_run:
                storage.remove_tree(path)
            removed.append(storage.url(path))
        except ShardfmtError:
            continue
    # Uploads a dead save began and never completed (invisible, but stored and billed): the
    # checkpoint they belong to is judged by its lease, not by the upload's own start time;
    # under a committed checkpoint the save is over, so its leftover uploads go too.
    for upload_path, upload_id in strategy.dead_uploads(root):
        name = upload_path[len(root.rstrip("/")) + 1:].split("/", 1)[0]
        if state(name) == "keep":
            continue
        if not dry_run:
            strategy.abort_upload(upload_path, upload_id)
        removed.append(f"{storage.url(upload_path)} (incomplete multipart upload)")
    return removed
