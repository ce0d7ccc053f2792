"""From a scenario and the command line to jobs: which processes run which steps. Pure.

``schedule``: rounds ``1 - warmup .. rounds`` (rounds <= 0 are warm-up: recorded, never
judged); each round runs every candidate once, in an order that changes both where each
candidate runs and which one runs just before it (``orders``): a plain rotation keeps the
neighbours fixed, so a candidate that always follows the same one would carry whatever that
one leaves behind (the page cache, memory handed back to the host) in every round. ``plan_jobs``: consecutive phases on
the same world share one job (one process per rank, kept across phases); a
``fresh_process`` phase gets one job per step. Checks every candidate fits its phase.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .. import candidates
from .model import Phase, Scenario

# Seconds every rank idles before a measured call. This project's VM hands memory freed ~2 s ago
# back to its host (virtio-balloon free page reporting), and the next touches of it cost ~1 s of
# CPU per GiB: a buffered read into page-cache pages freed just before ran 0.65 s, the same read
# 5 s later 1.24 s (benchmarks/README.md, session 19). Idling first puts every call in that state.
SETTLE_S = 3.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The run's knobs, each with its one default here."""

    size_mib: int
    rounds: int = 5
    warmup: int = 1
    device: str = "cpu"
    fsync: bool = True
    ranks: int | None = None     # overrides the scenario's ranks (phases without a world of their own)
    settle: float = SETTLE_S     # seconds every rank idles before each measured call


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseSteps:
    name: str
    steps: tuple[tuple[int, str], ...]
    src_world: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict:
        return {"name": self.name, "steps": [list(s) for s in self.steps], "src_world": dict(self.src_world)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    world: int
    phases: tuple[PhaseSteps, ...]


GREEDY_MAX = 7  # names whose every order is tried (7! = 5040)


def orders(names: Sequence[str], count: int) -> list[list[str]]:
    """``count`` rounds' orders of ``names``: each round, of the orders (all of them for up to
    ``GREEDY_MAX`` names, else ``count`` stepped walks), the first that puts the most candidates
    at a position, and after a candidate, they have not had yet; the first round keeps the
    declared order. Deterministic."""
    names = list(names)
    n = len(names)
    seen_at: set[tuple[str, int]] = set()
    seen_after: set[tuple[str, str]] = set()
    out: list[list[str]] = []
    for r in range(count):
        pool = itertools.permutations(names) if n <= GREEDY_MAX else (_walk(names, k) for k in range(max(1, count)))
        best = list(names) if r == 0 else max(pool, key=lambda o: _novelty(o, seen_at, seen_after))
        out.append(list(best))
        seen_at.update((x, i) for i, x in enumerate(best))
        seen_after.update((x, best[i - 1]) for i, x in enumerate(best) if i)
    return out


def _novelty(o: Sequence[str], seen_at: set, seen_after: set) -> int:
    return (2 * sum((x, i) not in seen_at for i, x in enumerate(o))  # positions first, then neighbours
            + sum((x, o[i - 1]) not in seen_after for i, x in enumerate(o) if i))


def _walk(names: list[str], k: int) -> tuple[str, ...]:
    n = len(names)
    steps = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    step = steps[k % len(steps)]
    return tuple(names[(k + i * step) % n] for i in range(n))


def schedule(names: Sequence[str], *, rounds: int, warmup: int) -> list[tuple[int, str]]:
    rs = list(range(1 - warmup, rounds + 1))
    return [(r, n) for r, o in zip(rs, orders(names, len(rs))) for n in o]


def world_of(sc: Scenario, phase: Phase, opts: Options) -> int:
    return phase.world if phase.world is not None else (opts.ranks or sc.ranks)


def check(sc: Scenario, opts: Options) -> None:
    """Every candidate exists, runs in its phase's kind and layout, and reads something saved before."""
    saved: dict[str, int] = {}
    for ph in sc.phases:
        w = world_of(sc, ph, opts)
        for name in ph.candidates:
            c = candidates.get(name)
            where = f"scenario {sc.name!r}, phase {ph.name!r}: {name}"
            if c.kind != ph.kind:
                raise ValueError(f"{where} is a {c.kind} candidate in a {ph.kind} phase")
            if c.reads is not None and c.reads not in saved:
                raise ValueError(f"{where} reads {c.reads}, which no earlier phase saves")
            if ph.kind == "load" and ph.layout not in c.layouts:
                raise ValueError(f"{where} cannot fill the {ph.layout!r} layout")
            if c.same_world and saved.get(c.reads) != w:
                raise ValueError(f"{where} loads only on the world that saved")
        for name in ph.candidates:
            if ph.kind == "save":
                saved[name] = w
    for t in sc.targets:
        for r in t.refs():
            if r.candidate not in sc.phase(r.phase).candidates:
                raise ValueError(f"scenario {sc.name!r}, target {t.title!r}: {r.label()} is not measured")


def plan_jobs(sc: Scenario, opts: Options) -> list[Job]:
    check(sc, opts)
    saved = {n: world_of(sc, p, opts) for p in sc.phases if p.kind == "save" for n in p.candidates}
    jobs: list[Job] = []
    for ph in sc.phases:
        w = world_of(sc, ph, opts)
        steps = (schedule(ph.candidates, rounds=opts.rounds, warmup=opts.warmup) if ph.timed
                 else [(0, n) for n in ph.candidates])
        src = tuple((n, saved[candidates.get(n).reads]) for n in ph.candidates if candidates.get(n).reads)
        if ph.fresh_process:
            jobs += [Job(world=w, phases=(PhaseSteps(name=ph.name, steps=(s,), src_world=src),)) for s in steps]
        elif jobs and jobs[-1].world == w and not sc.phase(jobs[-1].phases[-1].name).fresh_process:
            jobs[-1] = Job(world=w, phases=jobs[-1].phases + (PhaseSteps(name=ph.name, steps=tuple(steps),
                                                                          src_world=src),))
        else:
            jobs.append(Job(world=w, phases=(PhaseSteps(name=ph.name, steps=tuple(steps), src_world=src),)))
    return jobs
