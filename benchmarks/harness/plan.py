"""From a scenario and the command line to jobs: which processes run which steps. Pure.

``schedule``: rounds ``1 - warmup .. rounds`` (rounds <= 0 are warm-up: recorded, never
judged); each round runs every candidate once, the list rotated by the round number, so
every candidate and floor takes every position in turn. ``plan_jobs``: consecutive phases on
the same world share one job (one process per rank, kept across phases); a
``fresh_process`` phase gets one job per step. Checks every candidate fits its phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import candidates
from .model import Phase, Scenario


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The run's knobs, each with its one default here."""

    size_mib: int
    rounds: int = 5
    warmup: int = 1
    device: str = "cpu"
    fsync: bool = True
    ranks: int | None = None     # overrides the scenario's ranks (phases without a world of their own)
    settle: float = 0.0          # seconds every rank idles before each measured call


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


def rotate(names: Sequence[str], k: int) -> list[str]:
    names = list(names)
    k %= len(names)
    return names[k:] + names[:k]


def schedule(names: Sequence[str], *, rounds: int, warmup: int) -> list[tuple[int, str]]:
    return [(r, n) for r in range(1 - warmup, rounds + 1) for n in rotate(names, r)]


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
