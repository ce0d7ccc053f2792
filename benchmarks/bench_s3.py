#!/usr/bin/env python
"""Save and load of one sharded state to local disk and to a loopback S3 server: shardfmt vs DCP.

The state (default ~512 MiB, ``--size-mib``): 8 2-D fp32 tensors held as DTensor ``Shard(0)``
(rows) on a 1-D gloo mesh of the saving world (2 ranks), plus two small replicated tensors
(a 0-d plain "step" tensor and a (4096,) DTensor ``Replicate`` "norm"). Every rank builds
its own rows from a closed formula, so any slice can be regenerated to check a load.

The S3 server is ``tests/s3_server.py`` run as a script (moto's server in its own process,
127.0.0.1, a free port), which counts requests and bytes *at the server*: every rank's
traffic, whatever the client thinks it asked for. Workers find it through
``AWS_ENDPOINT_URL`` (+ ``AWS_ACCESS_KEY_ID/SECRET=testing``, region us-east-1), as
tests/test_s3.py does; DCP's s3fs picks the endpoint up from the same variable.

Methods (each on local disk and on S3):
  shardfmt  shardfmt.save / shardfmt.load (S3: streaming multipart uploads, ranged GETs)
  dcp       torch.distributed.checkpoint with its fsspec storage layer:
            dcp.save(storage_writer=FsspecWriter(path)) / dcp.load(storage_reader=FsspecReader(path))
            (torch.distributed.checkpoint._fsspec_filesystem; defaults: one file per rank,
            sync_files=True, s3fs's 50 MiB readahead blocks)

Scenarios (real processes, gloo on 127.0.0.1, one process per rank; see common.launch):
  save@2      the state saved on 2 ranks
  same@2      loaded on 2 ranks into Shard(0) DTensors (same topology)
  row->col@2  loaded on 2 ranks into Shard(1) DTensors (column halves)
  dim0 2->4   loaded on 4 ranks into Shard(0) DTensors of a 4-rank mesh
  2->1        loaded in one process (no process group) into full plain tensors

Every job first saves/loads a small (~17 MiB per rank) warm-up state with every method on
every storage (untimed: imports, S3 clients, thread pools). Per measured call: every rank
passes a barrier, rank 0 resets the server's counters (S3), a barrier, the call, a barrier;
seconds = the largest barrier-to-barrier time over the ranks. Then rank 0 reads the server's
counters (``/__stats``: requests, bytes in/out, requests by HTTP method) for S3; for local
disk the figures are the sums over ranks of /proc/self/io: ``syscr``/``rchar`` (read
syscalls / bytes) for loads, ``syscw``/``wchar`` for saves. Local loads are cold (fsync +
POSIX_FADV_DONTNEED on every file of the checkpoint first). shardfmt's own
LoadReport.bytes_read / read_requests are recorded beside them. Every load is checked
against the formula.

Saves: peak RSS growth per rank (VmRSS — /proc/self/statm's resident field, the same
figure as /proc/self/status's VmRSS — sampled every 2 ms in a thread; baseline just
before the call, after gc + malloc_trim). For shardfmt on S3 it is compared with
2 x S3_PART_SIZE x S3_WRITE_CONCURRENCY (shardfmt.io.fsspec's defaults).

Targets (PASS/MISS):
  dim0 2->4 on S3: bytes at the server, shardfmt / DCP <= 0.6
  every reshard on S3 (row->col@2, dim0 2->4, 2->1): requests shardfmt <= DCP
  save@2 on S3: shardfmt's peak RSS growth (max over ranks) < 2 x part size x concurrency

``--rounds N`` repeats every measurement (methods interleaved, order rotated per round;
medians reported, RSS growth: max). Only figures from the same run compare. The machine is
shared: seconds are noisy; requests and bytes are not. S3 seconds say little about real S3:
moto (5.x) answers a ranged GET by reading the *whole* object (``FakeKey.value``) under the
object's lock, so on this server a GET costs time in proportion to the object's size and
GETs of one object run one at a time.

Usage:  python benchmarks/bench_s3.py [--size-mib 512 | --quick] [--rounds 1] [--json F] [--dir D]
Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid

from common import (
    MIB,
    ROOT,
    WorkerCtx,
    code_fingerprint,
    drop_cache,
    launch,
    malloc_trim,
    proc_io,
    rotate,
    run_worker,
)

COMBOS = (("local", "shardfmt"), ("local", "dcp"), ("s3", "shardfmt"), ("s3", "dcp"))
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
RESHARDS = ("row->col@2", "dim0 2->4", "2->1")
NORM_N = 4096
STEP_VALUE = 1234.0
WARM_ROWS_PER_RANK = 17 * 256  # x 4096 cols x 4 B = 17 MiB per saving rank: above one 16 MiB part
WARM_COLS = 4096

# ----------------------------------------------------------------------------- the loopback S3 server


class S3Server:
    """tests/s3_server.py as a subprocess: its endpoint and its counters (HTTP only)."""

    def __init__(self, timeout: float = 60.0) -> None:
        script = os.path.join(ROOT, "tests", "s3_server.py")
        self.proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=ROOT)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"the S3 server did not start: {line!r}")
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                server_stats(self.endpoint)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def server_stats(endpoint: str) -> dict:
    with urllib.request.urlopen(endpoint + "/__stats", timeout=30) as r:
        return json.loads(r.read())


def server_reset(endpoint: str) -> None:
    urllib.request.urlopen(urllib.request.Request(endpoint + "/__stats/reset", method="POST"), timeout=30).read()


# ----------------------------------------------------------------------------- the state


def make_spec(size_mib: int, n: int = 8) -> list[tuple[str, int, int]]:
    """[(fqn, rows, cols)]: ``n`` fp32 2-D tensors of ~size_mib/n MiB; rows divide by 4, cols by 2."""
    per = size_mib * MIB // n
    spec = []
    for i in range(n):
        cols = (1024, 2048, 4096, 1536)[i % 4]
        rows = max(64, per // (cols * 4) // 64 * 64)
        kind = ("weight", "exp_avg", "exp_avg_sq", "grad")[i % 4]
        spec.append((f"layers.{i // 4}.block{i % 4}.{kind}", rows, cols))
    return spec


def spec_bytes(spec) -> int:
    return sum(r * c * 4 for _, r, c in spec)


def gen(tid: int, r0: int, r1: int, c0: int, c1: int):
    """Element (i, j) of tensor ``tid`` = fl(fl(fl(i*a) + fl(j*b)) + tid/2): the same bits for any slice."""
    import torch

    rows = torch.arange(r0, r1, dtype=torch.float32).unsqueeze(1) * 0.0009765
    cols = torch.arange(c0, c1, dtype=torch.float32).unsqueeze(0) * 1.7071
    out = rows + cols
    out.add_(float(tid) * 0.5)
    return out


def norm_values():
    import torch

    return torch.linspace(0.0, 1.0, NORM_N)


class Layout:
    """Where this rank's piece of every big tensor lies: rows [r0, r1) x cols [c0, c1)."""

    def __init__(self, kind: str, world: int, rank: int) -> None:
        self.kind, self.world, self.rank = kind, world, rank  # kind: "rows", "cols" or "full"

    def box(self, r: int, c: int) -> tuple[int, int, int, int]:
        W, q = self.world, self.rank
        if self.kind == "rows":
            return q * r // W, (q + 1) * r // W, 0, c
        if self.kind == "cols":
            return 0, r, q * c // W, (q + 1) * c // W
        return 0, r, 0, c


