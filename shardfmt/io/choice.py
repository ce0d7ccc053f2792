"""Which way a directory's large transfers go: forced, known, or measured once and kept.

The first large transfer a process makes on a device asks ``use_direct``; it finds the device's
choice (``io.modes``) in this process, else in this host's cache document (``cache_path()``,
shared by the ranks of the node), else measures it (``io.probe``). The node's processes take
turns through a lock in the node's temporary directory, so one measures and the others read its
answer. Never a hang, never an error in a save or a load: a process that waits ``LOCK_WAIT_S``,
a directory that cannot hold a probe file, a network filesystem (where every node would
measure at once, each measuring the others) or anything unforeseen gives ``modes.DEFAULT``,
unmeasured, asked again after ``UNMEASURED_TTL_S``.

``SHARDFMT_DIRECT_IO=1`` makes every large transfer direct, ``=0`` buffered, without measuring;
``SHARDFMT_IO_MODES`` names the cache document (``off``: kept in this process only; with
several processes on the node nothing is then measured, since they could not share it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator

from shardfmt.io import modes
from shardfmt.io.posix import CLOEXEC
from shardfmt.io.probe import local_processes, measure, unmeasured

log = logging.getLogger("shardfmt")

FORCE_ENV = "SHARDFMT_DIRECT_IO"
CACHE_ENV = "SHARDFMT_IO_MODES"
LOCK_WAIT_S = 120.0  # waiting for another process's probe longer than this: unmeasured
UNMEASURED_TTL_S = 600.0  # an unmeasured default is asked again after this long
NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs",
                        "9p", "afs", "orangefs", "pvfs2", "wekafs", "virtiofs"})
_FORCED = {"1": modes.DIRECT, "true": modes.DIRECT, "yes": modes.DIRECT, "on": modes.DIRECT,
           "0": modes.BUFFERED, "false": modes.BUFFERED, "no": modes.BUFFERED, "off": modes.BUFFERED}

_lock = threading.Lock()
_known: dict[tuple[int, int], tuple[modes.DeviceModes, float]] = {}  # (st_dev, processes) -> answer, asked again at
_held: set[int] = set()  # the probe lock's descriptors open now: a forked child closes its copies
_said: set[str] = set()  # warnings given once


def _after_fork_in_child() -> None:
    """A forked child keeps what its parent knew, takes a new lock, and closes its copies of
    the probe lock (an ``flock`` belongs to the open file: a copy would hold it for the child's life)."""
    global _lock
    _lock = threading.Lock()
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def forget() -> None:
    """Forget what this process knows (the cache document stays)."""
    _known.clear()


def forced() -> str | None:
    """The mode ``SHARDFMT_DIRECT_IO`` imposes (None: unset or ``auto``, measured)."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _FORCED:
        _once(f"{FORCE_ENV}={value!r} is not one of 1, 0 or auto: measured (auto)")
        return None
    return _FORCED[value]


def use_direct(directory: str, operation: str) -> bool:
    """Whether large transfers of ``operation`` (``write``/``read``) for files in ``directory``
    go around the page cache: what ``SHARDFMT_DIRECT_IO`` imposes, else what the directory's
    device measured. Never raises: whatever goes wrong gives ``modes.DEFAULT``."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        mode = forced() or device_modes(directory).mode(operation)
    except Exception as e:  # noqa: BLE001 - choosing a mode must never fail a save or a load
        log.warning("shardfmt: the I/O mode for %s could not be chosen (%s: %s): %s", directory,
                    type(e).__name__, e, modes.DEFAULT)
        mode = modes.DEFAULT
    return mode == modes.DIRECT


def measured(directory: str, operation: str) -> modes.Choice | None:
    """The device's choice for ``operation`` with the measurement behind it: None where a mode
    is forced, nothing could be asked, or the measurement is stale (kept for want of a new one).
    Never raises."""
    if forced() is not None or not hasattr(os, "O_DIRECT"):
        return None
    try:
        found = device_modes(directory)
    except Exception:  # noqa: BLE001 - as use_direct: a question about modes never fails a load
        return None
    return None if found.stale(time.time()) else found.choices.get(operation)


def device_modes(directory: str, *, again: bool = False, processes: int | None = None) -> modes.DeviceModes:
    """The choices for ``directory``'s device and ``processes`` (None: ``local_processes()``):
    this process's, the cache's, or measured now (``again``: measured now whatever is known, the
    choice known before kept unless beaten). OSError only where ``directory`` cannot be looked at."""
    st = os.stat(directory)
    processes = local_processes() if processes is None else max(1, min(processes, modes.MAX_PROCESSES))
    with _lock:
        known, retry_at = _known.get((st.st_dev, processes), (None, 0.0))
        if known is not None and not again and time.time() < retry_at:
            return known
        device = describe(directory, st.st_dev, processes)
        try:
            found = _settle(directory, device, again=again, known=known)
        except Exception as e:  # noqa: BLE001 - never a failed save; remembered, so not met at every file
            found = unmeasured(device, f"{type(e).__name__}: {e}")
        # a measured answer holds until it is stale; anything else (unmeasured, or stale and kept
        # for want of a new measurement) is asked again after UNMEASURED_TTL_S, not at every file
        _known[st.st_dev, processes] = (found, found.probed_at + modes.REPROBE_AFTER_S if _fresh(found)
                                        else time.time() + UNMEASURED_TTL_S)
        return found


def cache_path() -> str | None:
    """This host's cache document: ``SHARDFMT_IO_MODES``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache`` + ``shardfmt/io-modes-<host>.json`` (one a host: a home shared by a cluster
    holds each node's apart); None (this process only) for ``off`` or no home."""
    named = os.environ.get(CACHE_ENV)
    if named is not None:
        return None if named.strip().lower() in ("", "off", "0", "none") else named
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"
    return None if base.startswith("~") else os.path.join(base, "shardfmt", f"io-modes-{host}.json")


def lock_path() -> str:
    """The node's probe lock: in its temporary directory (local to the node), one a user."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"shardfmt-io-probe-{uid}.lock")


def describe(directory: str, dev: int, processes: int) -> modes.Device:
    """The device ``dev`` (``directory``'s), named by this host, ``major:minor``, and the
    filesystem and mount point ``/proc/self/mountinfo`` gives it (``?`` where it has none)."""
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
    return modes.Device(socket.gethostname(), number, *best, processes)


def _fresh(m: modes.DeviceModes | None) -> bool:
    return m is not None and m.probes > 0 and not m.stale(time.time())


def _settle(directory: str, device: modes.Device, *, again: bool,
            known: modes.DeviceModes | None) -> modes.DeviceModes:
    """The cache's choice for ``device`` (read without the lock: the document is replaced whole),
    or a new measurement under the node's probe lock, written back; measured against the choice
    in force (the cache's, else this process's ``known``)."""
    path = cache_path()
    kept = (_read(path).get(device.key) if path else None) or (known if known is not None and known.probes else None)
    if not again and _fresh(kept):
        return kept
    if device.fstype in NETWORK_FS or device.fstype.startswith("fuse"):
        return kept or unmeasured(device, f"{device.fstype} is a network filesystem: every node would "
                                          f"measure at once, each measuring the others")
    if not _shareable(path) and device.processes > 1:
        return kept or unmeasured(device, f"no cache document to keep it in ({path or CACHE_ENV + '=off'}): "
                                          f"the node's {device.processes} processes could not share one measurement")
    with _locked(lock_path()) as held:
        latest = (_read(path).get(device.key) if path else None) or kept  # measured while this one waited?
        if not held:
            return latest or unmeasured(device, f"another process held {lock_path()} for {LOCK_WAIT_S:g} s")
        if not again and _fresh(latest):
            return latest
        found = measure(directory, device, previous=latest)
        if not found.probes:
            return latest or found  # a failed measurement keeps the choice in force
        if path:
            _write(path, found)
        return found


def _shareable(path: str | None) -> bool:
    """Whether the node's processes can share a measurement through the document at ``path``."""
    if path is None:
        return False
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK) and (not os.path.exists(path) or os.access(path, os.R_OK))


@contextlib.contextmanager
def _locked(path: str) -> Iterator[bool]:
    """Hold ``path`` (an exclusive ``flock``), waiting at most ``LOCK_WAIT_S``; yields whether it
    is held. A lock file that cannot be opened or locked (another user's, no locks there) is
    not held."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0),
                     0o600)
    except OSError:
        yield False
        return
    _held.add(fd)
    try:
        mine = not hasattr(os, "getuid") or os.fstat(fd).st_uid == os.getuid()  # another user's: not ours to wait on
        yield mine and _take(fd)
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)  # released for every copy, a forked child's too
        _held.discard(fd)
        os.close(fd)


def _take(fd: int) -> bool:
    """Take the exclusive ``flock`` on ``fd`` within ``LOCK_WAIT_S`` (False: not in time, or no locks here)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                return False
        time.sleep(0.05)


def _read(path: str) -> dict[str, modes.DeviceModes]:
    """The cache document's devices; {} for one that is missing, not a regular file (opened
    without blocking: a FIFO there never hangs a save), larger than ``modes.MAX_DOCUMENT``, or not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | CLOEXEC)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read(modes.MAX_DOCUMENT + 1)
    except OSError:
        return {}
    finally:
        os.close(fd)
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
        tmp = None
    except (OSError, ValueError) as e:
        log.info("shardfmt: could not keep the I/O modes in %s: %s", path, e)
    finally:
        if tmp is not None:  # never left behind, whatever stopped the write
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _once(message: str) -> None:
    """Log ``message`` once a process (a log record, not a warning: never an error under ``-W error``)."""
    if message not in _said:
        _said.add(message)
        log.warning("shardfmt: %s", message)
