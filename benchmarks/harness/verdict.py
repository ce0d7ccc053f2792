"""Medians, spreads and target verdicts. Pure: numbers in, records out.

The method (issue 22's, to survive a shared, noisy machine): every quantity is measured
once per round, candidates and floors interleaved; a target's ratio ``R = num / den`` is
judged on *intervals*, not on the medians alone. Each measured quantity's spread is its
interquartile range over the judged rounds (``spread="iqr"``, the default: one outlier
round does not decide) or its whole range (``spread="range"``). The interval of ``R`` is
``[num.lo / den.hi, num.hi / den.lo]``; a target ``R >= k`` passes when the whole interval
is >= k, fails when it is wholly < k, and otherwise gets no verdict ("overlap"). The
median ratio is reported beside it, and the per-round (paired) ratios too. Under
``MIN_ROUNDS`` judged rounds no verdict is given (two values have no spread to speak of).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .model import Expr, Ref, Target

SPREADS = ("iqr", "range")
PASS, FAIL, OVERLAP, FEW = "pass", "fail", "overlap: no verdict", "too few rounds: no verdict"
MIN_ROUNDS = 3  # fewer judged rounds than this give no spread worth a verdict


@dataclass(frozen=True, slots=True, kw_only=True)
class Spread:
    """Summary of one quantity over the judged rounds."""

    n: int
    median: float
    min: float
    max: float
    q1: float
    q3: float

    def interval(self, spread: str) -> tuple[float, float]:
        if spread == "iqr":
            return self.q1, self.q3
        if spread == "range":
            return self.min, self.max
        raise ValueError(f"spread must be one of {SPREADS}, got {spread!r}")

    def to_json(self) -> dict:
        return {"n": self.n, "median": self.median, "min": self.min, "max": self.max, "q1": self.q1,
                "q3": self.q3}


def summarize(values: Sequence[float]) -> Spread:
    """Median, min/max and inclusive quartiles of ``values`` (at least one)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("no values to summarize")
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return Spread(n=len(xs), median=statistics.median(xs), min=xs[0], max=xs[-1], q1=q1, q3=q3)


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """A target's outcome: median ratio, its interval, the verdict, the per-round ratios."""

    title: str
    op: str
    bound: float
    value: float | None
    lo: float | None
    hi: float | None
    verdict: str
    paired: tuple[float, ...] = ()
    note: str = ""

    def to_json(self) -> dict:
        return {"target": self.title, "op": self.op, "bound": self.bound, "value": self.value, "lo": self.lo,
                "hi": self.hi, "verdict": self.verdict, "paired": list(self.paired), "note": self.note}


def _expr_interval(expr: Expr, spreads: Mapping[Ref, Spread], spread: str) -> tuple[float, float, float]:
    """(lo, hi, median) of a positive sum of measured quantities and constants."""
    lo = hi = med = 0.0
    for coef, ref in expr:
        if ref is None:
            lo, hi, med = lo + coef, hi + coef, med + coef
            continue
        s = spreads[ref]
        a, b = s.interval(spread)
        lo, hi, med = lo + coef * a, hi + coef * b, med + coef * s.median
    return lo, hi, med


def decide(op: str, bound: float, lo: float, hi: float) -> str:
    """Pass/fail only when the whole interval ``[lo, hi]`` is on one side of ``bound``."""
    if op == ">=":
        return PASS if lo >= bound else FAIL if hi < bound else OVERLAP
    if op == "<=":
        return PASS if hi <= bound else FAIL if lo > bound else OVERLAP
    raise ValueError(f"op must be '>=' or '<=', got {op!r}")


def _paired(target: Target, per_round: Mapping[Ref, Mapping[int, float]]) -> tuple[float, ...]:
    """The ratio computed within each round that measured every quantity of the target."""
    rounds = None
    for ref in target.refs():
        have = set(per_round.get(ref, {}))
        rounds = have if rounds is None else rounds & have
    out = []
    for k in sorted(rounds or ()):
        num = sum(c * (1.0 if r is None else per_round[r][k]) for c, r in target.num)
        den = sum(c * (1.0 if r is None else per_round[r][k]) for c, r in target.den)
        if den > 0:
            out.append(num / den)
    return tuple(out)


def judge(target: Target, spreads: Mapping[Ref, Spread], per_round: Mapping[Ref, Mapping[int, float]] | None = None,
          *, spread: str = "iqr") -> Verdict:
    """The verdict of ``target`` from the spreads of its quantities (see the module docstring)."""
    missing = [r.label() for r in target.refs() if r not in spreads]
    if missing:
        return Verdict(title=target.title, op=target.op, bound=target.bound, value=None, lo=None, hi=None,
                       verdict="n/a", note="not measured: " + ", ".join(missing))
    nlo, nhi, nmed = _expr_interval(target.num, spreads, spread)
    dlo, dhi, dmed = _expr_interval(target.den, spreads, spread)
    if dlo <= 0 or dmed <= 0:
        return Verdict(title=target.title, op=target.op, bound=target.bound, value=None, lo=None, hi=None,
                       verdict="n/a", note="the denominator is not positive")
    lo, hi = nlo / dhi, nhi / dlo
    few = min(spreads[r].n for r in target.refs()) < MIN_ROUNDS if target.refs() else False
    return Verdict(title=target.title, op=target.op, bound=target.bound, value=nmed / dmed, lo=lo, hi=hi,
                   verdict=FEW if few else decide(target.op, target.bound, lo, hi),
                   paired=_paired(target, per_round or {}))