def build_state(spec, layout: Layout, mesh, *, zero: bool, prefix: str = "") -> tuple[dict, list]:
    """(state dict, [local tensors of the big ones]) for ``layout`` on ``mesh`` (None: plain tensors)."""
    import torch

    state, locals_ = {}, []
    for i, (fqn, r, c) in enumerate(spec):
        r0, r1, c0, c1 = layout.box(r, c)
        t = torch.zeros(r1 - r0, c1 - c0) if zero else gen(i, r0, r1, c0, c1)
        locals_.append(t)
        if mesh is None:
            state[prefix + fqn] = t
        else:
            from torch.distributed.tensor import DTensor, Shard

            place = Shard(0) if layout.kind == "rows" else Shard(1)
            state[prefix + fqn] = DTensor.from_local(t, mesh, [place], run_check=False, shape=torch.Size((r, c)),
                                                     stride=(c, 1))
    norm = torch.zeros(NORM_N) if zero else norm_values()
    if mesh is None:
        state[prefix + "model.norm"] = norm
    else:
        from torch.distributed.tensor import DTensor, Replicate

        state[prefix + "model.norm"] = DTensor.from_local(norm, mesh, [Replicate()], run_check=False)
    state[prefix + "step"] = torch.tensor(0.0 if zero else STEP_VALUE)
    return state, locals_


