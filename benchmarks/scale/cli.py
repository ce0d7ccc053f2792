"""The driver: every (layout, N, format, side), each measurement in a fresh process, within a budget.

    python -m benchmarks.scale                              # 8B at 64, 1024, 4096; 70B at 4096; v1 and DCP
    python -m benchmarks.scale --layouts 8b --ranks 64,256 --repeat 1 --budget-s 60
    python -m benchmarks.scale child ADAPTER SIDE LAYOUT N WORK   # one measurement (what the driver runs)

Per layout, N ascending, format: 1) ``prepare`` in a child (its inputs on disk under
``--work``); 2) every side ``--repeat`` times, each in a fresh child. A side (or a prepare)
whose CPU time, projected from the same side at the two largest smaller N (``t ~ N^p``, p
fitted; one point: linear), exceeds ``--budget-s`` (``--prepare-budget-s``), or whose
projected peak RSS exceeds 80% of the machine's available memory, is skipped and reported
with the projection and why. Results: the JSON (every run, medians, spreads) and the
markdown tables under ``--out`` (default ``benchmarks/results/<date>-scale-<commit>/``), the tables
printed too. Exit status: 0 every measurement ran or was skipped by the budget, 2 one failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.scale import report
from benchmarks.scale.adapter import SIDES, Adapter
from benchmarks.scale.dcp import DCP
from benchmarks.scale.layouts import DEFAULT_RANKS, LAYOUTS, Job
from benchmarks.scale.measure import Meter, available_mib, emit, run_child
from benchmarks.scale.v1 import V1
from benchmarks.scale.v2 import V2

ADAPTERS: dict[str, type[Adapter]] = {"v1": V1, "v2": V2, "dcp": DCP}
ROOT = Path(__file__).resolve().parents[2]


def make_job(layout: str, n: int, load_rank: int | None = None) -> Job:
    job = LAYOUTS[layout](n)
    return job if load_rank is None else Job(model=job.model, save=job.save, load=job.load, load_rank=load_rank)


# ----------------------------------------------------------------------------- the child


def child(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.scale child")
    p.add_argument("adapter", choices=sorted(ADAPTERS))
    p.add_argument("side", choices=("prepare", *SIDES))
    p.add_argument("layout", choices=sorted(LAYOUTS))
    p.add_argument("n", type=int)
    p.add_argument("work")
    p.add_argument("--load-rank", type=int, default=None)
    a = p.parse_args(argv)
    job = make_job(a.layout, a.n, a.load_rank)
    adapter = ADAPTERS[a.adapter]()
    work = Path(a.work)
    if a.side == "prepare":
        meter = Meter()
        meter.start()
        with meter.phase("prepare"):
            facts = adapter.prepare(job, work)
        emit({**meter.result(), "facts": facts})
        return 0
    meter = Meter()
    adapter.run(a.side, job, work, meter)
    emit(meter.result())
    return 0


# ----------------------------------------------------------------------------- projections


def project(points: list[tuple[int, float]], n: int) -> tuple[float, str] | None:
    """``t`` at ``n`` from (N, t) points at smaller N: ``t ~ N^p`` through the two largest."""
    pts = sorted((x, y) for x, y in points if x < n and y > 0)
    if not pts:
        return None
    if len(pts) == 1:
        (x1, y1), = pts
        return y1 * n / x1, f"linear from N={x1}"
    (x1, y1), (x2, y2) = pts[-2], pts[-1]
    p = math.log(y2 / y1) / math.log(x2 / x1)
    return y2 * (n / x2) ** p, f"N^{p:.2f} from N={x1},{x2}"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def summarize(runs: list[dict]) -> dict:
    """Median and [min, max] of every phase's CPU s and of the side's headline CPU s and peak."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {}
    headline = ok[0]["facts"].get("headline") or list(ok[0]["phases"])
    out: dict = {"runs": len(ok)}

    def stat(xs):
        return {"median": _median(xs), "min": min(xs), "max": max(xs)}

    out["headline_cpu_s"] = stat([sum(r["phases"][h]["cpu_s"] for h in headline) for r in ok])
    out["side_cpu_s"] = stat([r["cpu_s"] for r in ok])
    out["peak_mib"] = stat([r["peak_mib"] for r in ok])
    out["phases"] = {name: stat([r["phases"][name]["cpu_s"] for r in ok]) for name in ok[0]["phases"]}
    out["facts"] = {k: v for k, v in ok[0]["facts"].items() if k != "headline"}
    out["headline"] = headline
    return out


# ----------------------------------------------------------------------------- the driver


