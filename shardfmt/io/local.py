"""Local disk through the OS: durable writes, scatter reads, ``O_DIRECT`` where allowed.

``LocalStorage`` serves the ``ByteStore`` interface (``io.store``) with ``os.preadv``,
``pwrite`` and ``fsync``; every read opens a regular file only, and under a checkpoint
through no symbolic link (``io.posix.open_regular``). It also keeps what only a filesystem
can do — ``rename``, ``exchange`` (``renameat2``), ``sync_dir``, ``touch`` and ``mtime`` —
for the rename commit strategy (``commit.rename``), outside the byte-store interface.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Sequence

from shardfmt.errors import IntegrityError, SpecialFileError
from shardfmt.io import choice
from shardfmt.io.aligned import DIRECT_ALIGN
from shardfmt.io.modes import Choice
from shardfmt.io.posix import (
    CLOEXEC,
    OPEN_DIR,
    WRITEBACK_BYTES,
    direct_transfer,
    fadvise,
    fallocate,
    open_below,
    open_regular,
    refusal,
    renameat2_exchange,
    reopen_direct,
    storage_error,
    sync_file_range,
    walk_tree,
    willneed,
)
from shardfmt.io.store import PROCESS_IO, IOStats


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
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC, 0o644)
        except OSError as e:
            raise storage_error(path, e, "create") from None

    def reserve(self, size: int, *, grow: bool = False) -> None:
        """Allocate the file's ``size`` bytes on the device before any is written
        (``fallocate``), where the filesystem can; nothing happens where it cannot.

        The filesystem then lays the file out in a few long runs, so it reads back sequentially
        even though threads write its parts out of order; without it, the parallel writes of
        two ranks' files interleave on the device in part-sized pieces. A disk without
        ``size`` bytes free fails here, before a byte of the file is written: a StorageError
        naming it. ``grow``: the file's size becomes ``size`` at once, so direct writes of its
        parts land inside it instead of extending it (which ext4 and XFS serialise; ext4 runs
        writes into allocated blocks in parallel since Linux 6.3). Otherwise the size stays the
        bytes written, and a file cut short by a crash still looks short."""
        try:
            fallocate(self._fd, size, grow=grow)
        except OSError as e:
            raise storage_error(self._path, e, f"allocating {size} bytes") from None

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        total = len(mv)
        pos = 0
        try:
            while pos < total:
                pos += os.write(self._fd, mv[pos:])
        except OSError as e:
            raise storage_error(self._path, e, "write") from None
        self._stats.add_write(total)
        self._written += total
        if self._written - self._flushed >= WRITEBACK_BYTES:
            sync_file_range(self._fd, self._flushed, self._written - self._flushed)
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
            raise storage_error(self._path, e, "write") from None
        self._stats.add_write(total)

    def start_writeback(self, offset: int, nbytes: int) -> None:
        sync_file_range(self._fd, offset, nbytes)

    def open_direct(self) -> bool:
        """Open a second handle on the file with ``O_DIRECT``: blocks written through
        ``pwrite_block`` then go from memory to the device, without a copy into the page
        cache. False (nothing changes) where the device writes faster buffered (``io.choice``),
        or the OS or the filesystem has no direct I/O."""
        if not choice.use_direct(os.path.dirname(self._path) or ".", "write"):
            return False
        try:
            self._dfd = reopen_direct(self._fd, os.O_WRONLY)
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
            pos, self._direct = direct_transfer(lambda v, o: os.pwrite(self._dfd, v, o), mv, offset, nbytes,
                                                 self._path, "write", self._stats.add_write)
            if pos >= nbytes:
                return
            mv, offset, nbytes = mv[pos:], offset + pos, nbytes - pos
        self.pwrite(offset, mv[:nbytes])

    def truncate(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            raise storage_error(self._path, e, "truncate") from None

    def _drop_direct(self) -> None:
        dfd, self._dfd, self._direct = self._dfd, None, False
        if dfd is not None:
            try:
                os.close(dfd)
            except OSError:
                pass

    def close(self, *, sync: bool = True) -> None:
        """Close the file; ``sync``: durable first (fsync), then out of the page cache (its pages
        are clean now: ``POSIX_FADV_DONTNEED``), so a save leaves the training job's cache as it was."""
        self._drop_direct()
        try:
            if sync:
                os.fsync(self._fd)
                fadvise(self._fd, 0, 0, "DONTNEED")
        except OSError as e:
            raise storage_error(self._path, e, "fsync") from None
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

    __slots__ = ("_fd", "_dfd", "_chosen", "_refused", "_lock", "_path", "_stats", "size", "device")

    def __init__(self, path: str, stats: IOStats, *, within: str | None = None) -> None:
        self._path = path
        self._stats = stats
        self._dfd: int | None = None  # the O_DIRECT handle, opened when first wanted
        self._chosen: bool | None = None  # the device's choice (``io.choice``); None: not asked yet
        self._refused = False  # the filesystem refused O_DIRECT on this file (at the open or a read)
        self._lock = threading.Lock()
        self._fd, st = open_regular(path, within=within)
        self.size = st.st_size
        self.device = st.st_dev  # the device the file is on (a load tries both ways on one device at a time)

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
            raise storage_error(self._path, e, "read") from None
        self._stats.add_read(want)

    @property
    def direct(self) -> bool:
        """Whether ``read_block`` goes around the page cache (``O_DIRECT``) by the device's
        choice: where it reads faster so (``io.choice``), and the filesystem allows it (the
        handle is opened at the first question, on the file already open)."""
        with self._lock:
            if self._chosen is None:
                self._chosen = choice.use_direct(os.path.dirname(self._path) or ".", "read")
        return self._chosen and self.can_direct()

    def measured(self) -> Choice | None:
        """The device's choice for reads and the measurement behind it (``io.choice.measured``):
        a load whose device measured clearly does not try both ways again (``loading.trial``)."""
        return choice.measured(os.path.dirname(self._path) or ".", "read")

    def can_direct(self) -> bool:
        """Whether ``read_block`` can go around the page cache, whatever the device's choice:
        the ``O_DIRECT`` handle is opened here if it is not yet (False where the filesystem
        refuses it). A load that tries both ways (``loading.trial``) asks this."""
        with self._lock:
            if self._dfd is None and not self._refused:
                try:
                    self._dfd = reopen_direct(self._fd, os.O_RDONLY)
                except OSError:
                    self._refused = True
            return self._dfd is not None and not self._refused

    def read_block(self, offset: int, buffer: memoryview, nbytes: int) -> None:
        """Read the ``nbytes`` at ``offset`` into the start of ``buffer``, where ``offset``, the
        address of ``buffer`` and its length are multiples of ``DIRECT_ALIGN`` and its length
        covers ``nbytes`` (the rest of it may be overwritten): straight from the device where
        the handle is open (``can_direct``) or the device's choice is direct, else through the
        page cache. Only the whole blocks holding the ``nbytes`` are read, however long
        ``buffer`` is."""
        if (self._dfd is not None and not self._refused) or self.direct:
            blocks = buffer[:-(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN]
            got, ok = direct_transfer(lambda v, o: os.preadv(self._dfd, [v], o), blocks, offset, nbytes,
                                      self._path, "read", self._stats.add_read)
            if not ok:
                with self._lock:
                    self._refused = True
            if got >= nbytes:
                return
            buffer, offset, nbytes = buffer[got:], offset + got, nbytes - got
        self.readinto(offset, [buffer[:nbytes]])

    def prefetch(self, offset: int, length: int) -> None:
        """Ask the kernel to start reading ``[offset, offset + length)`` now (no wait), all of it
        (``posix.willneed``: one plain hint reads only its first read-ahead's worth)."""
        willneed(self._fd, offset, length)

    def release(self, offset: int, length: int) -> None:
        """Tell the kernel ``[offset, offset + length)`` is done with (``POSIX_FADV_DONTNEED``):
        its clean pages leave the page cache, which keeps what the training job cached."""
        fadvise(self._fd, offset, length, "DONTNEED")

    def close(self) -> None:
        dfd, self._dfd = self._dfd, None
        try:
            if dfd is not None:
                os.close(dfd)
        finally:
            os.close(self._fd)


# Reads merge across gaps of at most this many bytes. One rank alone would gain from larger
# gaps (a request costs ~50-100 us, 64 KiB ~30-60 us at 1-2 GB/s), but thousands of ranks
# loading at once share the disks' bandwidth and pay their request overheads in parallel, so
# bytes are what a job's restore waits for. The 8B layout's one rank at 4096 ranks
# (benchmarks/README, format v2) reads 1.10x what it needs in 868 reads at 16 KiB, 1.62x in
# 552 at 64 KiB, 5.4x in 15 at 1 MiB (the old default).
LOCAL_MAX_GAP = 16 << 10


class LocalStorage:
    """Local disk through the OS: durable writes, scatter reads; and, for the rename commit
    strategy only, atomic renames and directory mtimes."""

    remote = False
    max_gap = LOCAL_MAX_GAP
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
            raise storage_error(path, e, "read") from None
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
            raise storage_error(path, e, "mkdir") from None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as e:
            raise storage_error(path, e, "list") from None

    def remove_tree(self, path: str) -> None:
        """Remove ``path``: a directory with all in it (``shutil.rmtree`` removes the links it
        holds without following them), or a file or link itself (never what it points at)."""
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)

    def bucket_exists(self, path: str) -> bool:
        return True  # no buckets on a filesystem

    def list_tree(self, path: str, *, within: str | None = None) -> list[str]:
        """Every file under ``path``, relative to it ([] when ``path`` does not exist or is a
        file). Walked through directory descriptors, following no link: SpecialFileError at
        the first entry that is neither a regular file nor a directory (a link, FIFO, socket or
        device; no save writes one). ``within``: ``path``'s own names below it are not followed
        either."""
        try:
            fd = open_below(within, path, flags=OPEN_DIR) if within is not None else os.open(path, OPEN_DIR)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return []
            refused = refusal(path, within, e)
            if e.errno == errno.ENOTDIR and not isinstance(refused, SpecialFileError):
                return []  # a regular file: nothing under it
            raise refused from None
        out: list[str] = []
        try:
            walk_tree(fd, path, "", out)
        finally:
            os.close(fd)
        return sorted(out)

    # -- what only a filesystem can do: the rename commit strategy's (commit.rename), no byte I/O
    def rename(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst)
        except OSError as e:
            raise storage_error(src, e, f"rename to {dst}") from None

    def exchange(self, a: str, b: str) -> None:
        try:
            renameat2_exchange(a, b)
        except OSError as e:
            raise storage_error(a, e, f"atomic exchange with {b}") from None

    def touch(self, path: str) -> None:
        """Refresh ``path``'s mtime (a save's lease on its staging dir, which is its own)."""
        try:
            os.utime(path)
        except OSError:
            pass

    def mtime(self, path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except OSError as e:
            raise storage_error(path, e, "stat") from None

    def sync_dir(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise storage_error(path, e, "open directory") from None
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on directories; the data files are synced
        finally:
            os.close(fd)