def zero_state(state: dict) -> None:
    import torch

    with torch.no_grad():
        for v in state.values():
            (v.to_local() if hasattr(v, "to_local") else v).zero_()


def check_state(spec, layout: Layout, state: dict, locals_, what: str, prefix: str = "") -> None:
    import torch

    for i, ((_, r, c), t) in enumerate(zip(spec, locals_)):
        if not torch.equal(t, gen(i, *layout.box(r, c))):
            raise AssertionError(f"{what}: tensor {i} differs from the saved data")
    norm = state[prefix + "model.norm"]
    norm = norm.to_local() if hasattr(norm, "to_local") else norm
    if not torch.equal(norm, norm_values()) or float(state[prefix + "step"]) != STEP_VALUE:
        raise AssertionError(f"{what}: the replicated tensors differ from the saved data")


# ----------------------------------------------------------------------------- the methods (worker side)


def do_save(method: str, state: dict, path: str) -> dict:
    if method == "shardfmt":
        import shardfmt

        shardfmt.save(state, path, timeout=dt.timedelta(minutes=15))
        return {}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(state, storage_writer=FsspecWriter(path))
    return {}


def do_load(method: str, state: dict, path: str, *, no_dist: bool) -> dict:
    if method == "shardfmt":
        import shardfmt

        rep = shardfmt.load(state, path)
        return {"sf_bytes_read": rep.bytes_read, "sf_read_requests": rep.read_requests,
                "sf_bytes_needed": rep.bytes_needed}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dcp.load(state, storage_reader=FsspecReader(path), no_dist=no_dist)
    return {}


def ckpt_path(args: dict, storage: str, method: str, name: str) -> str:
    if storage == "s3":
        return f"{args['s3_base']}/{name}/{method}"
    return os.path.join(args["local_base"], name, method)


# ----------------------------------------------------------------------------- worker


