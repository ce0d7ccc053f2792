"""POSIX plumbing of local disk: opens that refuse special files and links, directory walks,
``renameat2(RENAME_EXCHANGE)``, writeback and read-ahead hints and ``O_DIRECT`` transfers.

``LocalStorage`` (``io.local``) is built on these; the rename commit strategy uses
``renameat2_exchange``. Every OS failure becomes one typed error naming the path
(``storage_error``); a special file or a link where a checkpoint's file should be is a
``SpecialFileError`` (spec section 2).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time
from collections.abc import Callable

from shardfmt.errors import CheckpointNotFoundError, SpecialFileError, StorageError
from shardfmt.io.aligned import DIRECT_ALIGN


def storage_error(path: str, e: OSError, what: str) -> StorageError:
    if e.errno == errno.ENOENT:
        return CheckpointNotFoundError(f"{path}: does not exist ({what})")
    return StorageError(f"{path}: {what} failed: {os.strerror(e.errno) if e.errno else e}")



CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer; O_NOCTTY: a
# terminal device never becomes the process's controlling terminal
_OPEN_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | CLOEXEC
OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC
# a directory only looked up through (O_PATH: no read permission needed, nothing opened for reading)
_WALK_DIR = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | CLOEXEC
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISREG, "a regular file"))


def file_kind(mode: int) -> str:
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
        fd = os.open(path, _OPEN_READ) if within is None else open_below(within, path)
    except OSError as e:
        raise refusal(path, within, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecialFileError(f"{path}: is {file_kind(st.st_mode)}, not a regular file")
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


def open_below(within: str, path: str, *, flags: int = _OPEN_READ) -> int:
    """Open ``path`` one name at a time from the directory ``within``, following no link."""
    names = _names_below(within, path)
    dfd = os.open(within, _WALK_DIR)
    try:
        for name in names[:-1]:
            sub = os.open(name, _WALK_DIR | NOFOLLOW, dir_fd=dfd)
            os.close(dfd)
            dfd = sub
        return os.open(names[-1], flags | NOFOLLOW, dir_fd=dfd)
    finally:
        os.close(dfd)


def refusal(path: str, within: str | None, e: OSError) -> StorageError | SpecialFileError:
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
                return SpecialFileError(f"{at}: is {file_kind(mode)}, not {want}")
    return storage_error(path, e, "open")


def reopen_direct(fd: int, flags: int) -> int:
    """A second, ``O_DIRECT`` handle on the file open as ``fd``: reopened through
    ``/proc/self/fd``, which names the open file itself, not a path (a name swapped for a link
    since ``fd`` was opened cannot redirect it). OSError where there is no ``/proc`` or the
    filesystem refuses direct I/O."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT | CLOEXEC)


_libc = None


