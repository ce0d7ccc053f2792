"""A narrow storage interface over local disk and fsspec, with I/O counters.

Everything the format does to bytes at rest goes through ``Storage``: whole small files
(manifest, COMMITTED), streamed data files, ranged scatter reads, listing and removal.
``LocalStorage`` talks to the OS directly (``os.preadv``, ``fsync``, atomic rename and
``renameat2(RENAME_EXCHANGE)``); ``FsspecStorage`` serves any other fsspec URL and has no
atomic rename, so commits there rely on the ``COMMITTED`` object written last.

Every call counts its requests and bytes in ``storage.stats`` so tests and benchmarks can
assert how much was read, at the storage layer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import CheckpointNotFoundError, StorageError


@dataclass
class IOStats:
    """Counters of storage traffic (requests and bytes), safe to update from threads."""

    read_requests: int = 0
    bytes_read: int = 0
    write_requests: int = 0
    bytes_written: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add_read(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.read_requests += requests
            self.bytes_read += nbytes

    def add_write(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.write_requests += requests
            self.bytes_written += nbytes

    def reset(self) -> None:
        with self._lock:
            self.read_requests = self.bytes_read = self.write_requests = self.bytes_written = 0

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"read_requests": self.read_requests, "bytes_read": self.bytes_read,
                    "write_requests": self.write_requests, "bytes_written": self.bytes_written}


class FileWriter(Protocol):
    def write(self, data) -> None: ...
    def close(self, *, sync: bool = True) -> None: ...
    def abort(self) -> None: ...


class FileReader(Protocol):
    size: int
    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None: ...
    def close(self) -> None: ...


class Storage(Protocol):
    """What the format needs from a storage backend. Paths are full paths or URLs."""

    stats: IOStats
    atomic_rename: bool

    def join(self, base: str, *parts: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def size(self, path: str) -> int: ...
    def read_bytes(self, path: str, *, limit: int) -> bytes: ...
    def write_bytes(self, path: str, data: bytes, *, sync: bool = True) -> None: ...
    def open_writer(self, path: str) -> FileWriter: ...
    def open_reader(self, path: str) -> FileReader: ...
    def makedirs(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def remove_tree(self, path: str) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def exchange(self, a: str, b: str) -> None: ...
    def sync_dir(self, path: str) -> None: ...
    def touch(self, path: str) -> None: ...
    def mtime(self, path: str) -> float: ...


def _storage_error(path: str, e: OSError, what: str) -> StorageError:
    if e.errno == errno.ENOENT:
        return CheckpointNotFoundError(f"{path}: does not exist ({what})")
    return StorageError(f"{path}: {what} failed: {os.strerror(e.errno) if e.errno else e}")


# ----------------------------------------------------------------------------- local disk

_libc = None


def _renameat2_exchange(a: str, b: str) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


WRITEBACK_BYTES = 32 << 20


def _sync_file_range(fd: int, offset: int, nbytes: int) -> None:
    """Start writeback of ``[offset, offset + nbytes)`` now (Linux), so fsync waits only for the tail."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "sync_file_range", None)
    if fn is None:
        return
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, don't wait


class _LocalWriter:
    __slots__ = ("_fd", "_path", "_stats", "_written", "_flushed")

    def __init__(self, path: str, stats: IOStats) -> None:
        self._path = path
        self._stats = stats
        self._written = 0
        self._flushed = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise _storage_error(path, e, "create") from None

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        total = len(mv)
        pos = 0
        try:
            while pos < total:
                pos += os.write(self._fd, mv[pos:])
        except OSError as e:
            raise _storage_error(self._path, e, "write") from None
        self._stats.add_write(total)
        self._written += total
        if self._written - self._flushed >= WRITEBACK_BYTES:
            _sync_file_range(self._fd, self._flushed, self._written - self._flushed)
            self._flushed = self._written

    def pwrite(self, offset: int, data) -> None:
        """Write ``data`` at ``offset`` (thread-safe: parts of one file from several threads)."""
        mv = memoryview(data).cast("B")
        total = len(mv)
        pos = 0
        try:
            while pos < total:
                pos += os.pwrite(self._fd, mv[pos:], offset + pos)
        except OSError as e:
            raise _storage_error(self._path, e, "write") from None
        self._stats.add_write(total)

    def start_writeback(self, offset: int, nbytes: int) -> None:
        _sync_file_range(self._fd, offset, nbytes)

    def close(self, *, sync: bool = True) -> None:
        try:
            if sync:
                os.fsync(self._fd)
        except OSError as e:
            raise _storage_error(self._path, e, "fsync") from None
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