class Ctx(WorkerCtx):
    def __init__(self, rank: int, world: int, args: dict, distributed: bool) -> None:
        super().__init__(rank, world, args, distributed)
        self.endpoint = args["endpoint"]

    def measure(self, scenario: str, storage: str, method: str, rnd: int, fn, *, kind: str,
                cold: str | None = None) -> dict:
        """Run ``fn`` on every rank between barriers; server counters around it on S3 (rank 0)."""
        if cold and storage == "local":
            drop_cache(cold)
        gc.collect()
        malloc_trim()
        self.barrier()
        if storage == "s3" and self.rank == 0:
            server_reset(self.endpoint)
        self.barrier()
        gc.disable()
        io0 = proc_io()
        before = self.sampler.start() if kind == "save" else 0
        t0 = time.perf_counter()
        error = None
        extra: dict = {}
        try:
            extra = fn() or {}
        except Exception as e:  # noqa: BLE001 - DCP may not work on S3: reported, the run goes on
            if method != "dcp":
                raise
            error = f"{type(e).__name__}: {e}"
            print(f"[{self.label}] rank {self.rank}: {scenario} {storage} dcp FAILED:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
        finally:
            t_local = time.perf_counter() - t0
            peak = self.sampler.stop() if kind == "save" else 0
            io1 = proc_io()
            gc.enable()
        self.barrier()
        t_wall = time.perf_counter() - t0
        rec = {"scenario": scenario, "storage": storage, "method": method, "round": rnd, "kind": kind,
               "rank": self.rank, "world": self.world, "wall_s": t_wall, "local_s": t_local,
               "rss_before": before, "rss_peak": peak, "rss_growth": peak - before,
               "rss_samples": self.sampler.samples if kind == "save" else 0, "error": error,
               **{k: io1[k] - io0[k] for k in ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")},
               **extra}
        if storage == "s3" and self.rank == 0:
            rec["server"] = server_stats(self.endpoint)
        if rnd >= 0:
            self.records.append(rec)
        srv = rec.get("server")
        io = (f"server {srv['requests']} req {(srv['bytes_in'] + srv['bytes_out']) / MIB:8.1f} MiB "
              f"{srv['by_method']}" if srv else
              f"rank0 {rec['syscr'] if kind == 'load' else rec['syscw']} syscalls "
              f"{(rec['rchar'] if kind == 'load' else rec['wchar']) / MIB:8.1f} MiB")
        self.say(f"{scenario:<11} {storage:<5} {method:<8} {t_wall:7.3f}s  {io}"
                 + (f"  rank0 rss +{rec['rss_growth'] / MIB:.1f} MiB" if kind == "save" else "")
                 + (f"  ERROR {error}" if error else "") + ("  (warm-up)" if rnd < 0 else ""))
        return rec


def warm_spec() -> list[tuple[str, int, int]]:
    return [("warm.w", 2 * WARM_ROWS_PER_RANK, WARM_COLS)]


def warm_up(ctx: Ctx, mesh, layout: Layout, *, save: bool) -> None:
    """Untimed small save (saving job) and load with every method on every storage."""
    spec = warm_spec()
    if save:
        state, _ = build_state(spec, layout, mesh, zero=False)
        for storage, method in COMBOS:
            ctx.measure("warm-save", storage, method, -1,
                        lambda s=storage, m=method: do_save(m, state, ckpt_path(ctx.args, s, m, "warm")), kind="save")
    state, locals_ = build_state(spec, layout, mesh, zero=True)
    for storage, method in COMBOS:
        zero_state(state)
        ctx.measure("warm-load", storage, method, -1,
                    lambda s=storage, m=method: do_load(m, state, ckpt_path(ctx.args, s, m, "warm"),
                                                        no_dist=not ctx.distributed), kind="load")


def run_loads(ctx: Ctx, scenario: str, spec, layout: Layout, mesh, src: str, skip: set) -> None:
    state, locals_ = build_state(spec, layout, mesh, zero=True)
    for rnd in range(ctx.args["rounds"]):
        for storage, method in rotate(COMBOS, rnd):
            if (storage, method) in skip:
                continue
            zero_state(state)
            path = ckpt_path(ctx.args, storage, method, src)
            rec = ctx.measure(scenario, storage, method, rnd,
                              lambda s=storage, m=method, p=path: do_load(m, state, p, no_dist=not ctx.distributed),
                              kind="load", cold=path)
            if rec["error"] is None:
                check_state(spec, layout, state, locals_, f"{scenario} {storage} {method}")


def job_main(ctx: Ctx) -> None:
    """Save on 2 ranks; same-topology and row->col loads on the same 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    a = ctx.args
    W, rank = ctx.world, ctx.rank
    spec = make_spec(a["size_mib"])
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp",))
    rows = Layout("rows", W, rank)
    warm_up(ctx, mesh, rows, save=True)
    t0 = time.perf_counter()
    state, _ = build_state(spec, rows, mesh, zero=False)
    ctx.say(f"state: {len(spec)} big tensors, {spec_bytes(spec) / MIB:.0f} MiB, built in {time.perf_counter() - t0:.1f}s")
    broken: set = set()
    for rnd in range(a["rounds"]):
        for storage, method in rotate(COMBOS, rnd):
            name = f"save{rnd}"
            rec = ctx.measure("save@2", storage, method, rnd,
                              lambda s=storage, m=method, n=name: do_save(m, state, ckpt_path(a, s, m, n)),
                              kind="save")
            if rec["error"]:
                broken.add((storage, method))
    src = f"save{a['rounds'] - 1}"
    state = None  # free the saved state before the loads
    gc.collect()
    malloc_trim()
    if rank == 0:
        ctx.records.append({"kind": "meta", "broken": sorted(f"{s}/{m}" for s, m in broken), "src": src})
    run_loads(ctx, "same@2", spec, rows, mesh, src, broken)
    run_loads(ctx, "row->col@2", spec, Layout("cols", W, rank), mesh, src, broken)


def job_load(ctx: Ctx) -> None:
    """Load the 2-rank checkpoints on this job's world: Shard(0) DTensors, or full tensors in one process."""
    a = ctx.args
    spec = make_spec(a["size_mib"])
    if ctx.distributed:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ctx.world,), mesh_dim_names=("dp",))
        layout = Layout("rows", ctx.world, ctx.rank)
    else:
        mesh, layout = None, Layout("full", 1, 0)
    broken = {tuple(x.split("/")) for x in a["broken"]}
    warm_up(ctx, mesh, layout, save=False)
    run_loads(ctx, a["scenario"], spec, layout, mesh, a["src"], broken)


