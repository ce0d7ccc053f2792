"""Page-aligned memory for direct I/O (``O_DIRECT``): the alignment, bounce buffers, addresses.

Direct I/O moves bytes between the device and user memory without the page cache: no copy
into page-cache pages the kernel must first allocate, and no eviction of the training job's
cached data. Its blocks must start, end and sit in memory at multiples of ``DIRECT_ALIGN``;
tensor memory and a tensor's place in a file seldom line up alike, so bytes pass through a
small reused bounce buffer, copied with ``ctypes.memmove`` (which drops the GIL).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

import numpy as np

from shardfmt.errors import StorageError

DIRECT_ALIGN = 4096  # bytes: O_DIRECT blocks start, end and sit in memory at multiples (4Kn-safe)
MAX_BLOCK = 16 << 20  # the largest block, and bounce buffer, of a direct transfer (1 GiB files and up)
MIN_THREADS = 4  # threads moving a large direct transfer: they mostly wait on the device and keep its queue full


def copy(dst: int, src: int, nbytes: int) -> None:
    """memcpy between two addresses, without holding the GIL."""
    ctypes.memmove(dst, src, nbytes)


def address(mv: memoryview, offset: int) -> int:
    """The memory address of byte ``offset`` of ``mv`` (C-contiguous bytes)."""
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data + offset


def bounce_size(nbytes: int, *, cap: int = 4 << 20) -> int:
    """The bounce buffer for moving ``nbytes`` through bounce buffers of 1/64 of them: the
    power of two at or below that, between 256 KiB and ``cap``, so the buffers stay small next
    to the data they carry and are reused across files of similar size."""
    return min(cap, max(256 << 10, 1 << max(0, (nbytes // 64).bit_length() - 1)))


class Bounce:
    """A page-aligned, pre-faulted buffer that direct I/O blocks pass through."""

    def __init__(self, nbytes: int) -> None:
        # private: a forked child gets its own copy (a shared mapping would be one buffer in both)
        try:
            self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:
            raise StorageError(f"cannot map a {nbytes}-byte I/O buffer: {e.strerror or e}") from None
        self.mv = memoryview(self.map)
        self.address = address(self.mv, 0)
        self.mv[:] = bytes(nbytes)  # fault the pages in now, not during the first save


class BouncePool:
    """Bounce buffers kept between saves and loads (fresh memory fills 10-25x slower than
    reused): at most ``keep``, one per I/O thread in use."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[Bounce] = []
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Start empty, with a new lock (in a forked child: another thread may have held the
        parent's lock at the fork, and the buffers in use belong to the parent's threads)."""
        self._free = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def buffer(self, nbytes: int):
        with self._lock:
            b = next((b for b in self._free if len(b.mv) == nbytes), None)
            if b is not None:
                self._free.remove(b)
        b = b or Bounce(nbytes)
        try:
            yield b
        finally:
            with self._lock:
                self._free.append(b)
                del self._free[:-self._keep]


POOL = BouncePool(keep=4)  # the process's bounce buffers, for writers and readers alike
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=POOL.forget)
