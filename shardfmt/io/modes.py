"""Direct or buffered: which way a device's large transfers go, chosen from what it measured.

The pure half of the per-device I/O choice (``io.probe`` is the shell that measures and keeps
it). For each device and each operation — ``write`` (a save's data files) and ``read`` (a
load's reads of files it reads nearly whole) — a probe times both ways over the same bytes
in interleaved rounds, and ``choose`` turns the timings into a mode:

- the spreads must separate for either way to count as faster (the benchmark harness's rule);
- where they overlap, the mode in force stays: the one chosen before, or ``DEFAULT``;
- leaving the mode in force takes more than separating (hysteresis): the other way must be
  faster by ``MARGIN`` beyond its spread, so a device whose figures flip from run to run
  (this project's VM: the same load 1.2 s one run, 0.6 s the next) keeps one mode; and the
  probe (``io.probe.measure``) leaves it only on twice its rounds, judged together;
- a device that refuses ``O_DIRECT`` (some network filesystems; tmpfs before Linux 6.6) reads and
  writes buffered.

``DEFAULT`` is direct: where the two measure alike it is the one that leaves the training
job's page cache alone without extra work. Which way is ahead depends on the device and on
how many processes move bytes at once: on this project's VM, one process loaded faster
buffered and two faster direct (benchmarks/README.md, issue 22). A cached choice is kept in a small JSON
document (``encode``/``decode``), read as untrusted input: a document that is not one, or an
entry that does not hold, is ignored, never trusted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DIRECT = "direct"
BUFFERED = "buffered"
MODES = (DIRECT, BUFFERED)
OPERATIONS = ("write", "read")
DEFAULT = DIRECT
MARGIN = 0.10  # leaving the mode in force: the other way faster by 10% beyond both spreads
REPROBE_AFTER_S = 30 * 86400.0  # a choice this old is measured again (and kept unless beaten)
MAX_DEVICES = 64  # entries a cache document keeps (the most recently probed)
MAX_PROBES = 1 << 31  # a count of probes larger than this is not one
MAX_NUMBER = float(1 << 53)  # seconds and Unix times in a cache document stay below this
MAX_PROCESSES = 1 << 16  # processes of one node (a cache entry naming more is not one)
MAX_DOCUMENT = 1 << 20  # bytes: a larger cache document is not read
KIND = "shardfmt-io-modes"
# 2: writes are timed into files allocated first, as saves write; 3: buffered reads are hinted whole
# (``posix.willneed``), as loads hint them; 4: a mode is left only on two sets of rounds (``probe.measure``).
# An older choice is measured again.
VERSION = 4


@dataclass(frozen=True)
class Device:
    """Where a directory's bytes go: this host's block device (``major:minor``), its
    filesystem type and mount point; and how many processes of the node move bytes at once
    (a job's ranks there: which way is faster with 8 of them can differ from 1). ``key``
    names it in a cache document."""

    host: str
    device: str
    fstype: str
    mount: str
    processes: int = 1

    @property
    def key(self) -> str:
        return f"{self.host}|{self.device}|{self.fstype}|{self.mount}|{self.processes}"


@dataclass(frozen=True)
class Choice:
    """One operation's mode on one device, and the measurement behind it: seconds per round
    for each way (empty where none ran), ``why`` in words."""

    mode: str
    why: str
    direct_s: tuple[float, ...] = ()
    buffered_s: tuple[float, ...] = ()

    @property
    def clear(self) -> bool:
        """Whether the measurement leaves no doubt: both ways timed and ``mode`` the faster,
        their spreads apart (not a mode kept on overlap, a narrow lead or no measurement)."""
        if not self.direct_s or not self.buffered_s:
            return False
        apart = separated(self.direct_s, self.buffered_s)
        return apart is not None and apart[0] == self.mode


@dataclass(frozen=True)
class DeviceModes:
    """A device's choices (one per operation) and when they were measured (Unix seconds)."""

    device: Device
    choices: Mapping[str, Choice]
    probed_at: float
    probes: int = 1

    def mode(self, operation: str) -> str:
        return self.choices[operation].mode

    def stale(self, now: float) -> bool:
        return not (0 <= now - self.probed_at < REPROBE_AFTER_S)


def spread(values: Sequence[float]) -> tuple[float, float]:
    """The interquartile range (inclusive quartiles, as the benchmark harness's), so one
    round the machine stalled does not decide."""
    v = sorted(values)
    if not v:
        raise ValueError("no timings")

    def q(p: float) -> float:
        x = p * (len(v) - 1)
        lo = math.floor(x)
        return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)

    return q(0.25), q(0.75)