JOBS = {"main": job_main, "load": job_load}


def worker_main(argv: list[str]) -> None:
    run_worker(argv, JOBS, Ctx)


# ----------------------------------------------------------------------------- driver


def med(xs):
    return statistics.median(xs) if xs else None


def summarize(records: list[dict]) -> list[dict]:
    runs = [r for r in records if r.get("kind") in ("save", "load")]
    keys: list[tuple] = []
    for r in runs:
        k = (r["scenario"], r["storage"], r["method"])
        if k not in keys:
            keys.append(k)
    rows = []
    for sc, storage, method in keys:
        rs = [r for r in runs if (r["scenario"], r["storage"], r["method"]) == (sc, storage, method)]
        kind = rs[0]["kind"]
        rounds = sorted({r["round"] for r in rs})
        errors = sorted({r["error"] for r in rs if r["error"]})
        seconds = [max(r["wall_s"] for r in rs if r["round"] == k) for k in rounds]
        row = {"scenario": sc, "storage": storage, "method": method, "kind": kind, "ranks": rs[0]["world"],
               "seconds": med(seconds), "all_seconds": seconds, "errors": errors}
        if storage == "s3":
            srv = [r["server"] for r in rs if "server" in r]
            row["requests"] = med([s["requests"] for s in srv])
            row["bytes_in"] = med([s["bytes_in"] for s in srv])
            row["bytes_out"] = med([s["bytes_out"] for s in srv])
            row["bytes"] = med([s["bytes_in"] + s["bytes_out"] for s in srv])
            methods = sorted({m for s in srv for m in s["by_method"]})
            row["by_method"] = {m: med([s["by_method"].get(m, 0) for s in srv]) for m in methods}
        else:
            sys_key, byte_key = ("syscr", "rchar") if kind == "load" else ("syscw", "wchar")
            per_round = [[r for r in rs if r["round"] == k] for k in rounds]
            row["requests"] = med([sum(r[sys_key] for r in rr) for rr in per_round])
            row["bytes"] = med([sum(r[byte_key] for r in rr) for rr in per_round])
            row["disk_bytes"] = med([sum(r["read_bytes" if kind == "load" else "write_bytes"] for r in rr)
                                     for rr in per_round])
        if kind == "save":
            row["rss_growth_max"] = max(r["rss_growth"] for r in rs)
            row["rss_growth_per_rank"] = {str(q): max(r["rss_growth"] for r in rs if r["rank"] == q)
                                          for q in sorted({r["rank"] for r in rs})}
        if method == "shardfmt" and kind == "load":
            per_round = [[r for r in rs if r["round"] == k] for k in rounds]
            row["sf_bytes_read"] = med([sum(r["sf_bytes_read"] for r in rr) for rr in per_round])
            row["sf_read_requests"] = med([sum(r["sf_read_requests"] for r in rr) for rr in per_round])
            row["sf_bytes_needed"] = med([sum(r["sf_bytes_needed"] for r in rr) for rr in per_round])
        rows.append(row)
    return rows


def find(rows, sc, storage, method):
    for r in rows:
        if (r["scenario"], r["storage"], r["method"]) == (sc, storage, method) and not r["errors"]:
            return r
    return None


