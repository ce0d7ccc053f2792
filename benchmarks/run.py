#!/usr/bin/env python
"""The benchmarks' one entry point: ``python benchmarks/run.py <scenario> [options]``.

    python benchmarks/run.py --list                      # the scenarios and what they time
    python benchmarks/run.py save-load --size-mib 1024   # 1 process vs torch.save, safetensors, floors
    python benchmarks/run.py ranks-2 --json out.json     # 2 ranks (gloo) vs DCP, same topology + row->col
    python benchmarks/run.py gpu --device cuda           # the state on the GPU (1 rank)
    python benchmarks/run.py async --quick               # smoke test: small state, 2 rounds, no warm-up

Method (benchmarks/README.md): every round runs each candidate and floor of a phase once,
the order rotating; loads start from a cold page cache (fsync + POSIX_FADV_DONTNEED of
every file, on every rank); medians and spreads over the judged rounds; a target gets a
verdict only when the spreads separate. Exit status: 0 no target failed, 1 a target
failed, 2 the run failed.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # measure this checkout, as the workers do, whatever is installed
    sys.path.insert(0, ROOT)

from benchmarks.harness import driver  # noqa: E402
from benchmarks.harness.plan import SETTLE_S, Options  # noqa: E402
from benchmarks.harness.registry import all_scenarios  # noqa: E402
from benchmarks.harness.verdict import SPREADS  # noqa: E402


def list_scenarios() -> str:
    lines = []
    for sc in all_scenarios().values():
        phases = "; ".join(f"{p.name}@{p.world or sc.ranks}: {', '.join(p.candidates)}" for p in sc.phases)
        lines.append(f"{sc.name:<14} {sc.doc}\n{'':<14} [{sc.state.builder}, {sc.state.size_mib} MiB, "
                     f"{sc.ranks} rank(s)] {phases}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", nargs="?", help="a scenario name (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--size-mib", type=int, default=None, help="the whole state in MiB (default: the scenario's)")
    p.add_argument("--rounds", type=int, default=None, help="judged rounds (default 5; --quick: 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds before them (default 1; --quick: 0)")
    p.add_argument("--quick", action="store_true", help="smoke test: the scenario's small size, 2 rounds, no warm-up")
    p.add_argument("--ranks", type=int, default=None, help="processes of the phases that use the scenario's ranks")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    p.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True, help="durable saves (default on)")
    p.add_argument("--settle", type=float, default=None,
                   help=f"seconds every rank idles before each measured call, so each starts from the same memory "
                        f"state (a VM that hands memory freed 2 s ago back to its host slows the next call's first "
                        f"touches of it; default {SETTLE_S:g}, --quick: 0)")
    p.add_argument("--spread", choices=SPREADS, default="iqr", help="the spread verdicts are judged on (default iqr)")
    p.add_argument("--json", default=None, help="write the report and every record here")
    p.add_argument("--dir", default=None, help="scratch parent directory (default: the temp dir, unless tmpfs)")
    p.add_argument("--job-timeout", type=float, default=7200.0, help="seconds before a job's ranks are killed")
    a = p.parse_args(argv)
    if a.list:
        print(list_scenarios())
        return 0
    scenarios = all_scenarios()
    if a.scenario not in scenarios:
        p.error(f"unknown scenario {a.scenario!r}; known: {', '.join(scenarios)}")
    sc = scenarios[a.scenario]
    rounds = a.rounds or (2 if a.quick else 5)
    warmup = a.warmup if a.warmup is not None else (0 if a.quick else 1)
    settle = a.settle if a.settle is not None else (0.0 if a.quick else SETTLE_S)
    if rounds < 1 or warmup < 0 or settle < 0 or (a.ranks is not None and a.ranks < 1):
        p.error("--rounds and --ranks must be >= 1, --warmup and --settle >= 0")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"--device cuda: no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}); "
                  "run on a machine with a GPU or use --device cpu", file=sys.stderr)
            return 2
    size = a.size_mib or (sc.state.quick_mib if a.quick else sc.state.size_mib)
    opts = Options(size_mib=size, rounds=rounds, warmup=warmup, device=a.device, fsync=a.fsync, ranks=a.ranks,
                   settle=settle)
    return driver.run(sc, opts, json_out=a.json, scratch_dir=a.dir, spread=a.spread, timeout=a.job_timeout)


if __name__ == "__main__":
    sys.exit(main())
