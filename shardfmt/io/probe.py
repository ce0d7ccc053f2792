"""A device's direct and buffered transfers, measured once and kept (the shell of ``io.modes``).

The first large transfer a process makes on a device asks ``use_direct``; it finds the device's
choice in this process, else in the cache document (``cache_path()``: one per user, shared by
the ranks of a node), else measures it: ``PROBE_BYTES`` written and read back both ways in
``WARMUP + ROUNDS`` interleaved rounds (about a second), in a file with no name in the
directory at hand (``O_TMPFILE``: nothing is left behind, even by a crash). The ranks of a node
take turns through a lock on the cache document, so one measures and the others read its
answer; a process that waits ``LOCK_WAIT_S`` for it goes on with ``modes.DEFAULT``, never hangs.

``SHARDFMT_DIRECT_IO=1`` makes every large transfer direct, ``=0`` buffered, without measuring;
``SHARDFMT_IO_MODES`` names the cache document (``off``: kept in this process only).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator

from shardfmt.errors import StorageError
from shardfmt.format.hashing import DEFAULT_CHUNK_SIZE, xxh3_raw
from shardfmt.io import modes
from shardfmt.io.aligned import DIRECT_ALIGN, MAX_BLOCK, MIN_THREADS, Bounce
from shardfmt.io.posix import CLOEXEC, reopen_direct

log = logging.getLogger("shardfmt")

FORCE_ENV = "SHARDFMT_DIRECT_IO"
CACHE_ENV = "SHARDFMT_IO_MODES"
PROBE_BYTES = 64 << 20  # one file of this size per way and operation, MAX_BLOCK blocks on threads
ROUNDS = 5  # judged rounds; each writes and reads PROBE_BYTES both ways, in an order that alternates
WARMUP = 1  # rounds first, not judged (first touches of the buffer, the allocator, the device)
LOCK_WAIT_S = 120.0  # waiting for another process's probe longer than this: modes.DEFAULT, unmeasured
_FORCED = {"1": modes.DIRECT, "true": modes.DIRECT, "yes": modes.DIRECT, "on": modes.DIRECT,
           "0": modes.BUFFERED, "false": modes.BUFFERED, "no": modes.BUFFERED, "off": modes.BUFFERED}

_lock = threading.Lock()
_known: dict[int, modes.DeviceModes] = {}  # st_dev -> this process's answer
_warned: set[str] = set()


def _forget() -> None:
    """Start empty, with a new lock (in a forked child, or a test)."""
    global _lock
    _lock = threading.Lock()
    _known.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def forced() -> str | None:
    """The mode ``SHARDFMT_DIRECT_IO`` imposes (None: unset or ``auto``, measured)."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _FORCED:
        if value not in _warned:
            _warned.add(value)
            warnings.warn(f"{FORCE_ENV}={value!r} is not one of 1, 0 or auto: measured (auto)", stacklevel=3)
        return None
    return _FORCED[value]


def use_direct(directory: str, operation: str) -> bool:
    """Whether large transfers of ``operation`` (``write``/``read``) for files in ``directory``
    go around the page cache: what ``SHARDFMT_DIRECT_IO`` imposes, else what the directory's
    device measured. Never raises: a directory that cannot be measured gets ``modes.DEFAULT``."""
    if not hasattr(os, "O_DIRECT"):
        return False
    mode = forced()
    if mode is None:
        try:
            mode = device_modes(directory).mode(operation)
        except OSError:
            mode = modes.DEFAULT
    return mode == modes.DIRECT


def device_modes(directory: str, *, again: bool = False) -> modes.DeviceModes:
    """The choices for ``directory``'s device: this process's, the cache's, or measured now
    (``again``: measured now whatever is known, the choice known before kept unless beaten).
    OSError only where ``directory`` cannot be looked at."""
    st = os.stat(directory)
    with _lock:
        known = _known.get(st.st_dev)
        if known is not None and not again and not known.stale(time.time()):
            return known
        found = _settle(directory, describe(directory, st.st_dev), again=again, known=known)
        _known[st.st_dev] = found
        return found


def cache_path() -> str | None:
    """Where choices are kept: ``SHARDFMT_IO_MODES``, else ``$XDG_CACHE_HOME`` or ``~/.cache``
    + ``shardfmt/io-modes.json``; None (this process only) for ``off`` or no home."""
    named = os.environ.get(CACHE_ENV)
    if named is not None:
        return None if named.strip().lower() in ("", "off", "0", "none") else named
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return None if base.startswith("~") else os.path.join(base, "shardfmt", "io-modes.json")


