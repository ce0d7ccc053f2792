"""Copying each node's part of a node-local save to the shared tier, in the background.

``copy_part`` is what one node's leader does for one save (``commit.joint`` has the protocol:
join the shared staging, copy, mark, and the last node commits)::

    1) open the node part on this node's disk: ``NODE_PART``, the manifest it vouches for
    2) join the shared copy's staging (``joint.join``; nothing to do when that save is
       committed there already) and keep its lease fresh while copying
    3) copy this node's data files, every chunk checked against the digests of its rank's
       index on the way (``archive.copy_file``), then this node's rank indexes (each checked
       against the rank table)
    4) mark this node done; the node that finds every node's mark claims the commit, checks
       every rank's index in the shared staging against the rank table, writes the root
       manifest and the rank table there, and commits: the copy is verified where it lies
       before it is committed, as the archive's is

``Replicator`` runs the copies of one node, one at a time, on a thread of its own: the
training never waits for the shared tier. A failed copy is retried with backoff and reported
as a warning and in ``errors``, never raised into training.
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

from shardfmt.commit import joint
from shardfmt.commit import protocol as _commit
from shardfmt.commit.nodepart import read_part
from shardfmt.errors import IntegrityError, ShardfmtError
from shardfmt.format import hashing
from shardfmt.format.manifest import MANIFEST_NAME, Manifest
from shardfmt.format.nodepart import NodePart, mark_name
from shardfmt.format.parse import parse_manifest
from shardfmt.io.documents import rank_entries, read_headers, read_indexes, read_vouched
from shardfmt.io.local import LocalStorage
from shardfmt.io.store import Storage
from shardfmt.training.archive import COPY_PIECE, copy_file, copy_with_retries

_FAILURES = (ShardfmtError, OSError)


def open_part(local: LocalStorage, path: str) -> tuple[bytes, Manifest, NodePart]:
    """The manifest bytes of the node part at ``path``, checked against its ``NODE_PART``."""
    record = read_part(local, path)
    raw = local.read_bytes(local.join(path, MANIFEST_NAME), limit=1 << 30, within=path)
    if hashing.digest_bytes(raw) != record.commit.manifest_digest:
        raise IntegrityError(f"{path}/{MANIFEST_NAME}: does not hash to the digest its NODE_PART records")
    m = parse_manifest(raw, source=f"{path}/{MANIFEST_NAME}")
    if m.save_id != record.commit.save_id:
        raise IntegrityError(f"{path}: manifest save {m.save_id} != NODE_PART's {record.commit.save_id}")
    return raw, m, record.part


def copy_part(local: LocalStorage, path: str, shared: Storage, dst: str, *, piece: int = COPY_PIECE) -> bool:
    """Copy this node's part of the save at ``path`` to ``dst`` on ``shared``; return True when
    this node committed the shared copy (every node had copied its files)."""
    _, m, part = open_part(local, path)
    staging = joint.join(shared, dst, m.save_id)
    if staging is None:
        return False  # committed there already
    lease = _commit.Heartbeat(shared, staging, shared.lease_seconds, m.save_id)
    try:
        indexes = read_indexes(local, path, m, part.ranks, required=False)
        found = read_headers(local, path, m, indexes, verify=True)
        buf = bytearray(max(m.chunk_size, piece // m.chunk_size * m.chunk_size))
        for rank in sorted(found):
            for f in found[rank]:
                _fresh(shared, shared.join(staging, f.name))
                copy_file(local, path, shared, staging, f.name, f.file_record(), m.chunk_size, buf)
        del buf
        for _, e in sorted(rank_entries(local, path, m, part.ranks, required=False).items()):
            _fresh(shared, shared.join(staging, e.name))
            shared.write_bytes(shared.join(staging, e.name), read_vouched(local, path, e.name, e.size, e.digest))
        _fresh(shared, shared.join(staging, mark_name(part.index)))
        joint.mark(shared, staging, part.index, m.save_id)
        if not joint.complete(shared, staging, part.count):
            lease.stop()
            return False
        _commit_copy(local, path, m, shared, dst, staging)
    except BaseException:
        lease.stop()
        raise
    lease.stop(release=True)
    return True


def _commit_copy(local: LocalStorage, path: str, m: Manifest, shared: Storage, dst: str, staging: str) -> None:
    """The last node: check every rank's index there, write the rank table, commit."""
    tables = {p.name: read_vouched(local, path, p.name, p.size, p.digest) for p in m.ranks}
    for name, raw in tables.items():
        _fresh(shared, shared.join(staging, name))
        shared.write_bytes(shared.join(staging, name), raw)
    everyone = [r for p in m.ranks for r in range(p.first, p.end)]
    indexes = read_indexes(shared, staging, m, everyone, required=False)  # each against the rank table
    required = set(tables) | {e.name for e in rank_entries(shared, staging, m, everyone, required=False).values()}
    required |= {name for idx in indexes.values() for name in idx.files}
    joint.publish(shared, dst, staging, m, {}, required)


def _fresh(storage: Storage, path: str) -> None:
    """A retried copy writes its files again: what an earlier try left there goes first."""
    if storage.exists(path):
        storage.remove_tree(path)


class Replicator:
    """One node's background copies of its parts to ``shared``/``root`` (its leader's)."""

    def __init__(self, local: LocalStorage, shared: Storage, root: str, *, attempts: int, backoff: float) -> None:
        self.local, self.shared, self.root = local, shared, root
        self.attempts, self.backoff = attempts, backoff
        self.errors: list[str] = []
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future] = []
        self._copying: set[str] = set()  # local parts queued or being copied: local retention leaves them
        self._lock = threading.Lock()

    def busy(self) -> bool:
        """True while a copy is queued or running."""
        with self._lock:
            return bool(self._copying)

    def copying(self, path: str) -> bool:
        with self._lock:
            return path in self._copying

    def submit(self, name: str, path: str) -> None:
        """Copy the part at ``path`` to ``root/name`` in the background."""
        with self._lock:
            self._copying.add(path)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfmt-replicate")
            self._jobs.append(self._pool.submit(self._copy, name, path))

    def _copy(self, name: str, path: str) -> None:
        dst = self.shared.join(self.root, name)
        where = self.shared.url(dst)

        def retry(i: int, e: BaseException) -> None:
            warnings.warn(f"copying {path} to {where} failed (attempt {i} of {self.attempts}, retrying): {e}",
                          stacklevel=2)

        try:
            copy_with_retries(lambda: copy_part(self.local, path, self.shared, dst),
                              attempts=self.attempts, backoff=self.backoff, on_retry=retry)
        except Exception as e:  # noqa: BLE001 - never into training: reported instead
            msg = f"copying {path} to the shared tier {where} failed: {type(e).__name__}: {e}"
            self.errors.append(msg)
            warnings.warn(msg, stacklevel=2)
        finally:
            with self._lock:
                self._copying.discard(path)

    def wait(self) -> None:
        """Block until every queued copy has finished."""
        jobs, self._jobs = self._jobs, []
        for f in jobs:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
