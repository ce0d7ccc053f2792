"""From every rank's records to the report: per-round figures, medians and spreads, verdicts.

A measurement's figure for a round is the slowest rank's (max over ranks) for times and
memory, and the sum over ranks for byte and request counts (``SUMMED``). Rounds <= 0 are
warm-up: shown apart, never judged. ``x floor`` = the phase floor's median time / the
candidate's (throughput ratio: every candidate of a phase moves the same bytes).
"""

from __future__ import annotations

from collections import defaultdict

from .model import Ref, Scenario
from .verdict import Spread, judge, summarize

SUMMED = frozenset({"bytes", "bytes_read", "bytes_needed", "read_requests", "rchar", "wchar", "syscr", "syscw", "read_bytes",
                    "write_bytes", "server_requests", "server_bytes", "source_bytes", "needed_chunks"})
NOT_METRICS = frozenset({"kind", "phase", "candidate", "round", "rank"})
FLOORS = ("floor.write", "floor.read", "copy")
PRIMARY = {"memcpy": "local"}  # the memcpy bound: the slowest rank's own copy time, no barrier latency


def per_round(records: list[dict]) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """(phase, candidate) -> metric -> round -> figure over the ranks."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in records:
        if r.get("kind") != "op":
            continue
        for k, v in r.items():
            if k not in NOT_METRICS and isinstance(v, (int, float)):
                acc[(r["phase"], r["candidate"])][k][r["round"]].append(float(v))
    return {key: {m: {rnd: (sum(vs) if m in SUMMED else max(vs)) for rnd, vs in by.items()}
                  for m, by in metrics.items()} for key, metrics in acc.items()}


def spreads(figures) -> dict[Ref, Spread]:
    out = {}
    for (phase, cand), metrics in figures.items():
        for m, by in metrics.items():
            judged = [v for rnd, v in by.items() if rnd >= 1]
            if judged:
                out[Ref(phase=phase, candidate=cand, metric=m)] = summarize(judged)
    return out


def build(sc: Scenario, records: list[dict], *, spread: str) -> dict:
    """The report's JSON body: rows per (phase, candidate), verdicts, errors."""
    figs = per_round(records)
    sp = spreads(figs)
    rows = []
    for ph in sc.phases:
        floor = next((f for f in FLOORS if f in ph.candidates), None)
        for cand in ph.candidates:
            metrics = figs.get((ph.name, cand))
            if not metrics:
                continue
            prim = PRIMARY.get(cand, "seconds")
            s = sp.get(Ref(phase=ph.name, candidate=cand, metric=prim))
            fl = sp.get(Ref(phase=ph.name, candidate=floor)) if floor and floor != cand else None
            nbytes = next(iter(metrics["bytes"].values()), 0)
            rows.append({
                "phase": ph.name, "candidate": cand, "primary": prim, "bytes": nbytes,
                "gbps": nbytes / s.median / 1e9 if s and s.median > 0 else None,
                "x_floor": fl.median / s.median if fl and s and prim == "seconds" else None,
                "metrics": {m: {"spread": sp[Ref(phase=ph.name, candidate=cand, metric=m)].to_json()
                                if Ref(phase=ph.name, candidate=cand, metric=m) in sp else None,
                                "rounds": {str(k): v for k, v in sorted(by.items())}}
                            for m, by in metrics.items()}})
    per_ref = {Ref(phase=p, candidate=c, metric=m): {k: v for k, v in by.items() if k >= 1}
               for (p, c), metrics in figs.items() for m, by in metrics.items()}
    verdicts = [judge(t, sp, per_ref, spread=spread) for t in sc.targets]
    errors = sorted({f"{r['phase']} {r['candidate']}: {r['error']}" for r in records if r.get("kind") == "error"})
    return {"rows": rows, "targets": [v.to_json() for v in verdicts], "errors": errors, "spread": spread}


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _row_line(r: dict) -> str:
    m = r["metrics"][r["primary"]]
    s = m["spread"]
    if s is None:
        return f"{r['phase']:<10}{r['candidate']:<26}  warm-up only"
    rss = max(r["metrics"]["rss_growth"]["rounds"].values()) / (1 << 20)
    runs = " ".join(f"{v:.3f}" for k, v in m["rounds"].items() if int(k) >= 1)
    return (f"{r['phase']:<10}{r['candidate']:<26}{s['median']:9.3f}  {s['q1']:7.3f}-{s['q3']:<7.3f}"
            f"{s['min']:7.3f}-{s['max']:<7.3f}{_fmt(r['gbps'], '.2f'):>7}{_fmt(r['x_floor']):>8}{rss:9.0f}  {runs}")


def _async_line(r: dict) -> str | None:
    ms = r["metrics"]
    if "blocked" not in ms or ms["blocked"]["spread"] is None:
        return None
    cells = []
    for k in ("blocked", "staged", "seconds"):
        s = ms[k]["spread"]
        cells.append(f"{s['median']:8.3f} [{s['q1']:.3f}-{s['q3']:.3f}]")
    return f"{r['phase']:<10}{r['candidate']:<26}" + "  ".join(cells)


def _verdict_line(v: dict) -> str:
    flag = {"pass": "PASS", "fail": "FAIL", "n/a": "----"}.get(v["verdict"], v["verdict"].split(":")[0].upper())
    if v["value"] is None:
        return f"  {flag:<16}{v['target']}  ({v['note']})"
    paired = " ".join(f"{x:.2f}" for x in v["paired"])
    return (f"  {flag:<16}{v['target']}: {v['value']:.3f} (interval {v['lo']:.3f}..{v['hi']:.3f}, needs "
            f"{v['op']} {v['bound']:g}; per round {paired})")


def text(meta: dict, body: dict) -> str:
    out = [meta["headline"], f"time = slowest rank's barrier-to-barrier seconds (memcpy: its own copy time); "
           f"spread = IQR and min-max over the {meta['rounds']} judged rounds (warm-up rounds: {meta['warmup']}); "
           "x floor = floor median / median (throughput)",
           f"{'phase':<10}{'candidate':<26}{'median s':>9}  {'IQR':<15}{'min-max':<15}{'GB/s':>7}{'x floor':>8}"
           f"{'RSS+MiB':>9}  per round (s)"]
    out += [_row_line(r) for r in body["rows"] if r["metrics"][r["primary"]]["spread"] is not None]
    asy = [x for x in (_async_line(r) for r in body["rows"]) if x]
    if asy:
        out += ["", "async saves (s, median [IQR]): blocked = the call; staged = until the snapshot is complete; "
                "total = until committed (barrier to barrier)", *asy]
    out += ["", f"targets (verdict only when the {body['spread']} spreads separate):"]
    out += [_verdict_line(v) for v in body["targets"]] or ["  (none declared)"]
    out += [f"  error: {e[:300]}" for e in body["errors"]]
    return "\n".join(out)
