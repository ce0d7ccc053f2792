"""End to end at scale on this disk: the 8B state, narrow, converted to thousands of ranks.

The 8B job's tensors (1164: 291 parameters, AdamW's two moments and step) with their row
counts, but every matrix cut to ``--cols`` columns (vocab x 8, ...: about 160 MB in fp32), are
saved by one process; ``reshard convert`` rewrites them for ``--mesh`` (default dp=512,tp=8:
4096 ranks) with FSDP2-over-TP placements given as ``--rules`` (the layouts of
``benchmarks/scale/layouts.py``), then ``shardfmt validate`` and ``shardfmt validate --deep``
check the result. Each command runs in its own process under ``/usr/bin/time``: wall and CPU
seconds, peak RSS. Results as JSON under ``--out``, a table printed.

    python -m benchmarks.scale.narrow --work /tmp/narrow              # 4096 ranks
    python -m benchmarks.scale.narrow --work /tmp/narrow --mesh dp=16,tp=8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import shardfmt
from benchmarks.scale.layouts import (
    COLWISE,
    EMBEDDING,
    LLAMA_8B,
    MOMENTS,
    NORM,
    ROWWISE,
    param_fqn,
    state_fqn,
)

RULES = {  # FSDP2 over TP (layouts.placements), as reshard's rules spell them
    COLWISE: {"dp": ["strided_shard", 0, 8], "tp": ["shard", 0]},
    EMBEDDING: {"dp": ["strided_shard", 0, 8], "tp": ["shard", 0]},
    ROWWISE: {"dp": ["shard", 0], "tp": ["shard", 1]},
    NORM: {"dp": ["shard", 0]},
}


def narrow_state(cols: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The 8B's tensors with ``cols`` columns (1-D ones whole), and the rules placing them."""
    g = torch.Generator().manual_seed(0)
    state, rules = {}, []
    for p in LLAMA_8B.params():
        shape = p.shape if len(p.shape) == 1 else (p.shape[0], cols)
        state[param_fqn(p)] = torch.randn(shape, generator=g)
        for k in MOMENTS:
            state[state_fqn(p, k)] = torch.randn(shape, generator=g)
        state[state_fqn(p, "step")] = torch.tensor(10.0)
        names = [param_fqn(p), *(state_fqn(p, k) for k in MOMENTS)]
        rules += [{"match": f"^{n.replace('.', '[.]')}$", "placements": RULES[p.style], "stage": None} for n in names]
    rules.append({"match": "[.]step$", "placements": {}, "stage": None})
    return state, rules


def timed(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` under /usr/bin/time; its wall and CPU seconds and peak RSS."""
    fmt = "%e %U %S %M"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-f", fmt, "-o", str(log) + ".time", *cmd], stdout=f,
                            stderr=subprocess.STDOUT).returncode
    wall, user, sys_s, kib = open(str(log) + ".time").read().split()[-4:]
    return {"cmd": " ".join(cmd), "rc": rc, "wall_s": float(wall), "cpu_s": float(user) + float(sys_s),
            "peak_mib": int(kib) / 1024, "elapsed_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.scale.narrow")
    ap.add_argument("--work", required=True)
    ap.add_argument("--mesh", default="dp=512,tp=8")
    ap.add_argument("--cols", type=int, default=8)
    ap.add_argument("--memory-budget", default="256MiB")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    state, rules = narrow_state(a.cols)
    (work / "rules.json").write_text(json.dumps({"rules": rules}))
    t0 = time.perf_counter()
    shardfmt.save(state, str(work / "src"))
    facts = {"tensors": len(state), "bytes": sum(t.numel() * 4 for t in state.values()), "mesh": a.mesh,
             "save_s": time.perf_counter() - t0}
    del state
    bin_dir = Path(sys.executable).parent
    steps = {
        "convert": [str(bin_dir / "reshard"), "convert", str(work / "src"), str(work / "dst"), "--mesh", a.mesh,
                    "--rules", str(work / "rules.json"), "--memory-budget", a.memory_budget, "--no-progress",
                    "--json"],
        "validate": [str(bin_dir / "shardfmt"), "validate", str(work / "dst")],
        "validate_deep": [str(bin_dir / "shardfmt"), "validate", "--deep", str(work / "dst")],
    }
    results = {}
    for name, cmd in steps.items():
        results[name] = timed(cmd, work / f"{name}.log")
        r = results[name]
        print(f"{name}: rc {r['rc']}, {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, peak {r['peak_mib']:.0f} MiB",
              flush=True)
        if r["rc"]:
            print((work / f"{name}.log").read_text()[-2000:])
            break
    dst = work / "dst"
    if dst.exists():
        facts["dst_files"] = sum(len(fs) for _, _, fs in os.walk(dst))
        facts["dst_bytes"] = sum(os.path.getsize(Path(d) / f) for d, _, fs in os.walk(dst) for f in fs)
        facts["root_bytes"] = os.path.getsize(dst / "manifest.json")
    out = Path(a.out or work / "narrow.json")
    out.write_text(json.dumps({"facts": facts, "results": results}, indent=1))
    print(json.dumps(facts))
    if not a.keep:
        shutil.rmtree(work / "src", ignore_errors=True)
    return 0 if all(r["rc"] == 0 for r in results.values()) else 2


if __name__ == "__main__":
    raise SystemExit(main())
