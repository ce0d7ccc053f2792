"""A narrow storage interface over local disk and fsspec, with I/O counters.

Everything the format does to bytes at rest goes through ``Storage``: whole small files
(manifest, COMMITTED), streamed data files, ranged scatter reads, listing and removal.
``LocalStorage`` talks to the OS directly (``os.preadv``, ``fsync``, atomic rename and
``renameat2(RENAME_EXCHANGE)``); ``objstore.FsspecStorage`` serves any other fsspec URL
(S3 through s3fs) and has no atomic rename, so commits there rely on the ``COMMITTED``
object written last.

Every call counts its requests and bytes in ``storage.stats`` so tests and benchmarks can
assert how much was read, at the storage layer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shardfmt.errors import CheckpointNotFoundError, IntegrityError, SpecialFileError, StorageError
from shardfmt.io.aligned import DIRECT_ALIGN


@dataclass
class IOStats:
    """Counters of storage traffic (requests and bytes), safe to update from threads.

    Every storage's counters also feed ``PROCESS_IO``, the process's totals
    (``shardfmt.io.storage.io_stats()``): snapshot it before and after a save or load to see its traffic.
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


class FileReader(Protocol):
    size: int
    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None: ...
    def prefetch(self, offset: int, length: int) -> None: ...  # a hint: start fetching, do not wait
    def close(self) -> None: ...