def separated(direct_s: Sequence[float], buffered_s: Sequence[float]) -> tuple[str, float, float] | None:
    """The faster way when the two ways' spreads are apart, with the faster one's upper and
    the slower one's lower quartile (the gap between them); None when the spreads overlap."""
    (d_lo, d_hi), (b_lo, b_hi) = spread(direct_s), spread(buffered_s)
    if d_hi < b_lo:
        return DIRECT, d_hi, b_lo
    if b_hi < d_lo:
        return BUFFERED, b_hi, d_lo
    return None


def choose(direct_s: Sequence[float], buffered_s: Sequence[float], previous: str | None = None) -> Choice:
    """The mode for timings of both ways over the same bytes (``direct_s`` empty: the device
    refused direct I/O), given the mode in force before (``previous``; None: ``DEFAULT``)."""
    d, b = tuple(direct_s), tuple(buffered_s)
    if not d:
        return Choice(BUFFERED, "the filesystem refuses O_DIRECT", d, b)
    current = previous if previous in MODES else DEFAULT
    apart = separated(d, b)
    if apart is None:
        kept = "chosen before" if previous in MODES else "the default"
        return Choice(current, f"direct and buffered overlap: kept {current} ({kept})", d, b)
    faster, lo, hi = apart
    if faster == current:
        return Choice(current, f"{faster} faster (spreads separate)", d, b)
    if lo * (1 + MARGIN) < hi:
        return Choice(faster, f"{faster} faster by more than {MARGIN:.0%} beyond the spreads", d, b)
    return Choice(current, f"{faster} faster by less than {MARGIN:.0%} beyond the spreads: kept {current}", d, b)


def decode(text: str | bytes) -> dict[str, DeviceModes]:
    """A cache document's devices by key; what does not hold (not JSON, another kind or
    version, an entry with a mode or a figure that is not one) is left out, never raised."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict) or doc.get("kind") != KIND or type(doc.get("version")) is not int \
            or doc.get("version") != VERSION:
        return {}
    devices = doc.get("devices")
    out: dict[str, DeviceModes] = {}
    for entry in devices if isinstance(devices, list) else ():
        modes = _entry(entry)
        if modes is not None:
            out[modes.device.key] = modes
    return out


def encode(devices: Mapping[str, DeviceModes]) -> str:
    """The cache document for ``devices`` (the ``MAX_DEVICES`` most recently probed), sorted by key."""
    kept = sorted(devices.values(), key=lambda m: m.probed_at, reverse=True)[:MAX_DEVICES]
    entries = [entry(m) for m in sorted(kept, key=lambda m: m.device.key)]
    return json.dumps({"kind": KIND, "version": VERSION, "devices": entries}, indent=1, sort_keys=True) + "\n"


def entry(m: DeviceModes) -> dict:
    """``m`` as a cache document's entry (JSON-able)."""
    return {"host": m.device.host, "device": m.device.device, "fstype": m.device.fstype, "mount": m.device.mount,
            "processes": m.device.processes, "probed_at": m.probed_at, "probes": m.probes,
            "choices": {op: {"mode": c.mode, "why": c.why, "direct_s": list(c.direct_s),
                             "buffered_s": list(c.buffered_s)} for op, c in sorted(m.choices.items())}}


def _entry(raw) -> DeviceModes | None:
    if not isinstance(raw, dict):
        return None
    names = [raw.get(k) for k in ("host", "device", "fstype", "mount")]
    probed_at, probes, choices = raw.get("probed_at"), raw.get("probes", 1), raw.get("choices")
    processes = raw.get("processes", 1)
    if not all(isinstance(n, str) for n in names) or not isinstance(choices, dict):
        return None
    if not isinstance(processes, int) or isinstance(processes, bool) or not 1 <= processes <= MAX_PROCESSES:
        return None
    if not _number(probed_at) or not isinstance(probes, int) or isinstance(probes, bool) or not 1 <= probes <= MAX_PROBES:
        return None
    parsed = {op: _choice(choices.get(op)) for op in OPERATIONS}
    if any(c is None for c in parsed.values()):
        return None
    return DeviceModes(Device(*names, processes), parsed, float(probed_at), probes)


def _choice(c) -> Choice | None:
    if not isinstance(c, dict) or c.get("mode") not in MODES or not isinstance(c.get("why", ""), str):
        return None
    times = [c.get("direct_s", []), c.get("buffered_s", [])]
    if not all(isinstance(t, list) and len(t) <= 64 and all(_number(x) for x in t) for t in times):
        return None
    return Choice(c["mode"], c.get("why", ""), tuple(map(float, times[0])), tuple(map(float, times[1])))


def _number(x) -> bool:
    """A finite, non-negative number below ``MAX_NUMBER`` (a huge integer is not one: never
    converted, so it cannot overflow)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return 0 <= x < MAX_NUMBER if isinstance(x, int) else math.isfinite(x) and 0 <= x < MAX_NUMBER