def _lib():
    """The C library (loaded once), for the calls Python's ``os`` lacks."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def renameat2_exchange(a: str, b: str) -> None:
    fn = getattr(_lib(), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


WRITEBACK_BYTES = 32 << 20


def sync_file_range(fd: int, offset: int, nbytes: int) -> None:
    """Start writeback of ``[offset, offset + nbytes)`` now (Linux), so fsync waits only for the tail."""
    fn = getattr(_lib(), "sync_file_range", None)
    if fn is None:
        return
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, don't wait


# fallocate(2) errors that mean "this filesystem cannot" (nothing was allocated), not a failure
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.EPERM})
_KEEP_SIZE = 1  # FALLOC_FL_KEEP_SIZE
_fallocate = None


def _fallocate_fn():
    global _fallocate
    if _fallocate is None:
        lib = _lib()
        fn = getattr(lib, "fallocate64", None) or getattr(lib, "fallocate", None)  # 64-bit offsets everywhere
        if fn is not None:
            fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        _fallocate = fn or False
    return _fallocate


def fallocate(fd: int, size: int, *, grow: bool = False) -> bool:
    """Allocate ``fd``'s blocks for its first ``size`` bytes now (Linux ``fallocate``; they read
    as zeros until written). ``grow``: the file's size becomes ``size`` (mode 0: positional
    writes inside it do not extend the file); else it stays the bytes written so far
    (``FALLOC_FL_KEEP_SIZE``: a file cut short still looks short). True when allocated;
    False where the OS or the filesystem cannot (never emulated by writing zeros, as glibc's
    ``posix_fallocate`` would); OSError for a real failure (ENOSPC: the disk is full)."""
    fn = _fallocate_fn()
    if not fn or size <= 0:
        return False
    mode = 0 if grow else _KEEP_SIZE
    while fn(fd, mode, 0, size) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:  # a signal arrived (tmpfs on older kernels): again, as PEP 475 does
            continue
        if err in _NO_FALLOCATE:
            return False
        raise OSError(err, os.strerror(err))
    return True


def fadvise(fd: int, offset: int, length: int, advice: str) -> None:
    """``posix_fadvise(fd, offset, length, POSIX_FADV_<advice>)`` where the OS has it (a hint:
    never an error; ``length`` 0 is to the end of the file)."""
    try:
        os.posix_fadvise(fd, offset, length, getattr(os, f"POSIX_FADV_{advice}"))
    except (OSError, AttributeError):
        pass


_HINT_PIECE_DEFAULT = 128 << 10  # the kernel's default read-ahead (VM_READAHEAD_PAGES)
HINT_PIECE_TTL_S = 60.0  # a device's read-ahead is looked up again after this (``blockdev --setra``)
SYSFS = "/sys"
_pieces: dict[int, tuple[int, float]] = {}  # device -> (bytes, monotonic time looked up)


def _hint_piece(dev: int) -> int:
    """The most bytes one ``POSIX_FADV_WILLNEED`` call makes Linux read on device ``dev``, as
    ``read_ahead_piece`` finds it, looked up again once ``HINT_PIECE_TTL_S`` old."""
    now = time.monotonic()
    known = _pieces.get(dev)
    if known is None or not 0 <= now - known[1] < HINT_PIECE_TTL_S:
        if len(_pieces) >= 64:
            _pieces.clear()
        known = _pieces[dev] = (read_ahead_piece(dev), now)
    return known[0]


def read_ahead_piece(dev: int) -> int:
    """Device ``dev``'s read-ahead in bytes: ``read_ahead_kb`` of its block queue
    (``/sys/dev/block/MAJ:MIN/queue``; a partition's is its disk's, the directory above it),
    which Linux lets one hint read whole on every kernel (newer ones allow up to the larger of
    that and ``max_sectors_kb``); 128 KiB, the kernel's default, where there is none: no
    block device behind the filesystem (btrfs, overlay, tmpfs, NFS: their device numbers have
    major 0) or a read-ahead of 0."""
    try:
        node = os.path.realpath(os.path.join(SYSFS, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}"))
        if os.path.exists(os.path.join(node, "partition")):
            node = os.path.dirname(node)
        with open(os.path.join(node, "queue", "read_ahead_kb")) as f:
            kb = int(f.read().strip())
    except (OSError, ValueError):
        return _HINT_PIECE_DEFAULT
    return kb << 10 if kb > 0 else _HINT_PIECE_DEFAULT


def willneed(fd: int, offset: int, length: int) -> None:
    """Have the kernel start reading ``[offset, offset + length)`` of ``fd`` into the page cache
    (no wait; a hint: never an error).

    One ``POSIX_FADV_WILLNEED`` over a long range reads only its first read-ahead's worth
    (Linux's ``force_page_cache_ra`` caps a call at the larger of ``read_ahead_kb`` and
    ``max_sectors_kb``: 8 MiB of a 256 MiB range on the development VM), so the range is asked
    for in pieces of at most that size, each of which the kernel reads whole."""
    try:
        piece = _hint_piece(os.fstat(fd).st_dev)
    except OSError:
        return
    end = offset + length
    while offset < end:
        fadvise(fd, offset, min(piece, end - offset), "WILLNEED")
        offset += piece


def direct_transfer(call, mv: memoryview, offset: int, want: int, path: str, what: str,
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
            raise storage_error(path, e, what) from None
        ok = False
    count(min(done, want), requests=1 if done >= want else 0)
    return done, ok



def walk_tree(dfd: int, top: str, rel: str, out: list[str]) -> None:
    """Add the files under the directory open as ``dfd`` (``top/rel``) to ``out`` (see
    ``list_tree``); an entry removed while it is listed (another process cleaning up) is skipped."""
    try:
        with os.scandir(dfd) as it:
            entries = list(it)
    except OSError as e:
        raise storage_error(os.path.join(top, rel), e, "list") from None
    for entry in entries:
        name = os.path.join(rel, entry.name)
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                sub = os.open(entry.name, OPEN_DIR | NOFOLLOW, dir_fd=dfd)
                try:
                    walk_tree(sub, top, name, out)
                finally:
                    os.close(sub)
                continue
        except FileNotFoundError:
            continue
        except OSError as e:
            raise refusal(os.path.join(top, name), top, e) from None
        if not stat.S_ISREG(mode):
            raise SpecialFileError(f"{os.path.join(top, name)}: is {file_kind(mode)}, not a regular file")
        out.append(name)