class Driver:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.results: list[dict] = []
        self.failed = False

    def history(self, layout: str, adapter: str, side: str, key: str) -> list[tuple[int, float]]:
        return [(r["n"], r[side]["summary"][key]["median"]) for r in self.results
                if r["layout"] == layout and r["adapter"] == adapter and r.get(side, {}).get("summary")]

    def too_big(self, layout: str, adapter: str, side: str, n: int, budget: float) -> dict | None:
        key = "side_cpu_s"
        cpu = project(self.history(layout, adapter, side, key), n)
        mem = project(self.history(layout, adapter, side, "peak_mib"), n)
        room = 0.8 * available_mib()
        if cpu and cpu[0] > budget:
            return {"skipped": f"projected {cpu[0]:.0f} s CPU ({cpu[1]}) > budget {budget:.0f} s",
                    "projected_cpu_s": cpu[0], "projected_peak_mib": mem[0] if mem else None}
        if mem and mem[0] > room:
            return {"skipped": f"projected peak {mem[0]:.0f} MiB ({mem[1]}) > 80% of available memory "
                               f"({room:.0f} MiB)", "projected_cpu_s": cpu[0] if cpu else None,
                    "projected_peak_mib": mem[0]}
        return None

    def measure(self, adapter: str, side: str, layout: str, n: int, work: Path, budget: float) -> dict:
        args = [adapter, side, layout, str(n), str(work)]
        if self.a.load_rank is not None:
            args += ["--load-rank", str(self.a.load_rank)]
        repeat = 1 if side == "prepare" else self.a.repeat
        runs = []
        for i in range(repeat):
            r = run_child(["child", *args], timeout=max(300.0, 8 * budget))  # wall: a busy machine runs 2-4x CPU
            runs.append(r)
            tag = f"{layout} N={n} {adapter} {side} #{i + 1}"
            if "error" in r:
                print(f"  {tag}: FAILED {r['error'][:300]}", flush=True)
                self.failed = True
                break
            print(f"  {tag}: {r['cpu_s']:.2f} s CPU, peak {r['peak_mib']:.0f} MiB, wall {r['wall_s']:.1f} s", flush=True)
            if r["cpu_s"] > self.a.repeat_limit_s and i + 1 < repeat:
                print(f"  {tag}: over --repeat-limit-s {self.a.repeat_limit_s:.0f} s: not repeated", flush=True)
                break
        return {"runs": runs, "summary": summarize(runs)}

    def one(self, layout: str, n: int, adapter: str, base: Path) -> None:
        job = make_job(layout, n, self.a.load_rank)
        rec: dict = {"layout": layout, "n": n, "adapter": adapter, "job": job.name}
        self.results.append(rec)
        why = job.check()
        if why:
            rec["skipped"] = why
            print(f"{layout} N={n} {adapter}: skipped: {why}", flush=True)
            return
        skip = self.too_big(layout, adapter, "prepare", n, self.a.prepare_budget_s)
        if skip:
            rec["prepare"] = skip
            for side in self.a.sides:
                rec[side] = {"skipped": "no inputs: prepare skipped",
                             **{k: v for k, v in (self.too_big(layout, adapter, side, n, 0) or {}).items()
                                if k.startswith("projected")}}
            print(f"{layout} N={n} {adapter}: prepare skipped: {skip['skipped']}", flush=True)
            return
        work = base / f"{layout}-n{n}-{adapter}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        print(f"{layout} N={n} {adapter}: prepare", flush=True)
        try:
            rec["prepare"] = prep = self.measure(adapter, "prepare", layout, n, work, self.a.prepare_budget_s)
            if not prep["summary"]:
                return
            for side in self.a.sides:
                skip = self.too_big(layout, adapter, side, n, self.a.budget_s)
                if skip:
                    rec[side] = skip
                    print(f"  {layout} N={n} {adapter} {side}: skipped: {skip['skipped']}", flush=True)
                    continue
                rec[side] = self.measure(adapter, side, layout, n, work, self.a.budget_s)
        finally:
            if not self.a.keep_work:
                shutil.rmtree(work, ignore_errors=True)

    def run(self) -> None:
        base = Path(self.a.work or tempfile.mkdtemp(prefix="shardfmt-scale-"))
        for layout in self.a.layouts:
            for n in sorted(self.a.ranks or DEFAULT_RANKS[layout]):
                for adapter in self.a.adapters:
                    self.one(layout, n, adapter, base)


def _commit_id() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", type=_csv(str), default=["8b", "70b"], help="of: " + ", ".join(sorted(LAYOUTS)))
    p.add_argument("--ranks", type=_csv(int), default=None,
                   help="N values (default per layout: 8b 64,1024,4096; 70b 4096)")
    p.add_argument("--adapters", type=_csv(str), default=list(ADAPTERS), help="of: " + ", ".join(ADAPTERS))
    p.add_argument("--sides", type=_csv(str), default=list(SIDES), help="of: " + ", ".join(SIDES))
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per measurement (medians, spreads)")
    p.add_argument("--repeat-limit-s", type=float, default=300.0,
                   help="a measurement whose first run took more CPU s than this is not repeated")
    p.add_argument("--budget-s", type=float, default=600.0, help="skip a measurement projected past this CPU s")
    p.add_argument("--prepare-budget-s", type=float, default=1800.0, help="the same for building its inputs")
    p.add_argument("--load-rank", type=int, default=None, help="the rank whose load is measured (N/2 + 1)")
    p.add_argument("--work", default=None, help="scratch directory for the inputs (default: a temp dir)")
    p.add_argument("--keep-work", action="store_true", help="keep the inputs (checkpoints, message blobs)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results/<date>-scale-<commit>)")
    a = p.parse_args(argv)
    for name, allowed in (("layouts", LAYOUTS), ("adapters", ADAPTERS), ("sides", SIDES)):
        bad = [x for x in getattr(a, name) if x not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; expected of {sorted(allowed)}")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        return child(argv[1:])
    a = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    commit = _commit_id()  # the code that runs (a commit made while it runs is not it)
    d = Driver(a)
    d.run()
    out = Path(a.out or ROOT / "benchmarks" / "results" / f"{started:%Y-%m-%d}-scale-{commit}")
    out.mkdir(parents=True, exist_ok=True)
    doc = {"started": started.isoformat(), "finished": dt.datetime.now(dt.timezone.utc).isoformat(),
           "commit": commit, "argv": argv, "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                       "available_mib_at_end": available_mib()},
           "budget_s": a.budget_s, "repeat_limit_s": a.repeat_limit_s, "prepare_budget_s": a.prepare_budget_s, "repeat": a.repeat, "results": d.results}
    (out / "scale.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = report.render(doc)
    (out / "scale.md").write_text(text)
    print(text)
    print(f"wrote {out / 'scale.json'} and {out / 'scale.md'}")
    return 2 if d.failed else 0
