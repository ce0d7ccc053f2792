"""Direct or buffered for the rest of a load, tried on the load's own first large reads.

The device's choice (``io.choice``) is where a load starts. It is measured on 64 MiB a probe
has just written, which a virtualised disk may still hold in its host's cache, and it is
kept for days. Where that probe could not tell the two ways apart (its spreads overlapped,
it kept its mode on a narrow lead, or it could not measure), the load's own reads decide: a
load with at least ``MIN_READS`` reads that may go around the page cache, all on one device,
tries both. Where the probe separated them (``modes.Choice.clear``) the load keeps the
device's way untried (``Executor._trial_for``): on this project's VM a trial did not beat
the device's way on average over six runs, lost 9-15% to it in three, and was misled by
buffered reads that run fast only while the page cache fills from memory freed moments
before (benchmarks/README.md, session 20).

A tried load's first ``TRIAL_READS`` such reads go the device's way, the next
``TRIAL_READS`` the other way, each way alone (a worker asking for the second way's first
read waits until every read of the first way has reported, and one asking once the second
way's are all out waits for the decision), so neither way is timed against the other's
traffic. Each is timed on the thread that does it — read, hashed and in its targets, what the
load waits for — as seconds per ``UNIT`` bytes. ``modes.choose`` then decides the rest with
the probe's rules: the spreads must separate, the device's choice stays where they overlap,
and leaving it takes a margin. A mode forced with ``SHARDFMT_DIRECT_IO`` is never tried
against the other, and a smaller load is not tried at all (the slower half of the trial
would cost more than the answer saves).
"""

from __future__ import annotations

import threading

from shardfmt.io import modes

TRIAL_READS = 3  # reads each way before the rest of the load is decided
MIN_READS = 4 * TRIAL_READS  # fewer reads that may go around the page cache: no trial
UNIT = 64 << 20  # bytes: a tried read's time is counted per this many (the probe's size)


class ModeTrial:
    """Which way each large read of one load goes (``next_mode``), and what its trial found
    (``timed`` as each tried read finishes; ``outcome`` once decided). Thread-safe: the load's
    workers ask and report concurrently; a worker asking for a tried read of the second way
    waits until every tried read of the first way has reported, so no read of one way is timed
    against the other's traffic."""

    def __init__(self, start: str, *, tried: bool, why: str = "") -> None:
        if start not in modes.MODES:
            raise ValueError(f"not a mode: {start!r}")
        self._start = start
        other = modes.BUFFERED if start == modes.DIRECT else modes.DIRECT
        self._ways = (start, other) if tried else ()  # tried in this order, TRIAL_READS reads each
        self._way = 0  # the way being tried (an index into _ways)
        self._handed = 0  # reads of that way handed out
        self._out = 0  # of those, not yet reported
        self._seconds: dict[str, list[float]] = {m: [] for m in modes.MODES}
        self._choice: modes.Choice | None = None if tried else modes.Choice(start, why or f"not tried: kept {start}")
        self._cond = threading.Condition()

    @classmethod
    def for_load(cls, start: str, reads: int, forced: str | None = None) -> ModeTrial:
        """The trial of a load with ``reads`` reads that may go around the page cache, starting
        from the device's choice ``start``; none where a mode is ``forced`` or the load is small."""
        if forced is not None:
            return cls(forced, tried=False, why=f"{forced}, as SHARDFMT_DIRECT_IO says")
        if reads < MIN_READS:
            return cls(start, tried=False, why=f"the device's choice ({reads} large reads: too few to try)")
        return cls(start, tried=True)

    @property
    def tried(self) -> bool:
        """Whether the load tries both ways (its first large reads: each way in turn)."""
        return bool(self._ways)

    @property
    def mode(self) -> str:
        """The way reads go now: the decided one, else the one the load started from."""
        return self._choice.mode if self._choice is not None else self._start

    @property
    def outcome(self) -> modes.Choice:
        """What the trial decided and why (undecided: the mode it started from)."""
        return self._choice if self._choice is not None else modes.Choice(self._start, "not decided")

    def next_mode(self) -> tuple[str, bool]:
        """The way the next large read goes, and whether it is tried (then ``timed`` or
        ``failed`` must follow, or the workers waiting for the next way wait for ever)."""
        with self._cond:
            while self._choice is None:
                if self._handed < TRIAL_READS:
                    self._handed += 1
                    self._out += 1
                    return self._ways[self._way], True
                self._cond.wait()  # this way's tried reads are all out: wait for them to report
            return self._choice.mode, False

    def timed(self, mode: str, nbytes: int, seconds: float) -> None:
        """A tried read of ``nbytes`` took ``seconds`` the ``mode`` way."""
        with self._cond:
            if nbytes > 0:
                self._seconds[mode].append(seconds * UNIT / nbytes)
            self._reported()

    def failed(self, mode: str) -> None:
        """A tried read failed before it could be timed: the trial ends with the mode in force."""
        self._end(self._start, f"a tried {mode} read failed: kept {self._start}")

    def refused(self) -> None:
        """A tried direct read went through the page cache after all (the filesystem refused
        ``O_DIRECT``): the rest is buffered."""
        self._end(modes.BUFFERED, "the filesystem refused O_DIRECT")

    def _end(self, mode: str, why: str) -> None:
        with self._cond:
            if self._choice is None:
                self._choice = modes.Choice(mode, why)
            self._reported()

    def _reported(self) -> None:
        self._out -= 1
        if self._choice is None and self._out == 0 and self._handed == TRIAL_READS:
            if self._way + 1 < len(self._ways):
                self._way, self._handed = self._way + 1, 0
            else:
                self._choice = self._decide()
        self._cond.notify_all()

    def _decide(self) -> modes.Choice:
        d, b = self._seconds[modes.DIRECT], self._seconds[modes.BUFFERED]
        if not d or not b:
            return modes.Choice(self._start, f"one way read nothing: kept {self._start}", tuple(d), tuple(b))
        c = modes.choose(d, b, previous=self._start)
        return modes.Choice(c.mode, f"this load's reads: {c.why}", c.direct_s, c.buffered_s)


__all__ = ["MIN_READS", "TRIAL_READS", "UNIT", "ModeTrial"]
