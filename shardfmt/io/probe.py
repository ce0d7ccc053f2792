"""Timing a device's direct and buffered transfers, as a node's processes make them (``io.choice``
asks, ``io.modes`` chooses).

``measure`` writes and reads ``PROBE_BYTES`` both ways in ``WARMUP + ROUNDS`` interleaved rounds
(about 1.5 s on a disk moving 1 GB/s; ``ROUNDS`` more, judged with the first, where they would
leave the mode in force), in files that have no name in the directory at hand
(``O_TMPFILE``: nothing is left behind, even by a crash; where the filesystem has none,
nothing is measured). Each of the node's processes is one stream with its own file, on the
threads its save (``saving.shard_file``) or load (``loading.executor``) would use; a save
hashes each block before it writes it, a load after it read it, as the library does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable

from shardfmt.errors import StorageError
from shardfmt.format.hashing import DEFAULT_CHUNK_SIZE, xxh3_raw
from shardfmt.io import modes
from shardfmt.io.aligned import DIRECT_ALIGN, MAX_BLOCK, MIN_THREADS, Bounce
from shardfmt.io.posix import CLOEXEC, fadvise, fallocate, reopen_direct, willneed

log = logging.getLogger("shardfmt")

PROBE_BYTES = 64 << 20  # the buffer, and the bytes of one transfer of a single process
MIN_PART = 16 << 20  # bytes each process's stream moves at least (with many processes)
ROUNDS = 5  # judged rounds; each writes and reads both ways, in an order that alternates
WARMUP = 1  # rounds first, not judged (first touches of the buffer, the allocator, the device)

_open: set[int] = set()  # probe files open now: a forked child closes its copies (their disk space)


def _close_in_child() -> None:
    for fd in list(_open):
        try:
            os.close(fd)
        except OSError:
            pass
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def measure(directory: str, device: modes.Device, *, previous: modes.DeviceModes | None = None) -> modes.DeviceModes:
    """Time both ways in ``directory`` for ``device.processes`` streams and choose, each
    operation against ``previous``'s mode; ``modes.DEFAULT`` unmeasured (``probes=0``) where
    no probe file can be made there."""
    try:
        with _Probe(directory, device.processes) as probe:
            times = probe.run()
            if _leaves(times, previous):  # judged with a second set of rounds
                more = probe.run()
                times = {op: (times[op][0] + more[op][0], times[op][1] + more[op][1]) for op in times}
    except (OSError, StorageError, RuntimeError, AttributeError) as e:  # AttributeError: no O_TMPFILE
        return unmeasured(device, f"no probe in {directory}: {getattr(e, 'strerror', None) or e}")
    choices = {op: modes.choose(*times[op], previous.mode(op) if previous else None) for op in modes.OPERATIONS}
    found = modes.DeviceModes(device, choices, time.time(), min((previous.probes if previous else 0) + 1,
                                                                  modes.MAX_PROBES))
    log.info("shardfmt: I/O on %s (%s, %s, %d processes): %s", device.mount, device.fstype, device.device,
             device.processes, "; ".join(f"{op} {c.mode} ({c.why})" for op, c in sorted(choices.items())))
    return found


def _leaves(times: dict[str, tuple[list[float], list[float]]], previous: modes.DeviceModes | None) -> bool:
    """Whether ``times`` would move an operation off the mode in force (not for want of
    direct I/O): then the choice waits for another ``ROUNDS``, judged with these. A mode
    is kept for ``modes.REPROBE_AFTER_S``; a device whose speed moves from one second to the
    next (this project's VM) must show the lead in both sets, or their spreads, pooled,
    overlap and the mode stays."""
    for op, (direct_s, buffered_s) in times.items():
        current = previous.mode(op) if previous else modes.DEFAULT
        if direct_s and modes.choose(direct_s, buffered_s, current).mode != current:
            return True
    return False


def unmeasured(device: modes.Device, why: str) -> modes.DeviceModes:
    """``modes.DEFAULT`` for every operation, saying why nothing was measured (``probes=0``)."""
    c = modes.Choice(modes.DEFAULT, f"not measured ({why}): the default")
    return modes.DeviceModes(device, {op: c for op in modes.OPERATIONS}, time.time(), probes=0)


def local_processes() -> int:
    """The processes of this node that save and load at once: ``LOCAL_WORLD_SIZE`` (torchrun
    sets it), else 1."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1
    return max(1, min(n, modes.MAX_PROCESSES))


def threads(processes: int, *, direct: bool, write: bool) -> int:
    """A process's transfer threads, as the executors run them: its share of the cores (a save:
    ``saving.shard_file.default_write_workers`` is this rule) or the cores (a load: ``LocalStorage.read_concurrency``
    capped by ``LoadOptions.workers``), at most ``MIN_THREADS``; at least ``MIN_THREADS`` for
    direct transfers, which mostly wait on the device."""
    cores = os.cpu_count() or 1
    n = max(1, min(MIN_THREADS, cores // max(1, processes) if write else cores))
    return max(n, MIN_THREADS) if direct else n


class _Probe:
    """Probe files with no name in ``directory`` and a page-aligned buffer the streams share
    (what it holds does not matter, only that it is moved): each way writes new files (one a
    stream, allocating, as a save does), fsyncs them and drops their pages; then each way reads
    them back from a cold cache, as a load does."""

    def __init__(self, directory: str, processes: int) -> None:
        self._dir = directory
        self._fds: list[int] = []
        self._streams = max(1, min(processes, modes.MAX_PROCESSES))
        part = max(PROBE_BYTES // self._streams, min(MIN_PART, PROBE_BYTES))
        self._part = max(DIRECT_ALIGN, part // DIRECT_ALIGN * DIRECT_ALIGN)  # bytes a stream moves
        self._close(self._file())  # a directory that cannot hold a probe file fails here, before any memory
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < 4 * self._streams * self._part:
            raise OSError(errno.ENOSPC, f"less than {4 * self._streams * self._part >> 20} MiB free")
        self._buf = Bounce(self._part)
        block = os.urandom(1 << 20)  # incompressible, so a compressing filesystem moves every byte
        for off in range(0, self._part, len(block)):
            self._buf.mv[off:off + len(block)] = block[:self._part - off]
        self._refused: set[str] = set()  # operations the filesystem refused O_DIRECT for

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc) -> None:
        while self._fds:
            with contextlib.suppress(OSError):
                self._close(self._fds[-1])
        self._buf = None  # unmapped once the last view of it goes (an error's traceback may hold one)

    def run(self) -> dict[str, tuple[list[float], list[float]]]:
        """Seconds per judged round, by operation: (direct, buffered); direct empty where the
        filesystem refused ``O_DIRECT`` for it."""
        times = {(op, way): [] for op in modes.OPERATIONS for way in modes.MODES}
        for r in range(WARMUP + ROUNDS):
            ways = modes.MODES if r % 2 == 0 else modes.MODES[::-1]
            files = {}
            for way in ways:
                files[way], took = self._write(way == modes.DIRECT)
                times["write", way].append(took)
            for way in ways:
                times["read", way].append(self._read(files[modes.DIRECT], way == modes.DIRECT))
            for fds in files.values():
                for fd in fds:
                    self._close(fd)
            if r < WARMUP:
                for t in times.values():
                    t.clear()
        return {op: ([] if op in self._refused else times[op, modes.DIRECT], times[op, modes.BUFFERED])
                for op in modes.OPERATIONS}

    def _file(self) -> int:
        fd = os.open(self._dir, os.O_TMPFILE | os.O_RDWR | CLOEXEC, 0o600)  # OSError/AttributeError: none
        self._fds.append(fd)
        _open.add(fd)
        return fd

    def _close(self, fd: int) -> None:
        self._fds.remove(fd)
        _open.discard(fd)
        os.close(fd)

    def _write(self, direct: bool) -> tuple[list[int], float]:
        fds = [self._file() for _ in range(self._streams)]
        t = time.perf_counter()
        for fd in fds:  # allocated first, as a save's files are (``io.store.reserve``)
            fallocate(fd, self._part, grow=direct and "write" not in self._refused)
        self._transfer(fds, direct, "write", lambda h, v, o: os.pwrite(h, v, o))
        for fd in fds:
            os.fsync(fd)
            _drop(fd)
        return fds, time.perf_counter() - t

    def _read(self, fds: list[int], direct: bool) -> float:
        for fd in fds:
            _drop(fd)
        t = time.perf_counter()
        if not direct:
            for fd in fds:
                willneed(fd, 0, self._part)
        self._transfer(fds, direct, "read", lambda h, v, o: os.preadv(h, [v], o))
        if not direct:
            for fd in fds:
                _drop(fd)
        return time.perf_counter() - t

    def _transfer(self, fds: list[int], direct: bool, op: str, call: Callable[[int, memoryview, int], int]) -> None:
        """Each stream's ``_part`` bytes at once, each on its process's threads."""
        direct = direct and op not in self._refused
        handles: list[int] = []
        try:
            try:
                for fd in fds:
                    if direct:
                        handles.append(reopen_direct(fd, os.O_WRONLY if op == "write" else os.O_RDONLY))
                        _open.add(handles[-1])
            except OSError as e:
                if e.errno not in _REFUSED:
                    raise  # out of descriptors, memory...: nothing is measured, nothing is concluded
                direct = False
                self._refused.add(op)
            errors = self._run(handles if direct else fds, threads(self._streams, direct=direct, write=op == "write"),
                               op, call, direct)
        finally:
            for h in handles:  # after every thread that used them has ended (``_run``)
                _open.discard(h)
                os.close(h)
        if errors and direct and isinstance(errors[0], OSError) and errors[0].errno in _REFUSED:
            self._refused.add(op)  # the filesystem refuses O_DIRECT transfers: buffered then
            return self._transfer(fds, False, op, call)
        if errors:
            raise errors[0]

    def _run(self, handles: list[int], n: int, op: str, call, direct: bool) -> list[BaseException]:
        """Move every stream's blocks on ``n`` threads a stream; return their errors. Returns (or
        raises) only once every thread started has ended: none outlives the descriptors it uses."""
        size = min(MAX_BLOCK, max(DIRECT_ALIGN, self._part // n // DIRECT_ALIGN * DIRECT_ALIGN))
        blocks = [(off, min(off + size, self._part)) for off in range(0, self._part, size)]
        errors: list[BaseException] = []
        stop = threading.Event()
        mv = self._buf.mv

        def work(handle: int, mine: list[tuple[int, int]]) -> None:
            try:
                for lo, hi in mine:
                    done = lo
                    while done < hi and not stop.is_set():
                        got = call(handle, mv[done:hi], done)
                        if got <= 0 or (direct and got % DIRECT_ALIGN and done + got < hi):
                            raise OSError(errno.EIO, f"short transfer ({got} bytes)")
                        done += got
                    _hash(mv[lo:hi])  # a save hashes what it writes, a load what it read
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
                stop.set()

        started: list[threading.Thread] = []
        try:
            for h in handles:
                for j in range(n):
                    started.append(threading.Thread(target=work, args=(h, blocks[j::n]), daemon=True))
                    started[-1].start()
        finally:
            if len(started) < len(handles) * n:
                stop.set()
            for w in started:
                _join(w)
        return errors


_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})


def _join(w: threading.Thread) -> None:
    """Join ``w`` even through an exception raised while waiting (a signal handler's): the
    thread must end before its descriptors close; the exception follows."""
    try:
        w.join()
    except BaseException:
        w.join()
        raise


def _hash(mv: memoryview) -> None:
    for k in range(0, len(mv), DEFAULT_CHUNK_SIZE):
        xxh3_raw(mv[k:k + DEFAULT_CHUNK_SIZE])


def _drop(fd: int) -> None:
    fadvise(fd, 0, 0, "DONTNEED")
