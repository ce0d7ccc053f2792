"""Compare two reports of one scenario: ``python -m benchmarks.harness.compare BEFORE.json AFTER.json``.

Seconds from two runs are not comparable on a shared machine (the disk and the neighbours
change between them); a candidate's ratio to the floor measured in the same round is. So
for every (phase, candidate) that has a floor in its phase, each run gives the per-round
ratios ``floor time / candidate time`` (throughput relative to the floor); the two runs'
spreads are compared: "better" or "worse" only when they separate, otherwise "same within
the spread". The spread is the whole range by default, not the IQR a single run's targets
use: between two runs the floor itself moves (buffered floors and direct-I/O candidates
answer differently to what the machine does meanwhile), and on 2026-12-01 two runs of the
same code had disjoint IQRs in 3 of 9 rows of ``save-load`` and disjoint ranges in none.
Exit status 1 when anything is worse, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys

from .report import FLOORS
from .verdict import SPREADS, Spread, summarize


def floor_ratios(rep: dict) -> dict[tuple[str, str], list[float]]:
    """(phase, candidate) -> per-round floor/candidate time ratios of one report."""
    rows = {(r["phase"], r["candidate"]): r for r in rep["rows"]}
    out = {}
    for (phase, cand), r in rows.items():
        floor = next((rows[(phase, f)] for f in FLOORS if (phase, f) in rows), None)
        if floor is None or floor is r or r["primary"] != "seconds":
            continue
        mine, fl = r["metrics"]["seconds"]["rounds"], floor["metrics"]["seconds"]["rounds"]
        ratios = [fl[k] / mine[k] for k in mine if int(k) >= 1 and k in fl and mine[k] > 0]
        if ratios:
            out[(phase, cand)] = ratios
    return out


def compare(before: dict, after: dict, *, spread: str = "range") -> list[dict]:
    a, b = floor_ratios(before), floor_ratios(after)
    out = []
    for key in [k for k in a if k in b]:
        sa, sb = summarize(a[key]), summarize(b[key])
        (alo, ahi), (blo, bhi) = sa.interval(spread), sb.interval(spread)
        outcome = "better" if blo > ahi else "worse" if bhi < alo else "same within the spread"
        out.append({"phase": key[0], "candidate": key[1], "before": sa.to_json(), "after": sb.to_json(),
                    "outcome": outcome})
    return out


def _cell(s: Spread | dict) -> str:
    return f"{s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--spread", choices=SPREADS, default="range")
    a = p.parse_args(argv)
    with open(a.before) as f:
        before = json.load(f)
    with open(a.after) as f:
        after = json.load(f)
    rows = compare(before, after, spread=a.spread)
    print(f"x floor (floor time / time, per round), median [IQR], judged on the {a.spread}: "
          f"{before['meta']['commit']} -> {after['meta']['commit']}")
    for r in rows:
        print(f"{r['phase']:<10}{r['candidate']:<26}{_cell(r['before']):>24}  ->{_cell(r['after']):>24}  "
              f"{r['outcome']}")
    return 1 if any(r["outcome"] == "worse" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