class _LocalReader:
    __slots__ = ("_fd", "_path", "_stats", "size")

    def __init__(self, path: str, stats: IOStats) -> None:
        self._path = path
        self._stats = stats
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self.size = os.fstat(self._fd).st_size
        except OSError as e:
            raise _storage_error(path, e, "open") from None

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        want = sum(len(b) for b in buffers)
        got = 0
        bufs = list(buffers)
        try:
            while bufs:
                n = os.preadv(self._fd, bufs[:1024], offset + got)
                if n == 0:
                    raise StorageError(f"{self._path}: unexpected end of file at byte {offset + got} "
                                       f"(wanted {want} bytes from {offset})")
                got += n
                while bufs and n >= len(bufs[0]):
                    n -= len(bufs[0])
                    bufs.pop(0)
                if n:
                    bufs[0] = bufs[0][n:]
        except OSError as e:
            raise _storage_error(self._path, e, "read") from None
        self._stats.add_read(want)

    def close(self) -> None:
        os.close(self._fd)


class LocalStorage:
    """Local disk through the OS: durable writes, atomic renames, scatter reads."""

    atomic_rename = True

    def __init__(self) -> None:
        self.stats = IOStats()

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str) -> int:
        try:
            return os.stat(path).st_size
        except OSError as e:
            raise _storage_error(path, e, "stat") from None

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise _storage_error(path, e, "read") from None
        self.stats.add_read(len(data))
        if len(data) > limit:
            raise StorageError(f"{path}: larger than the {limit}-byte limit")
        return data

    def write_bytes(self, path: str, data: bytes, *, sync: bool = True) -> None:
        w = _LocalWriter(path, self.stats)
        try:
            w.write(data)
        except BaseException:
            w.abort()
            raise
        w.close(sync=sync)

    def open_writer(self, path: str) -> _LocalWriter:
        return _LocalWriter(path, self.stats)

    def open_reader(self, path: str) -> _LocalReader:
        return _LocalReader(path, self.stats)

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _storage_error(path, e, "mkdir") from None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as e:
            raise _storage_error(path, e, "list") from None

    def remove_tree(self, path: str) -> None:
        import shutil

        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)

    def rename(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst)
        except OSError as e:
            raise _storage_error(src, e, f"rename to {dst}") from None

    def exchange(self, a: str, b: str) -> None:
        try:
            _renameat2_exchange(a, b)
        except OSError as e:
            raise _storage_error(a, e, f"atomic exchange with {b}") from None

    def touch(self, path: str) -> None:
        """Refresh ``path``'s mtime (a save's lease on its staging dir)."""
        try:
            os.utime(path)
        except OSError:
            pass

    def mtime(self, path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except OSError as e:
            raise _storage_error(path, e, "stat") from None

    def sync_dir(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise _storage_error(path, e, "open directory") from None
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on directories; the data files are synced
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- fsspec

class _FsspecWriter:
    __slots__ = ("_f", "_path", "_stats")

    def __init__(self, fs: Any, path: str, stats: IOStats) -> None:
        self._path = path
        self._stats = stats
        try:
            self._f = fs.open(path, "wb")
        except OSError as e:
            raise _storage_error(path, e, "create") from None

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        try:
            self._f.write(mv)
        except OSError as e:
            raise _storage_error(self._path, e, "write") from None
        self._stats.add_write(len(mv))

    def close(self, *, sync: bool = True) -> None:
        try:
            self._f.close()
        except OSError as e:
            raise _storage_error(self._path, e, "close") from None

    def abort(self) -> None:
        discard = getattr(self._f, "discard", None)
        try:
            if discard is not None:
                discard()
            else:
                self._f.close()
        except Exception:  # noqa: BLE001 - best effort on an already failing path
            pass


class _FsspecReader:
    __slots__ = ("_fs", "_path", "_stats", "size")

    def __init__(self, fs: Any, path: str, stats: IOStats) -> None:
        self._fs = fs
        self._path = path
        self._stats = stats
        try:
            self.size = int(fs.size(path))
        except (OSError, KeyError) as e:
            raise CheckpointNotFoundError(f"{path}: cannot open ({e})") from None

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        want = sum(len(b) for b in buffers)
        try:
            data = self._fs.cat_file(self._path, start=offset, end=offset + want)
        except OSError as e:
            raise _storage_error(self._path, e, "read") from None
        if len(data) != want:
            raise StorageError(f"{self._path}: short read at byte {offset} ({len(data)} of {want})")
        pos = 0
        for b in buffers:
            b[:] = data[pos : pos + len(b)]
            pos += len(b)
        self._stats.add_read(want)

    def close(self) -> None:
        pass


class FsspecStorage:
    """Any fsspec filesystem. No atomic rename: commit is the COMMITTED object, written last."""

    atomic_rename = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.stats = IOStats()

    def join(self, base: str, *parts: str) -> str:
        return posixpath.join(base, *parts)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(path))
        except (OSError, KeyError) as e:
            raise CheckpointNotFoundError(f"{path}: does not exist ({e})") from None

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        try:
            data = self.fs.cat_file(path, start=0, end=limit + 1)
        except (OSError, KeyError) as e:
            if isinstance(e, FileNotFoundError) or isinstance(e, KeyError):
                raise CheckpointNotFoundError(f"{path}: does not exist") from None
            raise _storage_error(path, e, "read") from None
        self.stats.add_read(len(data))
        if len(data) > limit:
            raise StorageError(f"{path}: larger than the {limit}-byte limit")
        return data

    def write_bytes(self, path: str, data: bytes, *, sync: bool = True) -> None:
        try:
            self.fs.pipe_file(path, bytes(data))
        except OSError as e:
            raise _storage_error(path, e, "write") from None
        self.stats.add_write(len(data))

    def open_writer(self, path: str) -> _FsspecWriter:
        return _FsspecWriter(self.fs, path, self.stats)

    def open_reader(self, path: str) -> _FsspecReader:
        return _FsspecReader(self.fs, path, self.stats)

    def makedirs(self, path: str) -> None:
        try:
            self.fs.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _storage_error(path, e, "mkdir") from None

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: does not exist") from None
        except OSError as e:
            raise _storage_error(path, e, "list") from None
        return sorted(posixpath.basename(str(p).rstrip("/")) for p in entries)

    def remove_tree(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def rename(self, src: str, dst: str) -> None:
        raise StorageError(f"{src}: this storage has no atomic rename")

    def exchange(self, a: str, b: str) -> None:
        raise StorageError(f"{a}: this storage has no atomic exchange")

    def touch(self, path: str) -> None:
        pass  # object stores: the lease lives with issue 5's orphan collection

    def mtime(self, path: str) -> float:
        info = self.fs.info(path)
        t = info.get("mtime") or info.get("LastModified") or info.get("created")
        return t.timestamp() if hasattr(t, "timestamp") else float(t or 0.0)

    def sync_dir(self, path: str) -> None:
        pass


def get_storage(url: str, storage_options: dict | None = None) -> tuple[Storage, str]:
    """Return the storage for ``url`` and the path to use with it.

    Plain paths and ``file://`` URLs get ``LocalStorage``; anything else goes to fsspec.
    """
    if not isinstance(url, (str, os.PathLike)):
        raise StorageError(f"checkpoint path must be a string or path, got {type(url).__name__}")
    url = os.fspath(url)
    if "://" not in url:
        return LocalStorage(), os.path.abspath(url)
    if url.startswith("file://"):
        return LocalStorage(), os.path.abspath(url[len("file://"):])
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise StorageError(f"{url}: no storage backend ({e})") from None
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if protocol == "memory" and not path.startswith("/"):
        path = "/" + path
    return FsspecStorage(fs), path.rstrip("/")
