#!/usr/bin/env python
"""Multi-process (gloo) save/load of one sharded state: shardfmt vs torch.distributed.checkpoint.

The state: fp32 "weights + Adam state" of a small transformer (6 layers x {qkv, out, up, down}
x {weight, exp_avg, exp_avg_sq} = 72 2-D tensors, ~1.5 GB by default), each a DTensor
``Shard(0)`` (rows) on a 1-D DeviceMesh. Every rank builds its own rows locally from a
closed formula (``DTensor.from_local``): nothing is scattered through gloo, and any slice
of any tensor can be regenerated to check a load.

Jobs (one process per rank, ``init_process_group("gloo", tcp://127.0.0.1:PORT)``, like
tests/distributed/harness.py). Every job interleaves its methods (the starting method
rotates with the repeat) and runs ``--warmup`` untimed + ``--repeats`` timed rounds; the
median over the repeats is reported. Only ratios measured in the same run mean anything.

  main on W ranks (W in --ranks, default 2 and 4)
    save          shardfmt.save(state, path)                    (fsync: shardfmt's default)
                  dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True))
                  floor: each rank os.write()s its own bytes in 8 MiB pieces + xxh3-128 per
                  1 MiB chunk + fsync (the cheapest a hashed, durable write can be)
    load same     cold (fsync + POSIX_FADV_DONTNEED on every file of the checkpoint, every
                  rank, before the barrier that starts the load) into preallocated Shard(0)
                  DTensors: shardfmt.load / dcp.load(FileSystemReader) /
                  floor: os.preadv of the rank's bytes into the targets, 8 MiB pieces,
                  + xxh3-128 per 1 MiB chunk (single thread per rank)
    load row->col cold, into Shard(1) DTensors on the same mesh (same methods; the floor
                  reads the *number* of needed bytes contiguously: an idealised lower bound,
                  since the needed bytes are strided in a row-major file)
    small         50,000 tensors: half 0-d fp32 "step" tensors (plain, replicated on every
                  rank, like Adam's step), half (64,) "norm" DTensors Shard(0); save and
                  (cold) load, shardfmt vs DCP; manifest.json vs .metadata bytes. Runs on
                  --small-ranks (default 2 only: DCP needs ~25-60 s per call here, so 4 ranks
                  would add ~8 minutes) with --small-warmup 0 (the big phases warmed up)
  load on 4 ranks  dim-0 2 -> 4: the 2-rank checkpoints above loaded into 4-rank Shard(0)
                  DTensors (floor: preadv of exactly the needed row ranges)
  load on 1 process  2 -> 1: the 2-rank checkpoints loaded into plain full tensors, no
                  process group (dcp.load(..., no_dist=True))

Time of an operation: every rank passes a barrier, runs it, passes a second barrier;
the figure is the largest barrier-to-barrier time over the ranks (the job is done when
the slowest rank is). GB/s = bytes of the whole state (save) or of everything the ranks
need (load) / that time.

Bytes read per rank: ``rchar`` delta of /proc/self/io around the call (every byte the
process got from read()/pread()/preadv(): page cache or disk, including the manifest,
headers, DCP's .metadata, and the RSS sampler's few bytes of /proc/self/statm) for every
method; shardfmt's own LoadReport.bytes_read is reported beside it. ``needed`` is the
bytes of the rank's target tensors; ``needed~chunks`` rounds every needed byte range out
to whole 1 MiB hash chunks (a verified reader cannot read less), computed with shardfmt's
pure planner (verify=False, max_gap=0) on the same targets.

Peak RSS growth per rank: a thread samples /proc/self/statm every 2 ms during the call;
(peak - VmRSS just before the call, targets already allocated and touched) / the rank's
share (its local state bytes for a save, its target bytes for a load); max over repeats
and ranks. malloc_trim + gc before each call.

--profile (default on) wraps shardfmt's internal phases with timers (monkeypatched in the
worker processes only; coarse functions, a few dozen calls per operation) and prints a
per-phase breakdown for every shardfmt operation.

--scenarios picks a subset (save,same,rowcol,small,dim0,to1); --variants adds informational
shardfmt.load(**kwargs) methods to every load scenario (e.g. 'workers=2;max_read=8M,workers=2').
The sources of shardfmt/ and reshard/ are fingerprinted before and after the run: a warning
says when they changed under it (later jobs would then have run different code).

Takes ~7 minutes with the defaults (1.5 GB, 3 repeats + 1 warm-up, ranks 2 and 4).
Exit status 0 when every target passes, 1 otherwise.

Usage:  python benchmarks/bench_distributed.py [--size-mib 1536] [--repeats 3] [--ranks 2,4]
                                               [--dir D] [--json F] [--small-tensors 50000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

from common import (
    MIB,
    ROOT,
    WorkerCtx,
    cached_fraction,
    code_fingerprint,
    dir_bytes,
    drop_cache,
    files_under,
    launch,
    malloc_trim,
    proc_io,
    read_pieces,
    remove,
    rotate,
    run_worker,
    write_pieces,
)

METHODS = ("shardfmt", "dcp", "floor")

# ----------------------------------------------------------------------------- the state


def make_spec(size_mib: int, layers: int = 6) -> list[tuple[str, int, int]]:
    """[(fqn, rows, cols)]: a transformer's 2-D params x {weight, exp_avg, exp_avg_sq}, fp32.

    d is a multiple of 64, so every row and column count divides by 1, 2, 4 and 8.
    """
    per_d2 = layers * 12 * 3 * 4  # qkv 3d^2 + out d^2 + up 4d^2 + down 4d^2 = 12 d^2, x3 tensors, 4 B
    d = max(64, int(math.sqrt(size_mib * MIB / per_d2)) // 64 * 64)
    spec = []
    for layer in range(layers):
        for pname, (r, c) in (("attn.qkv", (3 * d, d)), ("attn.out", (d, d)), ("mlp.up", (4 * d, d)),
                              ("mlp.down", (d, 4 * d))):
            spec.append((f"model.layers.{layer}.{pname}.weight", r, c))
            for kind in ("exp_avg", "exp_avg_sq"):
                spec.append((f"optim.state.layers.{layer}.{pname}.{kind}", r, c))
    return spec


def gen(tid: int, r0: int, r1: int, c0: int, c1: int):
    """Element (i, j) of tensor ``tid`` = fl(fl(fl(i*a) + fl(j*b)) + tid): the same bits for any slice."""
    import torch

    rows = torch.arange(r0, r1, dtype=torch.float32).unsqueeze(1) * 0.0009765
    cols = torch.arange(c0, c1, dtype=torch.float32).unsqueeze(0) * 1.7071
    out = rows + cols
    out.add_(float(tid) * 0.5)
    return out


def spec_bytes(spec) -> int:
    return sum(r * c * 4 for _, r, c in spec)


def floor_offsets(spec, world: int) -> list[int]:
    """Byte offset of tensor i's block in every floor file of a ``world``-rank save (spec order)."""
    offs, pos = [], 0
    for _, r, c in spec:
        offs.append(pos)
        pos += (r // world) * c * 4
    return offs


# ----------------------------------------------------------------------------- profiling (worker side)


class Prof:
    """Accumulated seconds per label (thread-safe); reset per measured call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acc: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        with self.lock:
            self.acc = {}
            self.calls = {}

    def add(self, label: str, s: float) -> None:
        with self.lock:
            self.acc[label] = self.acc.get(label, 0.0) + s
            self.calls[label] = self.calls.get(label, 0) + 1


PROF = Prof()


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)
    if getattr(fn, "_bench_wrapped", False):
        return

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PROF.add(label, time.perf_counter() - t0)

    wrapper._bench_wrapped = True
    wrapper.__wrapped__ = fn
    setattr(owner, name, wrapper)


def install_profiler() -> None:
    import shardfmt.api as api
    import shardfmt.commit.protocol as commit
    import shardfmt.loading.executor as ex
    import shardfmt.loading.request as req
    import shardfmt.loading.targets as tg
    import shardfmt.saving.coordinator as coord
    import shardfmt.saving.describe as desc
    import shardfmt.saving.messages as msgs
    import shardfmt.saving.protocol as proto
    import shardfmt.saving.shard_file as sf
    import shardfmt.saving.writer as w

    # save: describe -> agree -> gather -> plan -> stage -> write -> gather -> commit -> broadcast
    _wrap(desc, "describe", "save.describe")
    _wrap(coord, "all_gather_bytes", "save.all_gather_bytes")
    _wrap(coord, "broadcast_bytes", "save.broadcast_bytes")
    _wrap(proto, "assign_writers", "save.assign_writers")
    _wrap(proto, "write_shard_file", "save.write_shard_file(every rank)")
    _wrap(w.CheckpointWriter, "stage", "save.stage(rank0)")
    _wrap(w.CheckpointWriter, "build_manifest", "save.build_manifest(rank0)")
    _wrap(commit, "publish", "save.publish(rank0)")
    _wrap(msgs, "parse_manifest", "save.parse_manifest")
    _wrap(sf.hashing.ChunkHasher, "update", "hash: ChunkHasher.update(sum over threads)")
    # load: open -> flatten/targets -> plan -> headers -> execute (threads: read, verify)
    _wrap(api, "open_checkpoint", "load.open_checkpoint")
    _wrap(req, "flatten", "load.flatten")
    _wrap(tg, "plan_load", "load.plan")
    _wrap(api, "check_headers", "load.check_headers")
    _wrap(ex.Executor, "run", "load.execute")
    _wrap(ex.Executor, "_read", "load.exec.read(sum over threads)")
    _wrap(ex.Executor, "_verify", "load.exec._verify(sum over threads)")


# ----------------------------------------------------------------------------- worker


class Ctx(WorkerCtx):
    def measure(self, scenario: str, method: str, rep: int, fn, *, share: int, setup=None,
                cold: list[str] | None = None) -> dict:
        if setup is not None:
            setup()
        frac = None
        if cold:
            for p in cold:
                drop_cache(p)
            frac = max(cached_fraction(p) for p in cold)
        gc.collect()
        malloc_trim()
        self.barrier()
        gc.disable()
        PROF.reset()
        io0 = proc_io()
        c0 = os.times()
        before = self.sampler.start()
        t0 = time.perf_counter()
        try:
            extra = fn() or {}
        finally:
            t_local = time.perf_counter() - t0
            peak = self.sampler.stop()
            io1 = proc_io()
            c1 = os.times()
            gc.enable()
        self.barrier()
        t_wall = time.perf_counter() - t0
        rec = {"scenario": scenario, "method": method, "rep": rep, "rank": self.rank, "world": self.world,
               "local_s": t_local, "wall_s": t_wall, "rss_before": before, "rss_peak": peak,
               "rss_growth": peak - before, "share": share, "rss_samples": self.sampler.samples,
               "cpu_s": (c1.user - c0.user) + (c1.system - c0.system),
               "rchar": io1["rchar"] - io0["rchar"], "read_bytes": io1["read_bytes"] - io0["read_bytes"],
               "wchar": io1["wchar"] - io0["wchar"], "write_bytes": io1["write_bytes"] - io0["write_bytes"],
               "cached_before": frac, "phases": dict(PROF.acc), "phase_calls": dict(PROF.calls), **extra}
        if rep >= 0:
            self.records.append(rec)
        self.say(f"{scenario:<16} rep {rep:>2} {method:<9} {t_wall:7.3f}s  rank0: rss +{rec['rss_growth'] / MIB:7.1f} "
                 f"MiB  rchar {rec['rchar'] / MIB:8.1f} MiB  cpu {rec['cpu_s']:.2f}s"
                 + (f"  cached-before {frac:.1%}" if frac is not None else "") + ("  (warm-up)" if rep < 0 else ""))
        return rec


def floor_write(tensors, path: str) -> None:
    from shardfmt.format.tensor_bytes import byte_view

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            write_pieces(fd, byte_view(t), hashed=True)
        os.fsync(fd)
    finally:
        os.close(fd)


def floor_read(reads: list[tuple[str, int, memoryview]]) -> None:
    """preadv each (file, offset, destination bytes) in 8 MiB pieces, hash every 1 MiB chunk."""
    fds: dict[str, int] = {}
    try:
        for path, off, dst in reads:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            read_pieces(fd, dst, off, hashed=True, path=path)
    finally:
        for fd in fds.values():
            os.close(fd)


def floor_reads_rows(spec, floor_dir: str, src_world: int, dst_world: int, q: int, locals_) -> list:
    """Row-sharded targets (dst_world ranks, this is rank q) from a src_world-rank floor save."""
    from shardfmt.format.tensor_bytes import byte_view

    offs = floor_offsets(spec, src_world)
    reads = []
    for i, ((_, r, c), t) in enumerate(zip(spec, locals_)):
        mv = byte_view(t)
        a, b = q * r // dst_world, (q + 1) * r // dst_world
        rs = r // src_world
        for s in range(src_world):
            lo, hi = max(a, s * rs), min(b, (s + 1) * rs)
            if lo >= hi:
                continue
            reads.append((os.path.join(floor_dir, f"rank_{s}.bin"), offs[i] + (lo - s * rs) * c * 4,
                          mv[(lo - a) * c * 4: (hi - a) * c * 4]))
    return reads


def floor_reads_cols(spec, floor_dir: str, src_world: int, dst_world: int, q: int, locals_) -> list:
    """Column-sharded targets: the same *number* of bytes, read contiguously (idealised bound)."""
    from shardfmt.format.tensor_bytes import byte_view

    offs = floor_offsets(spec, src_world)
    reads = []
    for i, ((_, r, c), t) in enumerate(zip(spec, locals_)):
        mv = byte_view(t)
        block = (r // src_world) * c * 4
        piece = block // dst_world
        for s in range(src_world):
            reads.append((os.path.join(floor_dir, f"rank_{s}.bin"), offs[i] + q * piece,
                          mv[s * piece: (s + 1) * piece]))
    return reads


def needed_chunk_rounded(path: str, boxes) -> tuple[int, int]:
    """(exact needed bytes, needed bytes rounded out to whole hash chunks) for ``boxes``."""
    from shardfmt.loading.planner import TargetSlice, plan_load
    from shardfmt.loading.reader import open_checkpoint

    m = open_checkpoint(path).manifest
    plan = plan_load(m, [TargetSlice(index=i, fqn=f, box=b) for i, (f, b) in enumerate(boxes)],
                     verify=False, max_gap=0)
    c = m.chunk_size
    chunks: dict[str, set[int]] = {}
    for r in plan.reads:
        s = chunks.setdefault(r.file, set())
        for it in r.items:
            if it.src_end > it.src_start:
                s.update(range(it.src_start // c, (it.src_end - 1) // c + 1))
    total = 0
    for f, ks in chunks.items():
        size = m.files[f].size
        total += sum(min((k + 1) * c, size) - k * c for k in ks)
    return plan.needed_bytes, total


def _dtensors(mesh, locals_, spec, placement):
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for (fqn, r, c), t in zip(spec, locals_):
        out[fqn] = DTensor.from_local(t, mesh, [placement], run_check=False, shape=torch.Size((r, c)),
                                      stride=(c, 1))
    return out


def _verify(locals_, expected_fn, what: str) -> None:
    import torch

    for i, t in enumerate(locals_):
        if not torch.equal(t, expected_fn(i)):
            raise AssertionError(f"{what}: tensor {i} differs from the saved data")


def _sf_load(state, path, **kw):
    import shardfmt

    rep = shardfmt.load(state, path, **kw)
    return {"sf_bytes_read": rep.bytes_read, "sf_bytes_needed": rep.bytes_needed,
            "sf_read_requests": rep.read_requests}


def _dcp_save(state, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True))


def _dcp_load(state, path, no_dist=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    if no_dist:
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    else:
        dcp.load(state, storage_reader=FileSystemReader(path))


def run_loads(ctx: Ctx, scenario: str, spec, locals_, state, ckpts: dict, floor_reads, expected_fn,
              boxes, *, no_dist=False, warmup: int, repeats: int) -> None:
    """Interleaved cold loads of ``ckpts`` (method -> path) into ``state`` (whose locals are ``locals_``)."""
    share = sum(t.numel() * t.element_size() for t in locals_)
    fns = {
        "shardfmt": lambda: _sf_load(state, ckpts["shardfmt"]),
        "dcp": lambda: _dcp_load(state, ckpts["dcp"], no_dist),
        "floor": lambda: floor_read(floor_reads) or {},
    }
    paths = dict(ckpts)
    for name, kw in ctx.args.get("variants", {}).items():  # informational shardfmt.load(**kw) variants
        fns[name] = functools.partial(_sf_load, state, ckpts["shardfmt"], **kw)
        paths[name] = ckpts["shardfmt"]
    for rep in range(-warmup, repeats):
        for m in rotate(list(fns), rep):
            for t in locals_:
                t.zero_()
            ctx.measure(scenario, m, rep, fns[m], share=share, cold=[paths[m]])
            if m != "floor":
                _verify(locals_, expected_fn, f"{scenario} {m}")
    exact, rounded = needed_chunk_rounded(ckpts["shardfmt"], boxes)
    ctx.records.append({"scenario": scenario, "kind": "needed", "rank": ctx.rank, "needed": exact,
                        "needed_chunks": rounded, "share": share})


def job_main(ctx: Ctx) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import shardfmt
    from shardfmt.layout.geometry import Box

    a = ctx.args
    W, rank = ctx.world, ctx.rank
    warmup, repeats = a["warmup"], a["repeats"]
    spec = make_spec(a["size_mib"])
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp",))
    t0 = time.perf_counter()
    locals_ = [gen(i, rank * r // W, (rank + 1) * r // W, 0, c) for i, (_, r, c) in enumerate(spec)]
    state = _dtensors(mesh, locals_, spec, Shard(0))
    share = sum(t.numel() * 4 for t in locals_)
    ctx.say(f"state: {len(spec)} tensors, {spec_bytes(spec) / 1e9:.3f} GB total, {share / 1e9:.3f} GB on this "
            f"rank, built in {time.perf_counter() - t0:.1f}s")
    base = a["base"]
    ck = {m: os.path.join(base, m) for m in METHODS}
    sel = set(a["scenarios"])
    if sel & {"save", "same", "rowcol", "dim0", "to1"}:
        # ---- save
        def setup_for(m):
            def setup():
                if rank == 0:
                    remove(ck[m])
                    if m != "shardfmt":
                        os.makedirs(ck[m])
                ctx.barrier()
            return setup

        save_fns = {
            "shardfmt": lambda: (shardfmt.save(state, ck["shardfmt"], timeout=dt.timedelta(minutes=10)), None)[1],
            "dcp": lambda: _dcp_save(state, ck["dcp"]),
            "floor": lambda: floor_write(locals_, os.path.join(ck["floor"], f"rank_{rank}.bin")),
        }
        # without "save" selected: one untimed save per method, for the loads
        save_reps = range(-warmup, repeats) if "save" in sel else range(-1, 0)
        for rep in save_reps:
            for m in rotate(METHODS, rep):
                ctx.measure(f"save@{W}", m, rep, save_fns[m], share=share, setup=setup_for(m))
        if rank == 0:
            ctx.records.append({"scenario": f"save@{W}", "kind": "sizes", "rank": 0,
                                "manifest": os.path.getsize(os.path.join(ck["shardfmt"], "manifest.json")),
                                "dcp_metadata": os.path.getsize(os.path.join(ck["dcp"], ".metadata")),
                                "bytes": {m: dir_bytes(ck[m]) for m in METHODS}})
    if "same" in sel:
        targets = [torch.zeros_like(t) for t in locals_]
        tstate = _dtensors(mesh, targets, spec, Shard(0))
        boxes = [(f, Box((rank * r // W, 0), (r // W, c))) for f, r, c in spec]
        run_loads(ctx, f"same@{W}", spec, targets, tstate, ck,
                  floor_reads_rows(spec, ck["floor"], W, W, rank, targets), lambda i: locals_[i], boxes,
                  warmup=warmup, repeats=repeats)
        del tstate, targets
    if "rowcol" in sel:
        targets = [torch.zeros(r, c // W) for _, r, c in spec]
        tstate = _dtensors(mesh, targets, spec, Shard(1))
        boxes = [(f, Box((0, rank * c // W), (r, c // W))) for f, r, c in spec]
        run_loads(ctx, f"row->col@{W}", spec, targets, tstate, ck,
                  floor_reads_cols(spec, ck["floor"], W, W, rank, targets),
                  lambda i: gen(i, 0, spec[i][1], rank * spec[i][2] // W, (rank + 1) * spec[i][2] // W), boxes,
                  warmup=warmup, repeats=repeats)
        del tstate, targets
    state = locals_ = save_fns = None  # free the big state before the small one
    gc.collect()
    malloc_trim()
    if a["small_tensors"] > 0 and "small" in sel and W in a["small_ranks"]:
        job_small(ctx, mesh)


def _small_state(n: int, rank: int, W: int, mesh, zero: bool):
    import torch
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    n_step = n // 2
    for i in range(n_step):
        out[f"optim.state.{i}.step"] = torch.tensor(0.0 if zero else float(i + 1))
    per = 64 // W
    for i in range(n - n_step):
        loc = torch.zeros(per) if zero else torch.arange(rank * per, (rank + 1) * per, dtype=torch.float32) + i
        out[f"model.norms.{i}.weight"] = DTensor.from_local(loc, mesh, [Shard(0)], run_check=False,
                                                            shape=torch.Size((64,)), stride=(1,))
    return out


def job_small(ctx: Ctx, mesh) -> None:
    import torch

    import shardfmt
    from shardfmt.format.hashing import ChunkHasher

    if hasattr(ChunkHasher.update, "__wrapped__"):  # per-piece: too fine-grained for 50k tiny tensors
        ChunkHasher.update = ChunkHasher.update.__wrapped__
    a = ctx.args
    W, rank = ctx.world, ctx.rank
    n = a["small_tensors"]
    t0 = time.perf_counter()
    state = _small_state(n, rank, W, mesh, zero=False)
    targets = _small_state(n, rank, W, mesh, zero=True)
    ctx.say(f"small state: {n} tensors built in {time.perf_counter() - t0:.1f}s")
    share = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes for v in state.values())
    base = os.path.join(a["base"], "small")
    ck = {"shardfmt": os.path.join(base, "shardfmt"), "dcp": os.path.join(base, "dcp")}

    def setup_for(m):
        def setup():
            if rank == 0:
                remove(ck[m])
                if m == "dcp":
                    os.makedirs(ck[m])
            ctx.barrier()
        return setup

    save_fns = {
        "shardfmt": lambda: (shardfmt.save(state, ck["shardfmt"], timeout=dt.timedelta(minutes=10)), None)[1],
        "dcp": lambda: _dcp_save(state, ck["dcp"]),
    }
    load_fns = {
        "shardfmt": lambda: _sf_load(targets, ck["shardfmt"]),
        "dcp": lambda: _dcp_load(targets, ck["dcp"]),
    }

    def check(m):
        for k, v in state.items():
            got = targets[k]
            if hasattr(v, "to_local"):
                v, got = v.to_local(), got.to_local()
            if not torch.equal(v, got):
                raise AssertionError(f"small {m}: {k} differs")

    names = ["shardfmt", "dcp"]
    for rep in range(-a["small_warmup"], a["repeats"]):
        for m in rotate(names, rep):
            ctx.measure(f"small-save@{W}", m, rep, save_fns[m], share=share, setup=setup_for(m))
    for rep in range(-a["small_warmup"], a["repeats"]):
        for m in rotate(names, rep):
            for v in targets.values():
                (v.to_local() if hasattr(v, "to_local") else v).zero_()
            ctx.measure(f"small-load@{W}", m, rep, load_fns[m], share=share, cold=[ck[m]])
            check(m)
    if rank == 0:
        ctx.records.append({"scenario": f"small-save@{W}", "kind": "sizes", "rank": 0,
                            "manifest": os.path.getsize(os.path.join(ck["shardfmt"], "manifest.json")),
                            "dcp_metadata": os.path.getsize(os.path.join(ck["dcp"], ".metadata")),
                            "bytes": {m: dir_bytes(p) for m, p in ck.items()},
                            "files": {m: len(files_under(p)) for m, p in ck.items()}})
        remove(base)


def job_load(ctx: Ctx) -> None:
    """Load a src_world-rank checkpoint on this job's world: dim-0 (DTensor Shard(0)) or full (1 process)."""
    import torch

    from shardfmt.layout.geometry import Box

    a = ctx.args
    T, q = ctx.world, ctx.rank
    S = a["src_world"]
    spec = make_spec(a["size_mib"])
    ck = {m: os.path.join(a["src"], m) for m in METHODS}
    if ctx.distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard

        mesh = init_device_mesh("cpu", (T,), mesh_dim_names=("dp",))
        targets = [torch.zeros(r // T, c) for _, r, c in spec]
        tstate = _dtensors(mesh, targets, spec, Shard(0))
    else:
        targets = [torch.zeros(r, c) for _, r, c in spec]
        tstate = {f: t for (f, _, _), t in zip(spec, targets)}
    boxes = [(f, Box((q * r // T, 0), (r // T, c))) for f, r, c in spec]
    run_loads(ctx, a["scenario"], spec, targets, tstate, ck, floor_reads_rows(spec, ck["floor"], S, T, q, targets),
              lambda i: gen(i, q * spec[i][1] // T, (q + 1) * spec[i][1] // T, 0, spec[i][2]), boxes,
              no_dist=not ctx.distributed, warmup=a["warmup"], repeats=a["repeats"])


JOBS = {"main": job_main, "load": job_load}


def worker_main(argv: list[str]) -> None:
    run_worker(argv, JOBS, Ctx, setup=lambda args: install_profiler() if args.get("profile", True) else None)


# ----------------------------------------------------------------------------- driver


def med(xs):
    return statistics.median(xs)


def summarize(records: list[dict]) -> dict:
    runs = [r for r in records if "kind" not in r]
    needed = {(r["scenario"], r["rank"]): r for r in records if r.get("kind") == "needed"}
    sizes = {r["scenario"]: r for r in records if r.get("kind") == "sizes"}
    scen_order = []
    for r in runs:
        if r["scenario"] not in scen_order:
            scen_order.append(r["scenario"])
    rows = []
    for sc in scen_order:
        methods = []
        for r in runs:
            if r["scenario"] == sc and r["method"] not in methods:
                methods.append(r["method"])
        for m in methods:
            rs = [r for r in runs if r["scenario"] == sc and r["method"] == m]
            reps = sorted({r["rep"] for r in rs})
            ranks = sorted({r["rank"] for r in rs})
            walls = [max(r["wall_s"] for r in rs if r["rep"] == k) for k in reps]
            per_rank = {}
            for q in ranks:
                mine = [r for r in rs if r["rank"] == q]
                per_rank[q] = {
                    "rchar": med([r["rchar"] for r in mine]),
                    "read_bytes": med([r["read_bytes"] for r in mine]),
                    "sf_bytes_read": med([r["sf_bytes_read"] for r in mine]) if "sf_bytes_read" in mine[0] else None,
                    "sf_bytes_needed": mine[0].get("sf_bytes_needed"),
                    "rss_frac_max": max(r["rss_growth"] for r in mine) / mine[0]["share"],
                    "rss_frac_med": med([r["rss_growth"] for r in mine]) / mine[0]["share"],
                    "share": mine[0]["share"],
                    "cpu_s": med([r["cpu_s"] for r in mine]),
                    "local_s": med([r["local_s"] for r in mine]),
                    "needed": needed.get((sc, q), {}).get("needed"),
                    "needed_chunks": needed.get((sc, q), {}).get("needed_chunks"),
                    "cached_before_max": max((r["cached_before"] or 0.0) for r in mine),
                }
            phases = {}
            for q in ranks:
                labels = sorted({k for r in rs if r["rank"] == q for k in r["phases"]})
                phases[q] = {k: med([r["phases"].get(k, 0.0) for r in rs if r["rank"] == q]) for k in labels}
            total_bytes = sum(v["share"] for v in per_rank.values())
            rows.append({"scenario": sc, "method": m, "seconds": med(walls), "all_seconds": walls,
                         "bytes": total_bytes, "gbps": total_bytes / med(walls) / 1e9, "per_rank": per_rank,
                         "phases": phases})
    return {"rows": rows, "sizes": sizes}


def row(summary, sc, m):
    for r in summary["rows"]:
        if r["scenario"] == sc and r["method"] == m:
            return r
    return None


def targets_of(summary, worlds, reshard_to) -> list[dict]:
    out = []

    def add(name, value, op, th, fmt="{:.3f}x"):
        if value is None:
            return
        ok = value >= th if op == ">=" else (value <= th if op == "<=" else value < th)
        out.append({"target": name, "value": value, "op": op, "threshold": th, "pass": ok,
                    "shown": fmt.format(value)})

    def rss_max(r):
        return max(v["rss_frac_max"] for v in r["per_rank"].values())

    for W in worlds:
        s, d, f = (row(summary, f"save@{W}", m) for m in METHODS)
        if s and f:
            add(f"save@{W}: shardfmt >= 0.85x write floor (throughput)", f["seconds"] / s["seconds"], ">=", 0.85)
        if s and d:
            add(f"save@{W}: shardfmt >= 1.5x DCP (throughput)", d["seconds"] / s["seconds"], ">=", 1.5)
        if s:
            add(f"save@{W}: shardfmt peak RSS growth < 10% of rank share", rss_max(s), "<", 0.10, "{:.1%}")
        s, f = row(summary, f"same@{W}", "shardfmt"), row(summary, f"same@{W}", "floor")
        if s and f:
            add(f"same@{W}: shardfmt cold load >= 0.85x read floor", f["seconds"] / s["seconds"], ">=", 0.85)
    resh = [f"row->col@{W}" for W in worlds]
    if 2 in worlds:
        resh += [f"dim0 2->{reshard_to}", "2->1"]
    for sc in resh:
        s, d = row(summary, sc, "shardfmt"), row(summary, sc, "dcp")
        if s and d:
            add(f"{sc}: shardfmt time <= 0.6x DCP's", s["seconds"] / d["seconds"], "<=", 0.6)
        if sc.startswith("dim0") and s:
            worst = max(v["sf_bytes_read"] / v["needed_chunks"] for v in s["per_rank"].values())
            add(f"{sc}: shardfmt bytes read <= 1.1x needed (chunk-rounded), worst rank", worst, "<=", 1.1)
    for W in worlds:
        for sc in (f"same@{W}", f"row->col@{W}") + ((f"dim0 2->{reshard_to}", "2->1") if W == 2 else ()):
            s = row(summary, sc, "shardfmt")
            if s:
                add(f"{sc}: shardfmt load peak RSS growth < 10% of rank share", rss_max(s), "<", 0.10, "{:.1%}")
    for W in worlds:
        for what in ("save", "load"):
            s, d = row(summary, f"small-{what}@{W}", "shardfmt"), row(summary, f"small-{what}@{W}", "dcp")
            if s and d:
                add(f"small-{what}@{W} (50k tensors): shardfmt faster than DCP (DCP time / shardfmt time)",
                    d["seconds"] / s["seconds"], ">", 1.0)
    for t in out:
        if t["op"] == ">":
            t["pass"] = t["value"] > t["threshold"]
    return out


def fmt_b(n) -> str:
    return "-" if n is None else f"{n / 1e9:.3f}"


def print_summary(summary, targets, meta) -> None:
    print()
    print(f"state {meta['state_bytes'] / 1e9:.3f} GB fp32 in {meta['tensors']} tensors; median of {meta['repeats']} "
          f"repeats (+{meta['warmup']} warm-up); time = max over ranks of barrier-to-barrier seconds")
    print("x floor = floor time / method time (throughput vs floor); x DCP = method time / DCP time (<1: faster)")
    print("read/rank: median rchar per rank in GB (max over ranks); sf read: LoadReport.bytes_read (max over ranks); "
          "needed / needed~chunks per rank (max over ranks)")
    print("RSS+: max over repeats and ranks of (peak VmRSS - VmRSS before) / rank's share (and in MiB)")
    hdr = (f"{'scenario':<15} {'method':<26} {'median s':>9} {'GB/s':>7} {'x floor':>8} {'x DCP':>7} {'read/rank':>10} "
           f"{'sf read':>8} {'needed':>8} {'~chunks':>8} {'RSS+':>7} {'RSS+MiB':>8} {'cpu s/rk':>8}  runs (s)")
    print(hdr)
    print("-" * (len(hdr) + 16))
    for r in summary["rows"]:
        sc, m = r["scenario"], r["method"]
        fl, dc = row(summary, sc, "floor"), row(summary, sc, "dcp")
        pr = r["per_rank"].values()
        xf = f"{fl['seconds'] / r['seconds']:.3f}" if fl else "-"
        xd = f"{r['seconds'] / dc['seconds']:.3f}" if dc else "-"
        sfr = max((v["sf_bytes_read"] or 0) for v in pr) if m.startswith(("shardfmt", "sf[")) and "save" not in sc else None
        need = max((v["needed"] or 0) for v in pr) or None
        needc = max((v["needed_chunks"] or 0) for v in pr) or None
        rd = max(v["rchar"] for v in pr) if "save" not in sc else None
        print(f"{sc:<15} {m:<26} {r['seconds']:9.3f} {r['gbps']:7.3f} {xf:>8} {xd:>7} {fmt_b(rd):>10} {fmt_b(sfr):>8} "
              f"{fmt_b(need):>8} {fmt_b(needc):>8} {max(v['rss_frac_max'] for v in pr):7.1%} "
              f"{max(v['rss_frac_max'] * v['share'] for v in pr) / MIB:8.1f} "
              f"{max(v['cpu_s'] for v in pr):8.2f}  {' '.join(f'{s:.3f}' for s in r['all_seconds'])}")
    print()
    for sc, s in summary["sizes"].items():
        files = f", files shardfmt {s['files']['shardfmt']} / DCP {s['files']['dcp']}" if "files" in s else ""
        print(f"sizes {sc}: shardfmt manifest.json {s['manifest']:,} B; DCP .metadata {s['dcp_metadata']:,} B; "
              f"checkpoint bytes " + ", ".join(f"{k} {v:,}" for k, v in s["bytes"].items()) + files)
    print()
    print("per-rank bytes read on loads (median rchar, GB; shardfmt also LoadReport.bytes_read):")
    for r in summary["rows"]:
        if "save" in r["scenario"]:
            continue
        cells = []
        for q, v in sorted(r["per_rank"].items(), key=lambda kv: int(kv[0])):
            c = f"r{q} {v['rchar'] / 1e9:.3f}"
            if v["sf_bytes_read"] is not None:
                c += f" (sf {v['sf_bytes_read'] / 1e9:.3f}"
                if v["needed_chunks"]:
                    c += f", {v['sf_bytes_read'] / v['needed_chunks']:.3f}x ~chunks, " \
                         f"{v['sf_bytes_read'] / v['needed']:.3f}x needed"
                c += ")"
            cells.append(c)
        print(f"  {r['scenario']:<15} {r['method']:<26} " + "; ".join(cells))
    print()
    print("shardfmt phases (median seconds per rank; nested: write_rank includes hashing, execute includes "
          "read+verify; 'sum over threads' can exceed wall):")
    for r in summary["rows"]:
        if not r["method"].startswith(("shardfmt", "sf[")):
            continue
        print(f"  {r['scenario']:<15} total {r['seconds']:.3f}s")
        labels = sorted({k for ph in r["phases"].values() for k in ph})
        for k in labels:
            vals = " ".join(f"r{q} {ph.get(k, 0.0):7.3f}" for q, ph in sorted(r["phases"].items(),
                                                                               key=lambda kv: int(kv[0])))
            print(f"      {k:<38} {vals}")
    print()
    for t in targets:
        print(f"  {'PASS' if t['pass'] else 'MISS'}  {t['target']:<86} measured {t['shown']}")
    for r in summary["rows"]:
        if r["method"] == "dcp" and "save" not in r["scenario"]:
            fl = row(summary, r["scenario"], "floor")
            if fl:
                print(f"  info  {r['scenario']}: read floor time / DCP time = {fl['seconds'] / r['seconds']:.3f} "
                      "(what a reader exactly at the floor would score against DCP)")
    cb = [(r["scenario"], r["method"], max(v["cached_before_max"] for v in r["per_rank"].values()))
          for r in summary["rows"] if "save" not in r["scenario"]]
    print("  page cache residency before cold loads (should be ~0%): max "
          f"{max((c for *_, c in cb), default=0.0):.1%}")


def _parse_value(x: str):
    """'4' -> 4, '8M' -> 8 MiB, '1K' -> 1 KiB, 'True'/'False' -> bool, else the string."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if x[:-1].isdigit() and x[-1] in mult:
        return int(x[:-1]) * mult[x[-1]]
    if x.lstrip("-").isdigit():
        return int(x)
    return {"True": True, "False": False}.get(x, x)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, ROOT)
        worker_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1536, help="total state size in MiB (default 1536; rounded)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ranks", default="2,4", help="world sizes of the save/same-topology jobs (default 2,4)")
    p.add_argument("--reshard-to", type=int, default=4, help="world of the dim-0 reshard from 2 ranks (default 4)")
    p.add_argument("--small-tensors", type=int, default=50000, help="tensors in the small state (0: skip)")
    p.add_argument("--scenarios", default="save,same,rowcol,small,dim0,to1",
                   help="comma list of: save, same, rowcol, small, dim0, to1 (default all)")
    p.add_argument("--small-ranks", default="2", help="world sizes that run the small state (default 2)")
    p.add_argument("--small-warmup", type=int, default=0,
                   help="untimed rounds before the small-state repeats (default 0: the big phases warmed up)")
    p.add_argument("--variants", default="",
                   help="extra, informational shardfmt.load variants in every load scenario, "
                        "';'-separated kwargs lists, e.g. 'workers=2;max_read=8M,workers=2'")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp, removed after)")
    p.add_argument("--json", default=None, help="write raw records and the summary to this file")
    p.add_argument("--no-profile", action="store_true", help="do not wrap shardfmt's phases with timers")
    p.add_argument("--job-timeout", type=float, default=1500.0)
    args = p.parse_args(argv)
    worlds = [int(x) for x in args.ranks.split(",") if x]
    scen = [x for x in args.scenarios.split(",") if x]
    variants = {}
    for v in filter(None, args.variants.split(";")):
        kw = {k: _parse_value(x) for k, x in (p.split("=") for p in v.split(","))}
        variants[f"sf[{v}]"] = kw
    scratch = args.dir or tempfile.mkdtemp(prefix="shardfmt-dbench-", dir="/tmp")
    own = args.dir is None
    os.makedirs(scratch, exist_ok=True)
    spec = make_spec(args.size_mib)
    common = {"size_mib": args.size_mib, "repeats": args.repeats, "warmup": args.warmup,
              "small_tensors": args.small_tensors, "profile": not args.no_profile, "scenarios": scen,
              "small_ranks": [int(x) for x in args.small_ranks.split(",") if x], "small_warmup": args.small_warmup,
              "variants": variants}
    code0 = code_fingerprint()
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    print(f"state: {len(spec)} fp32 tensors, {spec_bytes(spec) / 1e9:.3f} GB; worlds {worlds}; scratch {scratch}",
          flush=True)
    records: list[dict] = []
    try:
        for W in worlds:
            base = os.path.join(scratch, f"w{W}")
            records += launch(__file__, "main", W, dict(common, base=base, label=f"main@{W}"),
                              os.path.join(scratch, "logs", f"main{W}"), args.job_timeout)
            if W == 2:
                if "dim0" in scen:
                    sc = f"dim0 2->{args.reshard_to}"
                    records += launch(__file__, "load", args.reshard_to,
                                      dict(common, src=base, src_world=2, scenario=sc, label=sc),
                                      os.path.join(scratch, "logs", "dim0"), args.job_timeout)
                if "to1" in scen:
                    records += launch(__file__, "load", 1, dict(common, src=base, src_world=2, scenario="2->1", label="2->1"),
                                      os.path.join(scratch, "logs", "to1"), args.job_timeout)
            remove(base)
    finally:
        if own:
            shutil.rmtree(scratch, ignore_errors=True)
    code1 = code_fingerprint()
    if code1 != code0:
        print(f"\nWARNING: shardfmt/reshard sources changed during the run ({code0} -> {code1}): "
              "jobs may have run different code", flush=True)
    summary = summarize(records)
    targets = targets_of(summary, worlds, args.reshard_to)
    meta = {"state_bytes": spec_bytes(spec), "tensors": len(spec), "repeats": args.repeats, "warmup": args.warmup,
            "code_before": code0, "code_after": code1}
    print_summary(summary, targets, meta)
    wall = time.perf_counter() - t0
    print(f"code fingerprint (shardfmt/ + reshard/ sources): {code0}"
          + ("" if code0 == code1 else f" -> {code1} (CHANGED during the run)"))
    print(f"\nwall {wall:.0f}s; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          "(the machine is shared: a high value means noisy figures)")
    if args.json:
        import torch
        import xxhash

        import shardfmt

        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records, "summary": summary, "targets": targets, "wall_s": wall,
                       "env": {"python": platform.python_version(), "torch": torch.__version__,
                               "shardfmt": shardfmt.__version__, "xxhash": xxhash.VERSION,
                               "cpus": os.cpu_count(), "argv": sys.argv[1:]}}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(t["pass"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
