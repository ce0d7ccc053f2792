"""The byte store: the narrow interface every storage backend serves, and its I/O counters.

Everything the format does to bytes at rest goes through a ``ByteStore``: whole small files
(manifest, COMMITTED), streamed data files, ranged scatter reads, listing and removal. It
carries no commit policy: how a save is staged and published (rename on a filesystem,
marker-last on an object store) is ``shardfmt.commit``'s, chosen once per store by
``commit.strategy.commit_strategy``. Backends: ``io.local.LocalStorage`` (the OS directly)
and ``io.fsspec.FsspecStorage`` (any other fsspec URL, S3 through s3fs); ``io.registry``
picks one for a URL.

Every call counts its requests and bytes in ``store.stats`` so tests and benchmarks can
assert how much was read, at the storage layer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class IOStats:
    """Counters of storage traffic (requests and bytes), safe to update from threads.

    Every storage's counters also feed ``PROCESS_IO``, the process's totals
    (``shardfmt.io.store.io_stats()``): snapshot it before and after a save or load to see its traffic.
    """

    read_requests: int = 0
    bytes_read: int = 0
    write_requests: int = 0
    bytes_written: int = 0
    parent: IOStats | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add_read(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.read_requests += requests
            self.bytes_read += nbytes
        if self.parent is not None:
            self.parent.add_read(nbytes, requests)

    def add_write(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.write_requests += requests
            self.bytes_written += nbytes
        if self.parent is not None:
            self.parent.add_write(nbytes, requests)

    def reset(self) -> None:
        with self._lock:
            self.read_requests = self.bytes_read = self.write_requests = self.bytes_written = 0

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"read_requests": self.read_requests, "bytes_read": self.bytes_read,
                    "write_requests": self.write_requests, "bytes_written": self.bytes_written}


PROCESS_IO = IOStats()


def io_stats() -> dict[str, int]:
    """This process's storage traffic so far: requests and bytes read and written, every backend."""
    return PROCESS_IO.snapshot()


class FileWriter(Protocol):
    def write(self, data) -> None: ...
    def close(self, *, sync: bool = True) -> None: ...
    def abort(self) -> None: ...
    # Optional, where the file's blocks can be allocated ahead (local files):
    # ``reserve(size, grow=...)``, the file's ``size`` bytes allocated before the first is written.


def reserve(writer: FileWriter, size: int, *, grow: bool = False) -> None:
    """Allocate the file ``writer`` writes at its final ``size`` before its first byte, where
    the writer can (a local file's ``reserve``: one contiguous layout, and a disk without the
    room fails here); nothing elsewhere (an object store). ``grow``: the file takes that size
    at once (parts written in parallel, direct: see ``LocalStorage``'s writer)."""
    ahead = getattr(writer, "reserve", None)
    if ahead is not None:
        ahead(size, grow=grow)


class FileReader(Protocol):
    size: int
    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None: ...
    def prefetch(self, offset: int, length: int) -> None: ...  # a hint: start fetching, do not wait
    def close(self) -> None: ...
    # Optional, where the bytes pass through this machine's page cache (local files):
    # ``release(offset, length)``, a hint that those bytes are done with (uncache them).


class ByteStore(Protocol):
    """What the format needs from a storage backend: bytes, never commit policy. Paths are
    full paths or URLs (``join`` builds them, ``url`` shows them).

    The reads (``size``, ``read_bytes``, ``open_reader``, ``list_tree``) take only regular
    files, never blocking on anything else; ``within`` names a checkpoint above ``path``,
    below which no name is resolved through a symbolic link (spec section 2), where the
    backend has links at all. A missing file is a ``CheckpointNotFoundError``; every other
    failure a ``StorageError`` naming the path.

    Declared traits (read, never probed):

    - ``remote``: an object store. Every request is a network round trip (issue them
      together; take sizes from the manifest, not from a request), prefixes exist only by
      holding objects (no directories; ``makedirs`` does nothing), and a missing bucket is
      not a missing directory (``bucket_exists``).
    - ``max_gap``: reads coalesce across gaps up to this many bytes (a request's worth).
    - ``read_concurrency``: ranged reads worth having in flight at once.
    - ``lease_seconds``: the lease the commit strategy gives a save here (storage option
      ``lease_seconds``; spec/ROOTS.md section 1).
    """

    stats: IOStats
    remote: bool
    max_gap: int
    read_concurrency: int
    lease_seconds: float

    def url(self, path: str) -> str: ...
    def join(self, base: str, *parts: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def bucket_exists(self, path: str) -> bool: ...
    def size(self, path: str, *, within: str | None = None) -> int: ...
    def read_bytes(self, path: str, *, limit: int, within: str | None = None) -> bytes: ...
    def write_bytes(self, path: str, data: bytes, *, sync: bool = True, exclusive: bool = False) -> None: ...
    def open_writer(self, path: str) -> FileWriter: ...
    def open_reader(self, path: str, size: int | None = None, *, within: str | None = None) -> FileReader: ...
    def makedirs(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def list_tree(self, path: str, *, within: str | None = None) -> list[str]: ...
    def remove_tree(self, path: str) -> None: ...


Storage = ByteStore  # the name the layers above use for it
