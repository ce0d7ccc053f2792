#!/usr/bin/env python
"""Save/load throughput and memory of shardfmt against torch, safetensors and raw-I/O floors.

Single process, one deterministic state dict (~1 GiB by default: a few dozen tensors of
varying sizes, about half the bytes fp32 and half bf16). Within one run, every repeat
goes round-robin over the methods (the starting method rotates with the repeat), and the
median over the repeats is reported. Only ratios measured in the same run are meaningful
on a shared machine.

Save methods (every one ends with the bytes durable: fsync):
  shardfmt      shardfmt.save(state, path)                       (fsync is shardfmt's default)
  torch.save    torch.save(state, f); f.flush(); os.fsync(f)
  safetensors   safetensors.torch.save_file(state, path); fsync of the file
  floor         raw os.write of the same tensor bytes in 8 MiB pieces + xxh3-128 per
                1 MiB chunk of each piece + fsync (the cheapest a hashed, durable write can be)

Load methods, warm (page cache) and cold (fsync + POSIX_FADV_DONTNEED on every file of
the checkpoint before the load). Every method ends with the data in the *same
preallocated target tensors*, so the times compare like with like:
  shardfmt      shardfmt.load(targets, path)                     (verify=True, the default)
  torch.load    torch.load(path, weights_only=True) then copy_ into the targets;
                the time without the copy is reported too ("torch.load (no copy)")
  safetensors   safetensors.torch.load_file(path) then copy_ into the targets;
                the time without the copy is reported too ("safetensors (no copy)"; with
                safetensors 0.8 load_file hands back mmap-backed tensors, so the bytes are
                actually read during the copy: only the "+copy" row compares like with like)
  floor         os.preadv of the same bytes straight into the targets in 8 MiB pieces
                + xxh3-128 per 1 MiB chunk over them (single thread)
  floor-2threads  the same, 8 MiB pieces spread over 2 threads (informational: shardfmt reads
                with a thread pool, so this is the stricter bar on a 2-core machine; the
                targets are still judged against the single-thread floor)

Peak RSS growth: a background thread samples /proc/self/statm every ~2 ms during every
timed call; reported as (peak - rss_before) / state bytes. (Not ru_maxrss.) malloc_trim
runs before each call so the baseline is honest.

Columns: "x floor" = floor median / method median (throughput ratio; what the targets are
judged on); "best" = floor min / method min and "paired" = median over repeats of
floor_i / method_i (same round) are informational and less sensitive to a noisy neighbour.
The load average before/after is printed: a high value means the figures are noisy.

Targets (from the issue): save >= 0.9x the write floor's throughput, load >= 0.9x the read
floor's throughput, peak RSS growth during save < 10% of the state.

Usage:  python benchmarks/bench_save_load.py [--size-mib 1024] [--repeats 3] [--dir D] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import xxhash
from common import (
    MIB,
    PIECE,
    RSSSampler,
    cached_fraction,
    drop_cache,
    fsync_path,
    hash_chunks,
    malloc_trim,
    remove,
)

import shardfmt
from shardfmt.format.tensor_bytes import byte_view

# ----------------------------------------------------------------------------- state


def make_state(size_mib: int, seed: int = 0, n_per_dtype: int = 12) -> dict[str, torch.Tensor]:
    """~size_mib MiB: n_per_dtype fp32 + n_per_dtype bf16 tensors of log-uniform sizes, plus biases."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    budget = size_mib * MIB // 2
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        isz = dtype.itemsize
        w = torch.exp(torch.empty(n_per_dtype).uniform_(0.0, 5.0, generator=g))  # ~1x..150x spread
        w = w / w.sum()
        cols_choices = (1024, 2048, 4096, 768)
        for i in range(n_per_dtype):
            cols = cols_choices[i % len(cols_choices)]
            rows = max(1, int(budget * float(w[i]) / isz / cols))
            t = torch.empty(rows, cols, dtype=torch.float32).normal_(generator=g).to(dtype)
            state[f"layers.{i}.{tag}.weight"] = t
            state[f"layers.{i}.{tag}.bias"] = torch.empty(cols, dtype=torch.float32).normal_(generator=g).to(dtype)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ----------------------------------------------------------------------------- methods


def save_shardfmt(state, path):
    shardfmt.save(state, path)


def save_torch(state, path):
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_safetensors(state, path):
    from safetensors.torch import save_file

    save_file(state, path)
    fsync_path(path)


