"""What the harness observes around a measurement: memory, I/O counters, page cache, files.

Nothing here imports shardfmt. ``RSSSampler`` (VmRSS from /proc/self/statm in a thread, peak
while armed), ``malloc_trim`` (hand freed heap back so the next baseline is honest),
``proc_io`` (/proc/self/io), ``drop_cache`` / ``warm_cache`` (the page cache state a load
starts from), ``fs_type`` and ``code_fingerprint`` (what the figures were measured on).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_libc = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> None:
    """Return freed heap memory to the OS (glibc); a no-op elsewhere."""
    try:
        _libc.malloc_trim(0)
    except AttributeError:
        pass


class RSSSampler:
    """Background thread: VmRSS every ``interval`` seconds while armed.

    1) ``before = start()`` arms it; 2) the measured call runs; 3) ``peak = stop()``;
    4) ``close()`` once at the end.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._peak = 0
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._t.start()

    def rss(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._armed.wait(0.05):
                continue
            self._peak = max(self._peak, self.rss())
            time.sleep(self.interval)

    def start(self) -> int:
        before = self.rss()
        self._peak = before
        self._armed.set()
        return before

    def stop(self) -> int:
        self._armed.clear()
        return max(self._peak, self.rss())

    def close(self) -> None:
        self._stop.set()
        self._armed.set()
        self._t.join()
        os.close(self._fd)


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (rchar, wchar, syscr, syscw, read_bytes, write_bytes)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return sorted(out)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """fsync, then POSIX_FADV_DONTNEED, every file under ``path``: the next read is cold. A file
    removed meanwhile (rank 0 clearing a save's directory while another rank still drops it)
    has left the page cache with its name."""
    for f in files_under(path):
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(path: str, piece: int = 8 << 20) -> None:
    """Read every file under ``path`` once: the next read finds it in the page cache."""
    buf = bytearray(piece)
    for f in files_under(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts), or '?'."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def code_fingerprint(dirs=("shardfmt", "reshard")) -> str:
    """xxh3-64 of every .py under ``dirs`` of the repository (the code the workers import)."""
    import xxhash

    h = xxhash.xxh3_64()
    for d in dirs:
        for f in files_under(os.path.join(ROOT, d)):
            if f.endswith(".py"):
                h.update(f[len(ROOT):].encode())
                with open(f, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"
