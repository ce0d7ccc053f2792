"""Page-cache residency of files (``mincore`` over a read-only mapping), for the tests that check a
checkpoint leaves the training job's page cache as it found it."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def resident(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages in all)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(_map_address(m)), size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed", path)
        return sum(v & 1 for v in vec), pages


def _map_address(m: mmap.mmap) -> int:
    """The address of a read-only mapping (``mmap`` gives none; ctypes views need it writable)."""
    return np.frombuffer(m, dtype=np.uint8).ctypes.data


def resident_fraction(paths) -> float:
    got = total = 0
    for p in paths:
        r, n = resident(p)
        got, total = got + r, total + n
    return got / total if total else 0.0


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def drops_pages(directory: str) -> bool:
    """Whether clean pages of a file in ``directory`` leave the page cache when told to (not on
    tmpfs, whose pages are the file)."""
    path = os.path.join(directory, ".pagecache-probe")
    with open(path, "wb") as f:
        f.write(b"\1" * (16 * PAGE))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        return resident(path)[0] == 0
    finally:
        os.unlink(path)