def targets_of(rows, rss_bound: int) -> list[dict]:
    out = []

    def add(name, value, op, th, shown, detail=""):
        ok = value <= th if op == "<=" else value < th
        out.append({"target": name, "value": value, "op": op, "threshold": th, "pass": ok, "shown": shown,
                    "detail": detail})

    def missing(name, why):
        out.append({"target": name, "value": None, "op": None, "threshold": None, "pass": False,
                    "shown": "n/a", "detail": why})

    s, d = find(rows, "dim0 2->4", "s3", "shardfmt"), find(rows, "dim0 2->4", "s3", "dcp")
    name = "dim0 2->4 on S3: bytes at the server, shardfmt / DCP <= 0.6"
    if s and d:
        add(name, s["bytes"] / d["bytes"], "<=", 0.6, f"{s['bytes'] / d['bytes']:.3f}x",
            f"{s['bytes'] / MIB:.1f} / {d['bytes'] / MIB:.1f} MiB")
    else:
        missing(name, "no figure for one of the methods (see errors)")
    for sc in RESHARDS:
        s, d = find(rows, sc, "s3", "shardfmt"), find(rows, sc, "s3", "dcp")
        name = f"{sc} on S3: requests shardfmt <= DCP"
        if s and d:
            add(name, s["requests"], "<=", d["requests"], f"{s['requests']:g} vs {d['requests']:g}",
                f"shardfmt {s['by_method']}; DCP {d['by_method']}")
        else:
            missing(name, "no figure for one of the methods (see errors)")
    s = find(rows, "save@2", "s3", "shardfmt")
    name = f"save@2 on S3: shardfmt peak RSS growth (max over ranks) < {rss_bound / MIB:.0f} MiB"
    if s:
        add(name, s["rss_growth_max"], "<", rss_bound, f"{s['rss_growth_max'] / MIB:.1f} MiB",
            "per rank " + ", ".join(f"r{q} {v / MIB:.1f}" for q, v in s["rss_growth_per_rank"].items()) + " MiB")
    else:
        missing(name, "no figure")
    return out


