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

import warnings
from collections.abc import Callable

from shardfmt.commit import joint
from shardfmt.commit import protocol as _commit
from shardfmt.commit.names import parse_step_dir
from shardfmt.commit.nodepart import read_part
from shardfmt.errors import CommitError, IntegrityError, ShardfmtError
from shardfmt.format import hashing
from shardfmt.format.manifest import MANIFEST_NAME, Manifest
from shardfmt.format.nodepart import NodePart
from shardfmt.format.parse import parse_manifest
from shardfmt.io.documents import rank_entries, read_headers, read_indexes, read_vouched
from shardfmt.io.local import LocalStorage
from shardfmt.io.store import Storage
from shardfmt.training.archive import COPY_PIECE, copy_file, copy_with_retries
from shardfmt.training.copies import BackgroundCopies

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
    owner = f"{m.save_id}/node_{part.index:05d}"
    try:
        if not joint.marked(shared, staging, part.index, m.save_id):  # a retry after the marker: its files are whole
            _copy_files(local, path, m, part, shared, staging, piece, lambda: _check_lease(lease, shared, dst))
            _check_lease(lease, shared, dst)
            joint.mark(shared, staging, part.index, m.save_id)
        _check_lease(lease, shared, dst)
        if not joint.complete(shared, staging, part.count, owner, m.save_id):
            lease.stop()
            return False
        try:
            _check_lease(lease, shared, dst)
            _commit_copy(local, path, m, shared, dst, staging)
        except BaseException:
            joint.release(shared, staging, owner)  # a retry, this node's or another's, claims again
            raise
    except BaseException:
        lease.stop()
        raise
    lease.stop(release=True)
    return True


def _copy_files(local: LocalStorage, path: str, m: Manifest, part: NodePart, shared: Storage, staging: str,
                piece: int, check: Callable[[], None]) -> None:
    """3) This node's data files, each chunk checked on the way, then its ranks' indexes
    (``check`` before each: it raises once the copy's lease is lost)."""
    indexes = read_indexes(local, path, m, part.ranks, required=False)
    found = read_headers(local, path, m, indexes, verify=True)
    buf = bytearray(max(m.chunk_size, piece // m.chunk_size * m.chunk_size))
    for rank in sorted(found):
        for f in found[rank]:
            check()
            _fresh(shared, shared.join(staging, f.name))
            copy_file(local, path, shared, staging, f.name, f.file_record(), m.chunk_size, buf)
    del buf
    for _, e in sorted(rank_entries(local, path, m, part.ranks, required=False).items()):
        check()
        _fresh(shared, shared.join(staging, e.name))
        shared.write_bytes(shared.join(staging, e.name), read_vouched(local, path, e.name, e.size, e.digest))


def _check_lease(lease: _commit.Heartbeat, shared: Storage, dst: str) -> None:
    """A copy that outlived its lease writes nothing more there: the prefix may be another save's now."""
    if lease.lost:
        raise CommitError(f"{shared.url(dst)}: this copy's lease was collected or taken over while it ran; "
                          "nothing more is written there")


def _commit_copy(local: LocalStorage, path: str, m: Manifest, shared: Storage, dst: str, staging: str) -> None:
    """The last node: check every rank's index there, write the rank table, commit."""
    tables = {p.name: read_vouched(local, path, p.name, p.size, p.digest) for p in m.ranks}
    for name, raw in tables.items():
        _fresh(shared, shared.join(staging, name))
        shared.write_bytes(shared.join(staging, name), raw)
    everyone = [r for p in m.ranks for r in range(p.first, p.end)]
    indexes = read_indexes(shared, staging, m, everyone, required=False)  # each against the rank table
    required: dict[str, int | None] = {name: len(raw) for name, raw in tables.items()}
    required |= {e.name: e.size for e in rank_entries(shared, staging, m, everyone, required=False).values()}
    required |= {name: f.size for idx in indexes.values() for name, f in idx.files.items()}
    joint.publish(shared, dst, staging, m, {}, required)


def _fresh(storage: Storage, path: str) -> None:
    """A retried copy writes its files again: what an earlier try left there goes first."""
    if storage.exists(path):
        storage.remove_tree(path)


class Replicator(BackgroundCopies):
    """One node's background copies of its parts to ``shared``/``root`` (its leader's)."""

    def __init__(self, local: LocalStorage, shared: Storage, root: str, *, attempts: int, backoff: float) -> None:
        super().__init__("replicate")
        self.local, self.shared, self.root = local, shared, root
        self.attempts, self.backoff = attempts, backoff

    def copy(self, name: str, path: str, *, then: Callable[[int], None] | None = None) -> None:
        """Copy the part at ``path`` to ``root/name`` in the background, then run ``then(step)``
        there (whether the copy succeeded or not); report a failure, never raise it."""
        def run() -> None:
            self._copy(name, path)
            if then is not None:
                try:
                    then(parse_step_dir(name))
                except Exception as e:  # noqa: BLE001 - never into training (nor into one rank's wait())
                    self.fail(f"{self.shared.url(self.root)}: upkeep after copying {name} failed: "
                              f"{type(e).__name__}: {e}")
        self.submit(path, run)

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
            self.fail(f"copying {path} to the shared tier {where} failed: {type(e).__name__}: {e}")
