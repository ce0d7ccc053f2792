"""How often to save (issue 20, item 3): what checkpoints cost, and the interval that minimises
the time a job loses to them and to failures. Pure: numbers in, records out.

The model (Young 1974; Daly 2006): a job fails at random with mean time between failures
``M``; each checkpoint stops the training loop for ``C`` seconds (for an async save, the
time the loop was blocked, not the whole save); after a failure the job spends ``R`` seconds
restarting (the restore, plus relaunching) and redoes the work since its last checkpoint,
half an interval on average. Saving every ``T`` seconds of work loses about
``C / T + (T / 2 + R) / M`` of the time; its minimum is Young's ``T = sqrt(2 C M)``. Daly's
higher-order estimate, valid for ``C < 2 M``, is
``T = sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C`` (``T = M`` otherwise); the
restart cost ``R`` does not move the optimum, only what is lost at it. Assumptions: failures
are independent and memoryless (exponential), ``C``, ``R`` and ``M`` are constant, and ``C``
and ``R`` are small next to ``M``. An interval is never shorter than one save's total time
(an async save still in flight when the next is due would make the loop wait for it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveCost:
    """One save as the Checkpointer measured it: ``blocked`` (seconds the loop waited),
    ``total`` (from the call to the commit), ``bytes`` (written by this rank)."""

    step: int
    blocked: float
    total: float
    bytes: int


RESTORE_PHASES = ("discover", "open", "plan", "read", "verify", "apply")


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreCost:
    """One restore as the Checkpointer measured it: ``seconds`` in all, and ``phases``, the
    seconds of each of ``RESTORE_PHASES`` (summed over the checkpoints tried, when one was
    given up): ``discover``, choosing the checkpoint (listing the root, reading its markers,
    telling every rank); ``open``, its manifest (compatibility checked) and this rank's index;
    ``plan``, the state sorted against it and the reads planned; ``read``, the reads, each
    chunk hashed and checked as it lands (the digests' verification is inside the read pass,
    as are the values' sums); ``verify``, the ranks agreeing that every one loaded and the
    loaded values' statistics compared; ``apply``, the non-tensor state applied."""

    step: int
    seconds: float
    phases: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """What this Checkpointer's saves and restores cost (this rank's view), newest last."""

    saves: tuple[SaveCost, ...] = ()
    restores: tuple[RestoreCost, ...] = ()

    @property
    def blocked(self) -> float | None:
        """The median seconds a save kept the training loop waiting (None: no save yet)."""
        return statistics.median(s.blocked for s in self.saves) if self.saves else None

    @property
    def total(self) -> float | None:
        """The median seconds from a save's call to its commit."""
        return statistics.median(s.total for s in self.saves) if self.saves else None

    @property
    def restore(self) -> float | None:
        """The median seconds a restore took."""
        return statistics.median(r.seconds for r in self.restores) if self.restores else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A suggested interval between saves, in seconds of training, and what it rests on."""

    seconds: float
    formula: str  # "young", "daly", or "daly (C >= 2M: T = M)"
    cost: float  # C
    mtbf: float  # M
    restart: float  # R
    floor: float  # one save's total time: the interval is never shorter
    lost_fraction: float  # C/T + (T/2 + R)/M at the interval: the share of time lost


def young(cost: float, mtbf: float) -> float:
    return math.sqrt(2 * cost * mtbf)


def daly(cost: float, mtbf: float) -> float:
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


def suggest(*, cost: float, mtbf: float, restart: float = 0.0, total: float | None = None,
            formula: str = "daly") -> Interval:
    """The interval for checkpoints costing ``cost`` seconds of the loop each, failures every
    ``mtbf`` seconds on average, ``restart`` seconds to come back; never under ``total`` (one
    save's whole time). ``formula``: "daly" (default) or "young"."""
    if not (mtbf > 0 and math.isfinite(mtbf)):
        raise ValueError(f"mtbf must be a positive number of seconds, got {mtbf!r}")
    if not (cost >= 0 and restart >= 0):
        raise ValueError(f"cost and restart must be >= 0 seconds, got {cost!r}, {restart!r}")
    if formula not in ("daly", "young"):
        raise ValueError(f"formula must be 'daly' or 'young', got {formula!r}")
    t = young(cost, mtbf) if formula == "young" else daly(cost, mtbf)
    name = formula if formula == "young" or cost < 2 * mtbf else "daly (C >= 2M: T = M)"
    floor = total if total is not None else cost
    t = max(t, floor, 1e-9)
    return Interval(seconds=t, formula=name, cost=cost, mtbf=mtbf, restart=restart, floor=floor,
                    lost_fraction=cost / t + (t / 2 + restart) / mtbf)


def steps_for(seconds: float, step_times: Sequence[float]) -> int:
    """The number of training steps that take ``seconds`` at the median of ``step_times`` (>= 1)."""
    if not step_times:
        return 1
    per = statistics.median(step_times)
    return max(1, round(seconds / per)) if per > 0 else 1


__all__ = ["RESTORE_PHASES", "Interval", "RestoreCost", "SaveCost", "Stats", "daly", "steps_for", "suggest", "young"]
