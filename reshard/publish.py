"""Write a directory of plain files that appears complete or not at all.

On a filesystem the files are written into a staging directory next to the destination and
renamed into place (an existing destination, with ``overwrite``, is renamed aside first and
removed after); on an object store, where nothing renames atomically, they are written in
place. Files are opened when their first byte arrives and closed after their last.
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Mapping

from reshard._shardfmt import FileStream, Storage, commit_strategy
from reshard.errors import HFError
from shardfmt.errors import CheckpointExistsError, ShardfmtError


class LazyFiles(Mapping):
    """The export's files, opened when their first byte arrives and closed after their last
    (files are written one after the other: at most two are open)."""

    def __init__(self, storage: Storage, directory: str, names: list[str], headers: list) -> None:
        self._storage = storage
        self._dir = directory
        self._names = names
        self._headers = headers
        self._open: dict[int, FileStream] = {}
        self._closed: set[int] = set()

    def __getitem__(self, f: int) -> FileStream:
        s = self._open.get(f)
        if s is None:
            if f in self._closed:
                raise HFError(f"internal: {self._names[f]} written after it was closed")
            for g in [g for g in self._open if g < f]:  # files are written in order
                self._open.pop(g).close()
                self._closed.add(g)
            s = self._open[f] = FileStream(self._storage, self._storage.join(self._dir, self._names[f]),
                                           self._headers[f])
        return s

    def __iter__(self):
        return iter(range(len(self._names)))

    def __len__(self) -> int:
        return len(self._names)

    def close_all(self) -> None:
        for f in range(len(self._names)):
            if f not in self._closed:
                self[f].close()
                self._open.pop(f, None)
                self._closed.add(f)

    def abort_all(self) -> None:
        for s in self._open.values():
            s.abort()
        self._open.clear()


def check_destination(storage: Storage, path: str, overwrite: bool) -> None:
    if storage.exists(path) and not overwrite and (not storage.isdir(path) or storage.listdir(path)):
        raise CheckpointExistsError(f"{path}: already exists (pass overwrite=True / --overwrite to replace it)")


def stage(storage: Storage, path: str) -> str:
    """Where files are written before they are published (the destination on object stores)."""
    if commit_strategy(storage).in_place:
        if storage.exists(path):
            storage.remove_tree(path)
        storage.makedirs(path)
        return path
    staging = f"{path.rstrip('/')}.tmp-{uuid.uuid4().hex[:16]}"
    storage.makedirs(staging)
    return staging


def publish(storage: Storage, staging: str, path: str, overwrite: bool) -> None:
    if staging == path:
        return
    storage.sync_dir(staging)
    if storage.exists(path):
        if not overwrite and storage.listdir(path):
            raise CheckpointExistsError(f"{path}: appeared while exporting; refusing to replace it")
        old = f"{path.rstrip('/')}.old-{uuid.uuid4().hex[:16]}"
        storage.rename(path, old)
        storage.rename(staging, path)
        remove_quietly(storage, old)
    else:
        storage.rename(staging, path)
    storage.sync_dir(posixpath.dirname(path.rstrip("/")) or ".")


def remove_quietly(storage: Storage, path: str) -> None:
    try:
        storage.remove_tree(path)
    except (OSError, ShardfmtError):
        pass


__all__ = ["LazyFiles", "check_destination", "publish", "remove_quietly", "stage"]