def fmt_mib(n) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def print_report(rows, targets, meta) -> None:
    print()
    print(f"state: {meta['tensors']} fp32 tensors Shard(0) on 2 ranks + 2 small replicated, "
          f"{meta['state_bytes'] / MIB:.1f} MiB; {meta['rounds']} round(s), median shown")
    print("seconds: max over ranks, barrier to barrier. S3: requests / bytes (in + out) counted at the server, "
          "all ranks; local: sums over ranks of read (loads) or write (saves) syscalls / bytes (/proc/self/io)")
    print("S3 seconds: moto reads the whole object for every ranged GET, one GET per object at a time: "
          "they grow with GETs x object size, not with bytes transferred")
    print("sf: shardfmt's LoadReport (sum over ranks: read requests / bytes read / bytes needed; excludes "
          "opening the checkpoint). RSS+: saves, max over ranks of peak VmRSS growth")
    hdr = (f"{'scenario':<11} {'storage':<7} {'method':<8} {'ranks':>5} {'seconds':>8} {'requests':>9} "
           f"{'MiB':>9} {'RSS+ MiB':>9} {'sf req':>7} {'sf MiB':>8} {'needed':>8}  by method (S3) / runs (s)")
    print(hdr)
    print("-" * (len(hdr) + 30))
    for r in rows:
        if r["errors"]:
            print(f"{r['scenario']:<11} {r['storage']:<7} {r['method']:<8} {r['ranks']:>5}  ERROR: {r['errors'][0]}")
            continue
        bm = json.dumps(r["by_method"], separators=(",", ":")) if "by_method" in r else ""
        print(f"{r['scenario']:<11} {r['storage']:<7} {r['method']:<8} {r['ranks']:>5} {r['seconds']:8.3f} "
              f"{r['requests']:>9g} {fmt_mib(r['bytes']):>9} {fmt_mib(r.get('rss_growth_max')):>9} "
              f"{r['sf_read_requests'] if 'sf_read_requests' in r else '-':>7} {fmt_mib(r.get('sf_bytes_read')):>8} "
              f"{fmt_mib(r.get('sf_bytes_needed')):>8}  {bm} "
              f"[{' '.join(f'{s:.2f}' for s in r['all_seconds'])}]")
    print()
    print("ratios shardfmt / DCP (seconds, requests, bytes):")
    seen = []
    for r in rows:
        k = (r["scenario"], r["storage"])
        if k in seen:
            continue
        seen.append(k)
        s, d = find(rows, *k, "shardfmt"), find(rows, *k, "dcp")
        if s and d:
            print(f"  {k[0]:<11} {k[1]:<6} time {s['seconds'] / d['seconds']:6.3f}x  requests "
                  f"{s['requests'] / max(d['requests'], 1):6.3f}x  bytes {s['bytes'] / max(d['bytes'], 1):6.3f}x")
    print()
    for t in targets:
        print(f"  {'PASS' if t['pass'] else 'MISS'}  {t['target']:<74} measured {t['shown']}"
              + (f"  ({t['detail']})" if t["detail"] else ""))


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, ROOT)
        worker_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512, help="total state size in MiB (default 512; rounded)")
    p.add_argument("--quick", action="store_true", help="a ~64 MiB smoke run")
    p.add_argument("--rounds", type=int, default=1, help="measurements of every method (default 1)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp, removed after)")
    p.add_argument("--json", default=None, help="write every record, the summary and the targets to this file")
    p.add_argument("--job-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    size = 64 if args.quick else args.size_mib
    from shardfmt.io.fsspec import S3_PART_SIZE, S3_WRITE_CONCURRENCY

    rss_bound = 2 * S3_PART_SIZE * S3_WRITE_CONCURRENCY
    scratch = args.dir or tempfile.mkdtemp(prefix="shardfmt-s3bench-", dir="/tmp")
    own = args.dir is None
    os.makedirs(scratch, exist_ok=True)
    spec = make_spec(size)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    code0 = code_fingerprint()
    print(f"state: {len(spec)} fp32 tensors, {spec_bytes(spec) / MIB:.1f} MiB; rounds {args.rounds}; "
          f"scratch {scratch}", flush=True)
    server = S3Server()
    records: list[dict] = []
    old_env = {k: os.environ.get(k) for k in list(CREDS) + ["AWS_ENDPOINT_URL"]}
    try:
        os.environ.update(CREDS, AWS_ENDPOINT_URL=server.endpoint)  # the workers inherit these
        import s3fs

        bucket = "bench-" + uuid.uuid4().hex[:10]
        s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True).mkdir(bucket)
        print(f"S3 server {server.endpoint} (pid {server.proc.pid}), bucket {bucket}", flush=True)
        common = {"size_mib": size, "rounds": args.rounds, "endpoint": server.endpoint,
                  "s3_base": f"s3://{bucket}/ck", "local_base": os.path.join(scratch, "ck")}
        logs = os.path.join(scratch, "logs")
        records += launch(__file__, "main", 2, dict(common, label="save+load@2"), os.path.join(logs, "main"),
                          args.job_timeout)
        meta_rec = next(r for r in records if r.get("kind") == "meta")
        for world, sc in ((4, "dim0 2->4"), (1, "2->1")):
            records += launch(__file__, "load", world,
                              dict(common, label=sc, scenario=sc, src=meta_rec["src"], broken=meta_rec["broken"]),
                              os.path.join(logs, sc.replace(" ", "_").replace(">", "")), args.job_timeout)
        final_stats = server_stats(server.endpoint)
    finally:
        server.stop()
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if own:
            shutil.rmtree(scratch, ignore_errors=True)
    code1 = code_fingerprint()
    rows = summarize(records)
    targets = targets_of(rows, rss_bound)
    meta = {"state_bytes": spec_bytes(spec) + NORM_N * 4 + 4, "tensors": len(spec), "rounds": args.rounds,
            "size_mib": size, "rss_bound": rss_bound, "part_size": S3_PART_SIZE,
            "write_concurrency": S3_WRITE_CONCURRENCY, "code_before": code0, "code_after": code1,
            "server_totals_since_last_reset": final_stats}
    print_report(rows, targets, meta)
    if args.quick:
        print("  (--quick: 2 MiB row ranges sit closer than a chunk-rounded read's gap limit, so shardfmt reads "
              "whole files; the byte and request targets mean something at the default size)")
    wall = time.perf_counter() - t0
    if code1 != code0:
        print(f"\nWARNING: shardfmt/reshard sources changed during the run ({code0} -> {code1})")
    print(f"\nwall {wall:.0f}s; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          "(the machine is shared: a high value means noisy seconds)")
    if args.json:
        import torch

        import shardfmt

        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records, "summary": rows, "targets": targets, "wall_s": wall,
                       "env": {"python": platform.python_version(), "torch": torch.__version__,
                               "shardfmt": getattr(shardfmt, "__version__", "?"), "s3fs": s3fs.__version__,
                               "cpus": os.cpu_count(), "argv": sys.argv[1:]}}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(t["pass"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