def save_floor(state, path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in state.values():
            mv = byte_view(t)  # contiguous CPU tensors: no copy
            for pos in range(0, len(mv), PIECE):
                piece = mv[pos : pos + PIECE]
                hash_chunks(piece)
                done = 0
                while done < len(piece):
                    done += os.write(fd, piece[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def load_shardfmt(path, targets, split):
    shardfmt.load(targets, path)


def load_torch(path, targets, split):
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    split["no_copy"] = time.perf_counter() - t0
    for k, t in targets.items():
        t.copy_(loaded[k])
    del loaded


def load_safetensors(path, targets, split):
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    loaded = load_file(path)
    split["no_copy"] = time.perf_counter() - t0
    for k, t in targets.items():
        t.copy_(loaded[k])
    del loaded


def load_floor(path, targets, split):
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        for t in targets.values():
            mv = byte_view(t)
            for pos in range(0, len(mv), PIECE):
                piece = mv[pos : pos + PIECE]
                got = 0
                while got < len(piece):
                    n = os.preadv(fd, [piece[got:]], off + got)
                    if n == 0:
                        raise EOFError(path)
                    got += n
                off += len(piece)
                hash_chunks(piece)
    finally:
        os.close(fd)


def load_floor_threaded(path, targets, split, workers: int = 2):
    """The read floor spread over ``workers`` threads (8 MiB pieces round-robin): informational only."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    off = 0
    for t in targets.values():
        mv = byte_view(t)
        for pos in range(0, len(mv), PIECE):
            piece = mv[pos : pos + PIECE]
            jobs.append((off, piece))
            off += len(piece)
    fd = os.open(path, os.O_RDONLY)

    def one(job):
        o, piece = job
        got = 0
        while got < len(piece):
            n = os.preadv(fd, [piece[got:]], o + got)
            if n == 0:
                raise EOFError(path)
            got += n
        hash_chunks(piece)

    try:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            list(ex.map(one, jobs))
    finally:
        os.close(fd)


SAVES: dict[str, Callable] = {
    "shardfmt": save_shardfmt,
    "torch.save": save_torch,
    "safetensors": save_safetensors,
    "floor": save_floor,
}
LOADS: dict[str, Callable] = {
    "shardfmt": load_shardfmt,
    "torch.load": load_torch,
    "safetensors": load_safetensors,
    "floor": load_floor,
    "floor-2threads": load_floor_threaded,
}
SUFFIX = {"shardfmt": ".ckpt", "torch.save": ".pt", "torch.load": ".pt", "safetensors": ".safetensors",
          "floor": ".bin", "floor-2threads": ".bin"}


# ----------------------------------------------------------------------------- harness


def timed(sampler: RSSSampler, fn: Callable, *args) -> dict:
    gc.collect()
    malloc_trim()
    gc_was = gc.isenabled()
    gc.disable()
    before = sampler.start()
    t0 = time.perf_counter()
    try:
        fn(*args)
        dt = time.perf_counter() - t0
    finally:
        peak = sampler.stop()
        if gc_was:
            gc.enable()
    return {"seconds": dt, "rss_before": before, "rss_peak": peak, "rss_growth": peak - before,
            "rss_samples": sampler.samples}


def rotate(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def check_targets(state, targets, what: str) -> None:
    for k, t in state.items():
        if not torch.equal(t, targets[k]):
            raise AssertionError(f"{what}: loaded tensor {k} differs from the saved one")


def run(args) -> dict:
    scratch = args.dir or tempfile.mkdtemp(prefix="shardfmt-bench-", dir="/tmp")
    os.makedirs(scratch, exist_ok=True)
    own_scratch = args.dir is None
    t_build = time.perf_counter()
    state = make_state(args.size_mib, seed=args.seed)
    nbytes = state_bytes(state)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}  # preallocated and touched
    print(f"state: {len(state)} tensors, {nbytes / MIB:.1f} MiB "
          f"(fp32 {sum(t.nbytes for t in state.values() if t.dtype == torch.float32) / MIB:.1f} MiB, "
          f"bf16 {sum(t.nbytes for t in state.values() if t.dtype == torch.bfloat16) / MIB:.1f} MiB), "
          f"built in {time.perf_counter() - t_build:.1f}s; scratch {scratch}", flush=True)
    sampler = RSSSampler(args.sample_interval)
    res: dict = {"save": {m: [] for m in SAVES}, "load_cold": {m: [] for m in LOADS},
                 "load_warm": {m: [] for m in LOADS}, "cache_after_drop": {m: [] for m in LOADS},
                 "cache_before_warm": {m: [] for m in LOADS}}
    try:
        # ---- save: round-robin per repeat, checkpoint deleted after each call
        names = list(SAVES)
        for rep in range(-args.warmup, args.repeats):
            for m in rotate(names, rep):
                path = os.path.join(scratch, "save" + SUFFIX[m])
                remove(path)
                r = timed(sampler, SAVES[m], state, path)
                remove(path)
                if rep >= 0:
                    res["save"][m].append(r)
                print(f"  save  rep {rep:>2} {m:<12} {r['seconds']:7.3f}s  rss +{r['rss_growth'] / MIB:7.1f} MiB"
                      + ("  (warm-up)" if rep < 0 else ""), flush=True)

        # ---- load: one checkpoint per method, kept for the whole phase
        paths = {}
        for m, s in (("shardfmt", save_shardfmt), ("torch.load", save_torch), ("safetensors", save_safetensors),
                     ("floor", save_floor)):  # floor-2threads reads the floor's file
            paths[m] = os.path.join(scratch, "load" + SUFFIX[m])
            remove(paths[m])
            s(state, paths[m])
        paths["floor-2threads"] = paths["floor"]
        names = list(LOADS)
        for rep in range(-args.warmup, args.repeats):
            order = rotate(names, rep)
            for kind in ("cold", "warm"):
                for m in order:
                    for t in targets.values():
                        t.zero_()
                    if kind == "cold":
                        drop_cache(paths[m])
                        frac = cached_fraction(paths[m])
                    else:
                        frac = cached_fraction(paths[m])
                    split: dict = {}
                    r = timed(sampler, LOADS[m], paths[m], targets, split)
                    r.update(split)
                    check_targets(state, targets, f"{m} {kind} load")
                    if rep >= 0:
                        res[f"load_{kind}"][m].append(r)
                        res["cache_after_drop" if kind == "cold" else "cache_before_warm"][m].append(frac)
                    extra = f"  (load only {split['no_copy']:.3f}s)" if "no_copy" in split else ""
                    print(f"  load  rep {rep:>2} {kind} {m:<12} {r['seconds']:7.3f}s  rss +"
                          f"{r['rss_growth'] / MIB:7.1f} MiB  cached-before {frac:5.1%}{extra}"
                          + ("  (warm-up)" if rep < 0 else ""), flush=True)
        for p in set(paths.values()):
            remove(p)
    finally:
        sampler.close()
        if own_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return {"state_bytes": nbytes, "tensors": len(state), "raw": res}


def summarize(out: dict) -> dict:
    nbytes = out["state_bytes"]
    raw = out["raw"]
    rows = []

    def med(rs, key="seconds"):
        return statistics.median(r[key] for r in rs)

    summary: dict = {}
    for phase, floor_key in (("save", "floor"), ("load_cold", "floor"), ("load_warm", "floor")):
        floor_t = med(raw[phase][floor_key])
        for m, rs in raw[phase].items():
            t = med(rs)
            peak = max(r["rss_growth"] for r in rs)
            row = {"phase": phase, "method": m, "seconds": t, "gbps": nbytes / t / 1e9,
                   "ratio_to_floor": floor_t / t,
                   "ratio_to_floor_best": min(r["seconds"] for r in raw[phase][floor_key]) / min(r["seconds"] for r in rs),
                   "ratio_to_floor_paired": statistics.median(
                       f["seconds"] / r["seconds"] for f, r in zip(raw[phase][floor_key], rs)),
                   "rss_growth_frac_max": peak / nbytes,
                   "rss_growth_frac_median": med(rs, "rss_growth") / nbytes,
                   "all_seconds": [r["seconds"] for r in rs]}
            rows.append(row)
            if "no_copy" in rs[0]:
                tn = statistics.median(r["no_copy"] for r in rs)
                rows.append({"phase": phase, "method": f"{m} (no copy)", "seconds": tn, "gbps": nbytes / tn / 1e9,
                             "ratio_to_floor": floor_t / tn,
                             "ratio_to_floor_best": min(r["seconds"] for r in raw[phase][floor_key])
                             / min(r["no_copy"] for r in rs),
                             "ratio_to_floor_paired": statistics.median(
                                 f["seconds"] / r["no_copy"] for f, r in zip(raw[phase][floor_key], rs)),
                             "rss_growth_frac_max": None,
                             "rss_growth_frac_median": None, "all_seconds": [r["no_copy"] for r in rs]})
    summary["rows"] = rows

    def row(phase, m):
        return next(r for r in rows if r["phase"] == phase and r["method"] == m)

    targets = [
        ("save throughput >= 0.9x write floor", row("save", "shardfmt")["ratio_to_floor"], ">=", 0.9),
        ("cold load throughput >= 0.9x read floor", row("load_cold", "shardfmt")["ratio_to_floor"], ">=", 0.9),
        ("warm load throughput >= 0.9x read floor", row("load_warm", "shardfmt")["ratio_to_floor"], ">=", 0.9),
        ("peak RSS growth during save < 10% of state", row("save", "shardfmt")["rss_growth_frac_max"], "<", 0.10),
    ]
    summary["targets"] = [{"target": n, "value": v, "op": op, "threshold": th,
                           "pass": (v >= th) if op == ">=" else (v < th)} for n, v, op, th in targets]
    summary["info"] = {
        "shardfmt load peak RSS growth (max over repeats, fraction of state)": "{:.1%}".format(
            max(row("load_cold", "shardfmt")["rss_growth_frac_max"], row("load_warm", "shardfmt")["rss_growth_frac_max"])),
    }
    for phase in ("load_cold", "load_warm"):
        if any(r["method"] == "floor-2threads" for r in rows if r["phase"] == phase):
            ratio = row(phase, "floor-2threads")["seconds"] / row(phase, "shardfmt")["seconds"]
            summary["info"][f"{phase}: shardfmt throughput vs the 2-thread read floor"] = f"{ratio:.3f}x"
    return summary


def print_summary(out: dict, summary: dict) -> None:
    nbytes = out["state_bytes"]
    print()
    print(f"state {nbytes / MIB:.1f} MiB in {out['tensors']} tensors; median of {out['repeats']} repeats; "
          "ratio = floor_time / method_time (throughput relative to the floor)")
    print("x floor = floor median / method median (judged); informational, less sensitive to noise: "
          "best = floor min / method min, paired = median over repeats of floor_i / method_i (same round); "
          "peak RSS + = max over repeats of (peak VmRSS - VmRSS before) / state bytes")
    hdr = (f"{'phase':<10} {'method':<26} {'median s':>9} {'GB/s':>7} {'x floor':>8} {'best':>6} {'paired':>6} "
           f"{'peak RSS +':>11}  runs (s)")
    print(hdr)
    print("-" * len(hdr) + "-" * 20)
    for r in summary["rows"]:
        rss = "" if r["rss_growth_frac_max"] is None else f"{r['rss_growth_frac_max']:.1%}"
        print(f"{r['phase']:<10} {r['method']:<26} {r['seconds']:9.3f} {r['gbps']:7.3f} {r['ratio_to_floor']:8.3f} {r['ratio_to_floor_best']:6.3f} {r['ratio_to_floor_paired']:6.3f} "
              f"{rss:>11}  {' '.join(f'{s:.3f}' for s in r['all_seconds'])}")
    print()
    for t in summary["targets"]:
        v = t["value"]
        vs = f"{v:.1%}" if "RSS" in t["target"] else f"{v:.3f}x"
        print(f"  {'PASS' if t['pass'] else 'MISS'}  {t['target']:<46} measured {vs}")
    for k, v in summary["info"].items():
        print(f"  info  {k}: {v}")
    raw = out["raw"]
    print("  page cache residency before cold loads (should be ~0%): "
          + ", ".join(f"{m} {max(v):.1%}" for m, v in raw["cache_after_drop"].items()))
    print("  page cache residency before warm loads (should be ~100%): "
          + ", ".join(f"{m} {min(v):.1%}" for m, v in raw["cache_before_warm"].items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds before the repeats (default 1)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp, removed after)")
    p.add_argument("--json", default=None, help="write raw results and the summary to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-interval", type=float, default=0.002, help="RSS sampling interval, seconds")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    out = run(args)
    out["loadavg_before"], out["loadavg_after"] = load_before, os.getloadavg()
    out["repeats"] = args.repeats
    out["warmup"] = args.warmup
    out["wall_seconds"] = time.perf_counter() - t0
    out["env"] = {"python": platform.python_version(), "torch": torch.__version__, "shardfmt": shardfmt.__version__,
                  "xxhash": xxhash.VERSION, "cpus": os.cpu_count(), "platform": platform.platform(),
                  "argv": sys.argv[1:]}
    summary = summarize(out)
    out["summary"] = summary
    print_summary(out, summary)
    print(f"\nwall {out['wall_seconds']:.0f}s; load average before {out['loadavg_before'][0]:.2f}, "
          f"after {out['loadavg_after'][0]:.2f} (the machine is shared: a high value means noisy figures)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
