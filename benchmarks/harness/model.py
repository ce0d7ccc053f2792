"""What a scenario declares: its state, its phases (candidates timed together), its targets.

Records only (frozen, no I/O). A scenario file builds one ``Scenario`` from these; the
harness (``plan``, ``worker``, ``report``) does everything else: rounds, rotation, cold
caches, processes, statistics, verdicts.

A target is a ratio of sums of measured medians, ``R = num / den``, checked against a bound
(``R >= bound`` or ``R <= bound``). Helpers below spell the usual ones:
``throughput(...)`` (candidate vs floor, "at least k x the floor's throughput") and
``ratio(...)`` (anything else: blocked time vs memcpy, requests vs DCP, RSS growth vs a
constant). ``verdict.judge`` decides from the spreads, not from the medians alone.
"""

from __future__ import annotations

from dataclasses import dataclass

PHASE_KINDS = ("save", "load", "convert")
LAYOUTS = ("rows", "cols", "full")
CACHES = ("cold", "warm")


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSpec:
    """Which state builder of ``benchmarks.states`` makes the state, and its default sizes."""

    builder: str                  # a name in states.BUILDERS
    size_mib: int                 # default size of the whole state (all ranks together)
    quick_mib: int = 64           # size under --quick
    replicated: bool = False      # transformer: add replicated norms and a 0-d step tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """Candidates timed against each other: every round runs each once, the order rotating.

    ``kind``: ``save`` (candidates write the state; each one's last output is kept for the
    loads), ``load`` (candidates fill NaN targets of ``layout`` from what their ``reads``
    candidate saved, page cache ``cold`` or ``warm``), ``convert`` (offline tools from a
    prepared source). ``world``: processes (None: the scenario's ``ranks``). ``timed``:
    False runs every candidate once, untimed (a prepared source). ``fresh_process``: one
    process per measurement (peak RSS from a clean start).
    """

    name: str
    kind: str
    candidates: tuple[str, ...]
    world: int | None = None
    layout: str = "rows"
    cache: str = "cold"
    timed: bool = True
    fresh_process: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PHASE_KINDS or self.layout not in LAYOUTS or self.cache not in CACHES:
            raise ValueError(f"phase {self.name!r}: kind {self.kind!r}, layout {self.layout!r}, cache "
                             f"{self.cache!r} (kinds {PHASE_KINDS}, layouts {LAYOUTS}, caches {CACHES})")
        if not self.candidates:
            raise ValueError(f"phase {self.name!r} has no candidates")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ref:
    """One measured quantity: ``metric`` of ``candidate`` in ``phase`` (per round, over ranks)."""

    phase: str
    candidate: str
    metric: str = "seconds"

    def label(self) -> str:
        return f"{self.phase}:{self.candidate}" + ("" if self.metric == "seconds" else f".{self.metric}")


# A sum of terms; a term is (coefficient, Ref), or (constant, None).
Expr = tuple[tuple[float, "Ref | None"], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """``num / den`` (sums of medians) ``op`` ``bound``; ``op`` is ``>=`` or ``<=``."""

    title: str
    num: Expr
    den: Expr
    op: str
    bound: float

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"target {self.title!r}: op must be '>=' or '<=', got {self.op!r}")
        if any(c <= 0 for c, _ in self.num + self.den):
            raise ValueError(f"target {self.title!r}: coefficients and constants must be positive")

    def refs(self) -> tuple[Ref, ...]:
        return tuple(r for _, r in self.num + self.den if r is not None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A benchmark: one state, ``ranks`` processes by default, phases in order, targets."""

    name: str
    doc: str
    state: StateSpec
    ranks: int
    phases: tuple[Phase, ...]
    targets: tuple[Target, ...] = ()

    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"scenario {self.name!r} has no phase {name!r}")

    def world_of(self, phase: Phase) -> int:
        return self.ranks if phase.world is None else phase.world


def _expr(x) -> Expr:
    """A Ref, a number, or an iterable of Refs/(coef, Ref)/numbers, as an Expr."""
    if isinstance(x, Ref):
        return ((1.0, x),)
    if isinstance(x, (int, float)):
        return ((float(x), None),)
    out = []
    for item in x:
        if isinstance(item, Ref):
            out.append((1.0, item))
        elif isinstance(item, (int, float)):
            out.append((float(item), None))
        else:
            out.append((float(item[0]), item[1]))
    return tuple(out)


def throughput(phase: str, candidate: str, k: float, floor: str, *, floor_phase: str | None = None) -> Target:
    """``candidate`` moves its bytes at >= ``k`` x the throughput of ``floor`` (floor time / time >= k)."""
    fl = Ref(phase=floor_phase or phase, candidate=floor)
    return Target(title=f"{phase}: {candidate} >= {k:g}x the throughput of {fl.label()}",
                  num=_expr(fl), den=_expr(Ref(phase=phase, candidate=candidate)), op=">=", bound=k)


def ratio(title: str, num, op: str, bound: float, den=1.0) -> Target:
    """``num / den op bound``; ``num``/``den``: a Ref, a number, or a sequence of them."""
    return Target(title=title, num=_expr(num), den=_expr(den), op=op, bound=bound)