def describe(directory: str, dev: int) -> modes.Device:
    """The device ``dev`` (``directory``'s), named by this host, ``major:minor``, and the
    filesystem and mount point ``/proc/self/mountinfo`` gives it (``?`` where it has none),
    for the node's ``local_processes()``."""
    number = f"{os.major(dev)}:{os.minor(dev)}"
    where = os.path.realpath(directory)
    best = ("?", "?")
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read(4 << 20).splitlines()
    except OSError:
        lines = []
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or not rest or fields[2] != number:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = where == mount or where.startswith(mount.rstrip("/") + "/")
        if inside and (best[1] == "?" or len(mount) > len(best[1])):
            best = (rest[0], mount)
    return modes.Device(socket.gethostname(), number, *best, local_processes())


def local_processes() -> int:
    """The processes of this node that save and load at once: ``LOCAL_WORLD_SIZE`` (torchrun
    sets it), else 1."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1
    return max(1, min(n, modes.MAX_PROCESSES))


def _settle(directory: str, device: modes.Device, *, again: bool,
            known: modes.DeviceModes | None) -> modes.DeviceModes:
    """The cache's choice for ``device``, or a new measurement (written back), under the cache's
    lock; measured against the cache's choice, else this process's (``known``)."""
    path = cache_path()
    with _locked(path) as held:
        kept = _read(path).get(device.key) if path else None
        kept = kept or (known if known is not None and known.probes else None)
        if kept is not None and not again and not kept.stale(time.time()):
            return kept
        if not held:
            return kept or _unmeasured(device, f"another process held {path}.lock for {LOCK_WAIT_S:g} s")
        found = measure(directory, device, previous=kept)
        if path and found.probes:
            _write(path, found)
        return found


def measure(directory: str, device: modes.Device, *, previous: modes.DeviceModes | None = None) -> modes.DeviceModes:
    """Time both ways in ``directory`` and choose, each operation against ``previous``'s mode;
    ``modes.DEFAULT`` unmeasured (``probes=0``) where no probe file can be made there."""
    try:
        with _Probe(directory, device.processes) as probe:
            writes, reads = probe.run()
    except (OSError, StorageError) as e:
        return _unmeasured(device, f"could not probe in {directory}: {getattr(e, 'strerror', None) or e}")
    choices = {op: modes.choose(*times, previous.mode(op) if previous else None)
               for op, times in (("write", writes), ("read", reads))}
    found = modes.DeviceModes(device, choices, time.time(), (previous.probes if previous else 0) + 1)
    log.info("shardfmt: I/O on %s (%s, %s): %s", device.mount, device.fstype, device.device,
             "; ".join(f"{op} {c.mode} ({c.why})" for op, c in sorted(choices.items())))
    return found


def _unmeasured(device: modes.Device, why: str) -> modes.DeviceModes:
    c = modes.Choice(modes.DEFAULT, f"not measured ({why}): the default")
    return modes.DeviceModes(device, {op: c for op in modes.OPERATIONS}, time.time(), probes=0)


class _Probe:
    """The timed transfers, as the node's ``processes`` make them at once: each way writes new
    files (one a process, allocating, as a save does), fsyncs them and drops their pages; then
    each way reads them back from a cold cache, as a load does. The files have no name in
    ``directory``; the processes' parts of ``PROBE_BYTES`` lie in one page-aligned buffer."""

    def __init__(self, directory: str, processes: int) -> None:
        self._dir = directory
        self._fds: list[int] = []
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < 8 * PROBE_BYTES:
            raise OSError(errno.ENOSPC, f"less than {8 * PROBE_BYTES >> 20} MiB free")
        self._streams = max(1, min(processes, PROBE_BYTES // (1 << 20)))
        self._part = PROBE_BYTES // self._streams // DIRECT_ALIGN * DIRECT_ALIGN  # bytes a process moves
        self._buf = Bounce(PROBE_BYTES)
        block = os.urandom(1 << 20)  # incompressible, so a compressing filesystem moves every byte
        for off in range(0, PROBE_BYTES, len(block)):
            self._buf.mv[off:off + len(block)] = block
        self._direct_ok = True

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds:
            os.close(fd)
        self._buf = None  # unmapped once the last view of it goes (an error's traceback may hold one)

    def run(self) -> tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]]:
        """Seconds per judged round: ((write direct, write buffered), (read direct, read buffered));
        the direct lists empty where the filesystem refuses ``O_DIRECT``."""
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
                    os.close(fd)
                    self._fds.remove(fd)
            if r < WARMUP:
                for t in times.values():
                    t.clear()
        if not self._direct_ok:
            times["write", modes.DIRECT], times["read", modes.DIRECT] = [], []
        return tuple((times[op, modes.DIRECT], times[op, modes.BUFFERED]) for op in modes.OPERATIONS)

    def _file(self) -> int:
        try:
            fd = os.open(self._dir, os.O_TMPFILE | os.O_RDWR | CLOEXEC, 0o600)
        except (OSError, AttributeError):  # no O_TMPFILE here: a named file, unlinked at once
            fd, name = tempfile.mkstemp(prefix=".shardfmt-io-probe-", dir=self._dir)
            os.unlink(name)
        self._fds.append(fd)
        return fd

    def _write(self, direct: bool) -> tuple[list[int], float]:
        fds = [self._file() for _ in range(self._streams)]
        t = time.perf_counter()
        self._transfer(fds, direct, os.O_WRONLY, lambda h, v, o: os.pwrite(h, v, o))
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
                _advise(fd, os.POSIX_FADV_WILLNEED)
        self._transfer(fds, direct, os.O_RDONLY, lambda h, v, o: os.preadv(h, [v], o))
        if not direct:
            for fd in fds:
                _drop(fd)
        return time.perf_counter() - t

    def _threads(self, direct: bool, write: bool) -> int:
        """A process's threads, as the save (``saving.shard_file``) and load (``loading.executor``)
        executors run them: its share of the cores (writes) or the cores (reads), at most
        ``MIN_THREADS``; at least ``MIN_THREADS`` for direct transfers, which mostly wait on the device."""
        cores = os.cpu_count() or 1
        threads = max(1, min(MIN_THREADS, cores // self._streams if write else cores))
        return max(threads, MIN_THREADS) if direct else threads

    def _transfer(self, fds: list[int], direct: bool, flags: int, call: Callable[[int, memoryview, int], int]) -> None:
        """Each file's part of the buffer in blocks of at most ``MAX_BLOCK``, all files at once,
        each on its process's threads; a save hashes each block before it writes it, a load after
        it read it."""
        handles = list(fds)
        try:
            if direct and self._direct_ok:
                try:
                    handles = [reopen_direct(fd, flags) for fd in fds]
                except OSError:
                    self._direct_ok = False
            direct = direct and self._direct_ok
            errors = self._run(handles, self._threads(direct, flags != os.O_RDONLY), flags, call)
        finally:
            for h in handles:
                if h not in fds:
                    os.close(h)
        if errors and direct and errors[0].errno == errno.EINVAL:
            self._direct_ok = False  # the filesystem refuses O_DIRECT transfers: buffered then
            return self._transfer(fds, False, flags, call)
        if errors:
            raise errors[0]

    def _run(self, handles: list[int], threads: int, flags: int, call) -> list[OSError]:
        size = min(MAX_BLOCK, self._part)
        errors: list[OSError] = []
        mv = self._buf.mv

        def work(handle: int, base: int, mine: list[int]) -> None:
            try:
                for off in mine:
                    if flags != os.O_RDONLY:
                        _hash(mv[base + off:base + off + size])
                    done = 0
                    while done < size:
                        n = call(handle, mv[base + off + done:base + off + size], off + done)
                        if n <= 0 or n % DIRECT_ALIGN:
                            raise OSError(errno.EIO, f"short transfer ({n} bytes)")
                        done += n
                    if flags == os.O_RDONLY:
                        _hash(mv[base + off:base + off + size])
            except OSError as e:
                errors.append(e)

        blocks = list(range(0, self._part - size + 1, size))
        workers = [threading.Thread(target=work, args=(h, k * self._part, blocks[j::threads]))
                   for k, h in enumerate(handles) for j in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return errors


def _hash(mv: memoryview) -> None:
    for k in range(0, len(mv), DEFAULT_CHUNK_SIZE):
        xxh3_raw(mv[k:k + DEFAULT_CHUNK_SIZE])


def _advise(fd: int, advice: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except (OSError, AttributeError):
        pass


def _drop(fd: int) -> None:
    _advise(fd, os.POSIX_FADV_DONTNEED)


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[bool]:
    """Hold ``path.lock`` (an exclusive ``flock``), waiting at most ``LOCK_WAIT_S``; yields
    whether it is held (True with no path: nothing to share)."""
    if path is None:
        yield True
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | CLOEXEC, 0o600)
    except OSError:
        yield True  # nowhere to keep it: measured for this process alone
        return
    try:
        yield _take(fd)
    finally:
        os.close(fd)  # releases the lock


def _take(fd: int) -> bool:
    """Take the exclusive ``flock`` on ``fd`` within ``LOCK_WAIT_S`` (False: not in time); a
    filesystem with no locks counts as held."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                return True
            if time.monotonic() >= deadline:
                return False
        time.sleep(0.05)


def _read(path: str) -> dict[str, modes.DeviceModes]:
    try:
        with open(path, "rb") as f:
            text = f.read(modes.MAX_DOCUMENT + 1)
    except OSError:
        return {}
    return {} if len(text) > modes.MAX_DOCUMENT else modes.decode(text)


def _write(path: str, found: modes.DeviceModes) -> None:
    """Put ``found`` in the document at ``path`` (replaced whole: a reader never sees half of it);
    a document that cannot be written leaves the choice with this process."""
    devices = _read(path)
    devices[found.device.key] = found
    tmp = None
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".io-modes-", dir=os.path.dirname(path) or ".")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(modes.encode(devices))
        os.replace(tmp, path)
    except OSError as e:
        log.info("shardfmt: could not keep the I/O modes in %s: %s", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
