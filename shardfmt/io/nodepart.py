"""Reading a checkpoint from a node part: this node's files from its own disk, the rest from a copy.

A node part (``commit.nodepart``) holds the root manifest, the rank table and the files this
node's ranks wrote. A load through ``NodePartStorage`` opens the part as a checkpoint: its
``COMMITTED`` is the record in ``NODE_PART``, every file the node holds is read from its disk,
and any other (a replicated tensor another node wrote, a rank index of another node) from the
same save's committed copy on another tier (``shared``: storage and path), when there is one.
Without it such a read is a ``NodeMissError`` naming the file. Every byte is verified against
the manifest's digests wherever it came from, as any load does.
"""

from __future__ import annotations

import os

from shardfmt.errors import CheckpointNotFoundError, ShardfmtError, StorageError
from shardfmt.format.manifest import COMMITTED_NAME
from shardfmt.format.nodepart import MAX_PART_BYTES, NODE_PART_NAME, PartRecord
from shardfmt.io.local import LocalStorage
from shardfmt.io.store import Storage


class NodeMissError(ShardfmtError):
    """A load needs a file that another node holds, and no other tier has this save's copy (not
    a missing file: the checkpoint is whole, on other disks; nothing is quarantined for it)."""


class NodeDiskError(ShardfmtError):
    """This node's own disk failed reading its part (an I/O error): not a failure a retry
    mends, unlike one reading the root's copy (a ``StorageError``): a restore falls back."""


class _DiskReader:
    """A reader of this node's disk whose storage failures are ``NodeDiskError``s."""

    def __init__(self, reader) -> None:
        self._reader = reader

    def readinto(self, offset, buffers) -> None:
        try:
            self._reader.readinto(offset, buffers)
        except StorageError as e:
            raise NodeDiskError(str(e)) from None

    def read_block(self, *args) -> None:
        try:
            self._reader.read_block(*args)
        except StorageError as e:
            raise NodeDiskError(str(e)) from None

    def __getattr__(self, name):  # direct, prefetch, release, close: as the disk's reader has them
        return getattr(self._reader, name)


class NodePartStorage(LocalStorage):
    """``part`` (a node part's directory) read as a checkpoint, its missing files from ``shared``."""

    def __init__(self, part: str, shared: tuple[Storage, str] | None = None) -> None:
        super().__init__()
        self.part = os.path.abspath(part)
        self.shared = shared
        if shared is not None:
            shared[0].stats = self.stats  # one account of the load's bytes, wherever they came from
        self.from_shared: set[str] = set()  # what was read from the copy (names in the checkpoint)

    def _name(self, path: str) -> str | None:
        rel = os.path.relpath(os.path.abspath(path), self.part)
        return None if rel.startswith("..") else rel

    def _elsewhere(self, path: str) -> tuple[Storage, str] | None:
        """Where to read ``path`` when this node does not hold it (None: here)."""
        name = self._name(path)
        if name is None or name == "." or super().exists(path):
            return None
        if self.shared is None:
            raise NodeMissError(f"{path}: another node of the save holds it, and no other tier has a committed "
                                "copy of this save: the node-local tier cannot restore this checkpoint here")
        self.from_shared.add(name)
        st, root = self.shared
        return st, st.join(root, *name.split(os.sep))

    def exists(self, path: str) -> bool:
        if self._name(path) == COMMITTED_NAME:
            return True
        try:
            where = self._elsewhere(path)
        except NodeMissError:
            return False
        return super().exists(path) if where is None else where[0].exists(where[1])

    def size(self, path: str, *, within: str | None = None) -> int:
        where = self._elsewhere(path)
        if where is None:
            return _on_disk(lambda: super(NodePartStorage, self).size(path, within=within))
        return where[0].size(where[1], within=self.shared[1])

    def read_bytes(self, path: str, *, limit: int, within: str | None = None) -> bytes:
        if self._name(path) == COMMITTED_NAME:
            marker = super().join(self.part, NODE_PART_NAME)
            raw = super().read_bytes(marker, limit=MAX_PART_BYTES, within=self.part)
            return PartRecord.parse(raw, source=marker).commit.to_json()
        where = self._elsewhere(path)
        if where is None:
            return _on_disk(lambda: super(NodePartStorage, self).read_bytes(path, limit=limit, within=within))
        return where[0].read_bytes(where[1], limit=limit, within=self.shared[1])

    def open_reader(self, path: str, size: int | None = None, *, within: str | None = None):
        where = self._elsewhere(path)
        if where is None:
            return _DiskReader(_on_disk(lambda: super(NodePartStorage, self).open_reader(path, size, within=within)))
        return where[0].open_reader(where[1], size, within=self.shared[1])


def _on_disk(call):
    """``call()``, a read of this node's disk: its storage failures are ``NodeDiskError``s (a
    missing file stays a ``CheckpointNotFoundError``: the checkpoint's own fault)."""
    try:
        return call()
    except CheckpointNotFoundError:
        raise
    except StorageError as e:
        raise NodeDiskError(str(e)) from None