class Storage(Protocol):
    """What the format needs from a storage backend. Paths are full paths or URLs.

    The reads (``size``, ``read_bytes``, ``open_reader``, ``list_tree``) take only regular
    files, never blocking on anything else; ``within`` names a checkpoint above ``path``,
    below which no name is resolved through a symbolic link (spec section 2).
    """

    stats: IOStats
    atomic_rename: bool
    object_store: bool      # requests cost round trips; no directories, no rename
    max_gap: int            # reads coalesce across gaps up to this many bytes (a request's worth)
    read_concurrency: int   # ranged reads in flight at once
    lease_seconds: float    # default lease of a save in progress (spec/ROOTS.md section 1)

    def url(self, path: str) -> str: ...

    def join(self, base: str, *parts: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def size(self, path: str, *, within: str | None = None) -> int: ...
    def read_bytes(self, path: str, *, limit: int, within: str | None = None) -> bytes: ...
    def write_bytes(self, path: str, data: bytes, *, sync: bool = True, exclusive: bool = False) -> None: ...
    def open_writer(self, path: str) -> FileWriter: ...
    def open_reader(self, path: str, size: int | None = None, *, within: str | None = None) -> FileReader: ...
    def makedirs(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def remove_tree(self, path: str) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def exchange(self, a: str, b: str) -> None: ...
    def sync_dir(self, path: str) -> None: ...
    def touch(self, path: str, owner: str = "") -> bool: ...
    def mtime(self, path: str) -> float: ...
    def drop_lease(self, path: str) -> None: ...
    def take_lease(self, path: str, owner: str = "") -> None: ...
    def list_tree(self, path: str, *, within: str | None = None) -> list[str]: ...


def _storage_error(path: str, e: OSError, what: str) -> StorageError:
    if e.errno == errno.ENOENT:
        return CheckpointNotFoundError(f"{path}: does not exist ({what})")
    return StorageError(f"{path}: {what} failed: {os.strerror(e.errno) if e.errno else e}")


# ----------------------------------------------------------------------------- local disk

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer; O_NOCTTY: a
# terminal device never becomes the process's controlling terminal
_OPEN_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | _CLOEXEC
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
# a directory only looked up through (O_PATH: no read permission needed, nothing opened for reading)
_WALK_DIR = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISREG, "a regular file"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, *, within: str | None = None) -> tuple[int, os.stat_result]:
    """Open the regular file ``path`` for reading; return its descriptor and ``fstat``.

    The open never blocks (``O_NONBLOCK``: a FIFO's open returns at once) and reads nothing;
    anything but a regular file (FIFO, socket, device, directory) is refused, before a byte
    is read, with a SpecialFileError naming the path and what it is. ``within`` is a
    directory above ``path`` (a checkpoint): each name below it is opened relative to the
    directory before it, following no symbolic link (``O_NOFOLLOW``), so a link anywhere
    under ``within`` is refused, and one swapped in later cannot redirect the open; ``within``
    itself may be a link. Without ``within`` (files of other formats) links are followed.
    """
    try:
        fd = os.open(path, _OPEN_READ) if within is None else _open_below(within, path)
    except OSError as e:
        raise _refusal(path, within, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecialFileError(f"{path}: is {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _names_below(within: str, path: str) -> list[str]:
    rel = os.path.relpath(path, within)
    names = rel.split(os.sep)
    if rel == "." or ".." in names:
        raise ValueError(f"{path} is not below {within}")
    return names


def _open_below(within: str, path: str, *, flags: int = _OPEN_READ) -> int:
    """Open ``path`` one name at a time from the directory ``within``, following no link."""
    names = _names_below(within, path)
    dfd = os.open(within, _WALK_DIR)
    try:
        for name in names[:-1]:
            sub = os.open(name, _WALK_DIR | _NOFOLLOW, dir_fd=dfd)
            os.close(dfd)
            dfd = sub
        return os.open(names[-1], flags | _NOFOLLOW, dir_fd=dfd)
    finally:
        os.close(dfd)


def _refusal(path: str, within: str | None, e: OSError) -> StorageError | SpecialFileError:
    """The error for a failed open of ``path``: SpecialFileError naming the name on the way that
    is a link or not a directory (ELOOP, ENOTDIR) or a socket (ENXIO), else a storage error."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
        names = _names_below(within, path) if within is not None else [path]
        at = within or ""
        for k, name in enumerate(names):
            at = os.path.join(at, name)
            try:
                mode = os.lstat(at).st_mode if within is not None else os.stat(at).st_mode
            except OSError:
                break
            last = k == len(names) - 1
            if stat.S_ISLNK(mode):
                return SpecialFileError(f"{at}: is a symbolic link; the files of a checkpoint are read only by "
                                        f"their own names under {within}, never through a link")
            if not stat.S_ISREG(mode) if last else not stat.S_ISDIR(mode):
                want = "a regular file" if last else "a directory"
                return SpecialFileError(f"{at}: is {_kind(mode)}, not {want}")
    return _storage_error(path, e, "open")


def _reopen_direct(fd: int, flags: int) -> int:
    """A second, ``O_DIRECT`` handle on the file open as ``fd``: reopened through
    ``/proc/self/fd``, which names the open file itself, not a path (a name swapped for a link
    since ``fd`` was opened cannot redirect it). OSError where there is no ``/proc`` or the
    filesystem refuses direct I/O."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT | _CLOEXEC)


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


def direct_io_enabled() -> bool:
    """Whether large transfers may go around the page cache (``SHARDFMT_DIRECT_IO=0`` turns it off)."""
    return hasattr(os, "O_DIRECT") and os.environ.get("SHARDFMT_DIRECT_IO", "1") != "0"


def _direct_transfer(call, mv: memoryview, offset: int, want: int, path: str, what: str,
                     count: Callable[..., None]) -> tuple[int, bool]:
    """Move ``want`` bytes between ``mv`` and the file at ``offset`` with ``call(view, offset) -> n``
    on an ``O_DIRECT`` handle, counting them with ``count`` (``IOStats.add_read``/``add_write``).
    Stops short at a count that is not a whole block (the file's end, or a short write): the
    caller moves the rest through the page cache (which counts it, and names a truncated
    file). Return the bytes moved, and False once the filesystem refuses direct I/O (EINVAL)
    so the caller stops using it."""
    done, ok = 0, True
    try:
        while done < want:
            n = call(mv[done:], offset + done)
            if n <= 0 or (n % DIRECT_ALIGN and done + n < want):
                break
            done += n
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise _storage_error(path, e, what) from None
        ok = False
    count(min(done, want), requests=1 if done >= want else 0)
    return done, ok


class _LocalWriter:
    __slots__ = ("_fd", "_dfd", "_direct", "_path", "_stats", "_written", "_flushed")

    def __init__(self, path: str, stats: IOStats) -> None:
        self._path = path
        self._stats = stats
        self._written = 0
        self._flushed = 0
        self._dfd: int | None = None  # the O_DIRECT handle, open until close/abort
        self._direct = False  # whether blocks go through it (False once the filesystem refused one)
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

    def open_direct(self) -> bool:
        """Open a second handle on the file with ``O_DIRECT``: blocks written through
        ``pwrite_block`` then go from memory to the device, without a copy into the page
        cache. False (nothing changes) where the OS or the filesystem has no direct I/O."""
        if not direct_io_enabled():
            return False
        try:
            self._dfd = _reopen_direct(self._fd, os.O_WRONLY)
        except OSError:
            return False
        self._direct = True
        return True

    def pwrite_block(self, offset: int, data, nbytes: int) -> None:
        """Write the first ``nbytes`` of ``data`` at ``offset``, where ``offset``, the address of
        ``data`` and ``len(data)`` are multiples of ``DIRECT_ALIGN`` (``data`` past ``nbytes``
        is padding: the caller trims the file with ``truncate``). Direct where ``open_direct``
        succeeded, else, or once the filesystem refuses it (EINVAL), through the page cache."""
        mv = memoryview(data).cast("B")
        if self._direct:
            pos, self._direct = _direct_transfer(lambda v, o: os.pwrite(self._dfd, v, o), mv, offset, nbytes,
                                                 self._path, "write", self._stats.add_write)
            if pos >= nbytes:
                return
            mv, offset, nbytes = mv[pos:], offset + pos, nbytes - pos
        self.pwrite(offset, mv[:nbytes])

    def truncate(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            raise _storage_error(self._path, e, "truncate") from None

    def _drop_direct(self) -> None:
        dfd, self._dfd, self._direct = self._dfd, None, False
        if dfd is not None:
            try:
                os.close(dfd)
            except OSError:
                pass

    def close(self, *, sync: bool = True) -> None:
        self._drop_direct()
        try:
            if sync:
                os.fsync(self._fd)
        except OSError as e:
            raise _storage_error(self._path, e, "fsync") from None
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        self._drop_direct()
        try:
            os.close(self._fd)
        except OSError:
            pass


class _LocalReader:
    """Ranged reads of one regular file, opened once (``open_regular``: ``within`` as there)."""

    __slots__ = ("_fd", "_dfd", "_direct", "_lock", "_path", "_stats", "size")

    def __init__(self, path: str, stats: IOStats, *, within: str | None = None) -> None:
        self._path = path
        self._stats = stats
        self._dfd: int | None = None  # the O_DIRECT handle, opened at the first block read
        self._direct = direct_io_enabled()
        self._lock = threading.Lock()
        self._fd, st = open_regular(path, within=within)
        self.size = st.st_size

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        want = sum(len(b) for b in buffers)
        got = 0
        bufs = list(buffers)
        try:
            while bufs:
                n = os.preadv(self._fd, bufs[:1024], offset + got)
                if n == 0:
                    raise IntegrityError(f"{self._path}: unexpected end of file at byte {offset + got} "
                                         f"(wanted {want} bytes from {offset}; truncated?)")
                got += n
                while bufs and n >= len(bufs[0]):
                    n -= len(bufs[0])
                    bufs.pop(0)
                if n:
                    bufs[0] = bufs[0][n:]
        except OSError as e:
            raise _storage_error(self._path, e, "read") from None
        self._stats.add_read(want)

    @property
    def direct(self) -> bool:
        """Whether ``read_block`` goes around the page cache (``O_DIRECT``): the handle is
        opened at the first question, on the file already open (False where the filesystem
        refuses it)."""
        with self._lock:
            if self._dfd is None and self._direct:
                try:
                    self._dfd = _reopen_direct(self._fd, os.O_RDONLY)
                except OSError:
                    self._direct = False
        return self._direct

    def read_block(self, offset: int, buffer: memoryview, nbytes: int) -> None:
        """Read the ``nbytes`` at ``offset`` into the start of ``buffer``, where ``offset``, the
        address of ``buffer`` and its length are multiples of ``DIRECT_ALIGN`` and its length
        covers ``nbytes`` (the rest of it may be overwritten): straight from the device where
        the filesystem allows, else through the page cache."""
        if self.direct:
            got, self._direct = _direct_transfer(lambda v, o: os.preadv(self._dfd, [v], o), buffer, offset, nbytes,
                                                 self._path, "read", self._stats.add_read)
            if got >= nbytes:
                return
            buffer, offset, nbytes = buffer[got:], offset + got, nbytes - got
        self.readinto(offset, [buffer[:nbytes]])

    def prefetch(self, offset: int, length: int) -> None:
        """Ask the kernel to start reading ``[offset, offset + length)`` now (no wait)."""
        try:
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass

    def close(self) -> None:
        dfd, self._dfd = self._dfd, None
        try:
            if dfd is not None:
                os.close(dfd)
        finally:
            os.close(self._fd)


class LocalStorage:
    """Local disk through the OS: durable writes, atomic renames, scatter reads."""

    atomic_rename = True
    object_store = False
    max_gap = 1 << 20  # reading 1 MiB of gap costs less than a second request
    read_concurrency = os.cpu_count() or 1
    lease_seconds = 600.0

    def __init__(self) -> None:
        self.stats = IOStats(parent=PROCESS_IO)

    def url(self, path: str) -> str:
        return path

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str, *, within: str | None = None) -> int:
        fd, st = open_regular(path, within=within)
        os.close(fd)
        return st.st_size

    def read_bytes(self, path: str, *, limit: int, within: str | None = None) -> bytes:
        fd, _ = open_regular(path, within=within)
        try:
            with open(fd, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise _storage_error(path, e, "read") from None
        self.stats.add_read(len(data))
        if len(data) > limit:
            raise IntegrityError(f"{path}: larger than the {limit}-byte limit")  # not a storage failure
        return data

    def write_bytes(self, path: str, data: bytes, *, sync: bool = True, exclusive: bool = False) -> None:
        w = _LocalWriter(path, self.stats)  # O_EXCL: always exclusive
        try:
            w.write(data)
        except BaseException:
            w.abort()
            raise
        w.close(sync=sync)

    def open_writer(self, path: str) -> _LocalWriter:
        return _LocalWriter(path, self.stats)

    def open_reader(self, path: str, size: int | None = None, *, within: str | None = None) -> _LocalReader:
        return _LocalReader(path, self.stats, within=within)

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
        """Remove ``path``: a directory with all in it (``shutil.rmtree`` removes the links it
        holds without following them), or a file or link itself (never what it points at)."""
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

    def touch(self, path: str, owner: str = "") -> bool:
        """Refresh ``path``'s mtime (a save's lease on its staging dir, which is its own)."""
        try:
            os.utime(path)
        except OSError:
            pass
        return True

    def mtime(self, path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except OSError as e:
            raise _storage_error(path, e, "stat") from None

    def drop_lease(self, path: str) -> None:
        pass  # the lease is the directory's mtime

    def take_lease(self, path: str, owner: str = "") -> None:
        pass  # a staging dir is the save's own (its name holds the save id)

    def list_tree(self, path: str, *, within: str | None = None) -> list[str]:
        """Every file under ``path``, relative to it ([] when ``path`` does not exist or is a
        file). Walked through directory descriptors, following no link: SpecialFileError at
        the first entry that is neither a regular file nor a directory (a link, FIFO, socket or
        device; no save writes one). ``within``: ``path``'s own names below it are not followed
        either."""
        try:
            fd = _open_below(within, path, flags=_OPEN_DIR) if within is not None else os.open(path, _OPEN_DIR)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return []
            refused = _refusal(path, within, e)
            if e.errno == errno.ENOTDIR and not isinstance(refused, SpecialFileError):
                return []  # a regular file: nothing under it
            raise refused from None
        out: list[str] = []
        try:
            _walk(fd, path, "", out)
        finally:
            os.close(fd)
        return sorted(out)

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


def _walk(dfd: int, top: str, rel: str, out: list[str]) -> None:
    """Add the files under the directory open as ``dfd`` (``top/rel``) to ``out`` (see
    ``list_tree``); an entry removed while it is listed (another process cleaning up) is skipped."""
    try:
        with os.scandir(dfd) as it:
            entries = list(it)
    except OSError as e:
        raise _storage_error(os.path.join(top, rel), e, "list") from None
    for entry in entries:
        name = os.path.join(rel, entry.name)
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                sub = os.open(entry.name, _OPEN_DIR | _NOFOLLOW, dir_fd=dfd)
                try:
                    _walk(sub, top, name, out)
                finally:
                    os.close(sub)
                continue
        except FileNotFoundError:
            continue
        except OSError as e:
            raise _refusal(os.path.join(top, name), top, e) from None
        if not stat.S_ISREG(mode):
            raise SpecialFileError(f"{os.path.join(top, name)}: is {_kind(mode)}, not a regular file")
        out.append(name)


