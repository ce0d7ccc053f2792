#!/usr/bin/env python
"""One command, one state, every method: shardfmt vs torch.distributed.checkpoint vs the floors.

    python benchmarks/run.py                       # 2 ranks, 3 GiB state, 5 rounds, fsync on
    python benchmarks/run.py --quick               # smoke test: 128 MiB, 2 rounds
    python benchmarks/run.py --device cuda         # the GPU benchmark: state on the GPU (1 rank)

State: a transformer's 2-D weights (bf16) + Adam state (fp32 master, exp_avg, exp_avg_sq),
6 layers x {qkv, out, up, down}, ``--size-mib`` in all (rounded down), split over
``--ranks`` processes. With ranks > 1 every tensor is a DTensor ``Shard(0)`` (rows) on a
1-D DeviceMesh, each rank building its rows from a closed formula (any slice can be
regenerated to check a load); with 1 rank they are plain tensors and no process group
exists. One process per rank, gloo over tcp://127.0.0.1 (like bench_distributed.py).

Each round runs every method group once, the starting group rotating with the round;
every checkpoint is deleted once its loads are done (at most one on disk at a time):

  memcpy             copy of the rank's state into pre-faulted buffers (``copy_``; on CUDA
                     into pinned host buffers, non_blocking + synchronize: the D2H bound)
  floor              save: os.write of the rank's bytes in 8 MiB pieces + xxh3-128 per
                     1 MiB chunk + fsync; load: os.preadv into the targets + xxh3-128
  raw                the same without hashing
  shardfmt           shardfmt.save(sync=fsync); load: shardfmt.load (verify on) same
                     topology, then resharded
  shardfmt-async     shardfmt.async_save(stager=STAGER) (snapshot on the call); blocked =
                     the call, total = call start to wait() return
  shardfmt-async-bg  the same with stage="background"; staged = until wait_staged()
  dcp                dcp.save(FileSystemWriter(sync_files=fsync)); dcp.load same and resharded
  dcp-async          dcp.async_save with FileSystemWriter (its default blocking stager:
                     a fresh CPU copy on every call); total = until future.result()
  dcp-async-bg       dcp.async_save(async_stager=DefaultStager(StagingOptions(
                     use_async_staging=True, pinned + non-blocking on CUDA, no shared
                     memory))), one stager reused by every round like shardfmt's Stager;
                     staged = until staging_completion, total = until upload_completion
  torch              torch.save of the rank's local tensors (+ fsync); torch.load(
                     weights_only=True, mmap=False) then copy_ into the targets

Loads are cold (every rank fsyncs and POSIX_FADV_DONTNEEDs every file of the checkpoint
before the barrier that starts the load) and land in preallocated targets filled with NaN;
after every load a sample of rows of every tensor is compared with the formula and no NaN
may remain (after the first round's async saves, too, loading them untimed), so no method
can be timed on a broken path. A DCP variant that raises is recorded and shown as n/a;
any other failure stops the run.

Resharded load: ranks > 1: into Shard(1) (column) DTensors on the same mesh (every rank
needs 1/W of every row: strided in the row-major files). 1 rank: the left column half
of every tensor, as ``shardfmt.ShardedTensor(half, shape, (0, 0))`` for shardfmt; DCP has
no slice target without a process group, so dcp.load reads the full tensors and the half
is copied out (that copy is timed). GB/s counts the target bytes.

Time of an operation: every rank passes a barrier, runs it, passes a second barrier; the
figure is the largest barrier-to-barrier time over the ranks (on CUDA the clock stops
after torch.cuda.synchronize). Exceptions: ``blocked`` and ``staged`` (async) and the
memcpy bound are the largest local times over the ranks (no barrier latency in either).
Medians are over rounds 2..N (round 1 allocates staging buffers; it is shown but not
judged). On CUDA the floor and raw write copy each tensor into its pinned host buffer
before writing it, and their loads read into it and copy to the GPU (not overlapped).

Targets (the issue's, judged on rounds 2..N, shardfmt-async with the default stage):
async blocked <= 1.5x memcpy; async total <= shardfmt sync save + 1.0x memcpy; sync save
>= 0.9x the write floor (throughput); same-topology load >= 0.9x the read floor.
Exit status: 0 all pass, 1 a target missed, 2 the run failed.

Memory per rank, about: state + targets + shardfmt's Stager + DCP's reused stager (+ a
transient copy for DCP's default async and torch.load; + pinned buffers on CUDA), i.e.
4-5x the rank's share. Disk: one checkpoint at a time (~1x the state). The default scratch
is a temp dir next to the repository (not /tmp, which may be tmpfs), removed afterwards.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback

from common import (
    MIB,
    ROOT,
    RSSSampler,
    code_fingerprint,
    drop_cache,
    fs_type,
    launch,
    malloc_trim,
    read_pieces,
    remove,
    rotate,
    write_pieces,
)

GROUPS = ("memcpy", "floor", "raw", "shardfmt", "shardfmt-async", "shardfmt-async-bg", "dcp", "dcp-async",
          "dcp-async-bg", "torch")
OPS = ("snapshot", "save", "load", "reshard", "async")
METHOD_ORDER = ("memcpy", "floor", "raw", "shardfmt", "dcp", "torch.save", "torch.load", "shardfmt-async",
                "shardfmt-async-bg", "dcp-async", "dcp-async-bg")
TOLERATED = ("dcp", "dcp-async", "dcp-async-bg")  # DCP variants may fail on a torch build: recorded, not fatal

# ----------------------------------------------------------------------------- the state


def make_spec(size_mib: int, world: int, layers: int = 6) -> list[tuple[str, int, int, str]]:
    """[(fqn, rows, cols, dtype)]: bf16 weights + fp32 master/exp_avg/exp_avg_sq of ``layers`` layers.

    d is a multiple of 64 and of ``world``: every row and column count divides by the world,
    and every column count is even (the 1-rank resharded load takes the left half).
    """
    per_d2 = layers * 12 * (2 + 3 * 4)  # qkv 3d^2 + out d^2 + up 4d^2 + down 4d^2 = 12 d^2 elements
    step = 64 * world // math.gcd(64, world)
    d = max(step, int(math.sqrt(size_mib * MIB / per_d2)) // step * step)
    spec = []
    for layer in range(layers):
        for pname, (r, c) in (("attn.qkv", (3 * d, d)), ("attn.out", (d, d)), ("mlp.up", (4 * d, d)),
                              ("mlp.down", (d, 4 * d))):
            spec.append((f"model.layers.{layer}.{pname}.weight", r, c, "bfloat16"))
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                spec.append((f"optim.state.layers.{layer}.{pname}.{kind}", r, c, "float32"))
    return spec


def spec_bytes(spec) -> int:
    return sum(r * c * (2 if dt_ == "bfloat16" else 4) for _, r, c, dt_ in spec)


def gen(tid: int, r0: int, r1: int, c0: int, c1: int, dtype: str, device):
    """Element (i, j) of tensor ``tid`` = fl(fl(i*a) + fl(j*b)) + tid/2, cast: the same bits for any slice."""
    import torch

    rows = torch.arange(r0, r1, dtype=torch.float32, device=device).unsqueeze(1) * 0.0009765
    cols = torch.arange(c0, c1, dtype=torch.float32, device=device).unsqueeze(0) * 1.7071
    out = rows + cols
    out.add_(float(tid) * 0.5)
    return out.to(getattr(torch, dtype))


# ----------------------------------------------------------------------------- worker


class Bench:
    """One rank's state, targets and methods; ``run()`` does every round."""

    def __init__(self, rank: int, world: int, args: dict) -> None:
        import torch

        self.rank, self.world, self.a = rank, world, args
        self.dist = world > 1
        self.fsync = args["fsync"]
        self.cuda = args["device"] == "cuda"
        if self.cuda:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.sampler = RSSSampler()
        self.records: list[dict] = []
        self.failed: dict[str, str] = {}
        self.stager = None      # shardfmt.Stager, one per process, reused by every async save
        self.dcp_stager = None  # DCP's DefaultStager for the background-staging variant, likewise
        self.base = args["base"]
        self._build()

    def _build(self) -> None:
        import torch

        import shardfmt

        W, q, dev = self.world, self.rank, self.device
        t0 = time.perf_counter()
        self.spec = spec = make_spec(self.a["size_mib"], W)
        self.row0 = [q * r // W for _, r, _, _ in spec]
        self.locals = [gen(i, q * r // W, (q + 1) * r // W, 0, c, dt_, dev) for i, (_, r, c, dt_) in enumerate(spec)]
        nan = float("nan")
        # one flat NaN-filled buffer per tensor backs both the same-topology (r/W, c) and the
        # column (r, c/W) targets: they hold the same number of elements
        flat = [torch.empty(r * c // W, dtype=getattr(torch, dt_), device=dev).fill_(nan) for _, r, c, dt_ in spec]
        self.same = [f.view(r // W, c) for f, (_, r, c, _) in zip(flat, spec)]
        if self.dist:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard

            self.mesh = init_device_mesh(dev.type, (W,), mesh_dim_names=("dp",))
            self.state = self._dtensors(self.locals, Shard(0))
            self.same_state = self._dtensors(self.same, Shard(0))
            self.resh = [f.view(r, c // W) for f, (_, r, c, _) in zip(flat, spec)]
            self.resh_cols = [(q * c // W, (q + 1) * c // W) for _, _, c, _ in spec]
            self.resh_sf = self.resh_dcp = self._dtensors(self.resh, Shard(1))
        else:
            self.state = {f: t for (f, *_), t in zip(spec, self.locals)}
            self.same_state = {f: t for (f, *_), t in zip(spec, self.same)}
            self.resh = [torch.empty(r, c // 2, dtype=getattr(torch, dt_), device=dev).fill_(nan)
                         for _, r, c, dt_ in spec]
            self.resh_cols = [(0, c // 2) for _, _, c, _ in spec]
            self.resh_sf = {f: shardfmt.ShardedTensor(t, (r, c), (0, 0)) for (f, r, c, _), t in zip(spec, self.resh)}
            self.resh_dcp = None
        # pre-faulted destination of the memcpy bound (and the floors' bounce buffers on CUDA)
        self.host = ([torch.empty(t.shape, dtype=t.dtype, pin_memory=True).zero_() for t in self.locals]
                     if self.cuda else self.same)
        self.share = sum(t.numel() * t.element_size() for t in self.locals)
        self.stager = shardfmt.Stager()
        if self.cuda:
            torch.cuda.synchronize(dev)
        self.say(f"state {len(spec)} tensors, {spec_bytes(spec) / 1e9:.3f} GB total, {self.share / 1e9:.3f} GB on "
                 f"rank 0 ({dev}), built in {time.perf_counter() - t0:.1f}s")

    def _dtensors(self, tensors, placement) -> dict:
        import torch
        from torch.distributed.tensor import DTensor

        return {f: DTensor.from_local(t, self.mesh, [placement], run_check=False, shape=torch.Size((r, c)),
                                      stride=(c, 1)) for (f, r, c, _), t in zip(self.spec, tensors)}

    # ------------------------------------------------------------------ harness
    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def barrier(self) -> None:
        if self.dist:
            import torch.distributed as dist

            dist.barrier()

    def sync_device(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def measure(self, rnd: int, op: str, method: str, fn, *, nbytes: int | None = None) -> dict:
        """Barrier, ``fn()`` (its dict result is merged into the record), device sync, barrier."""
        gc.collect()
        malloc_trim()
        self.sync_device()
        if self.a.get("settle"):
            time.sleep(self.a["settle"])
        self.barrier()
        gc.disable()
        before = self.sampler.start()
        t0 = time.perf_counter()
        try:
            out = fn()
            self.sync_device()
            t_local = time.perf_counter() - t0
        finally:
            peak = self.sampler.stop()
            gc.enable()
        self.barrier()
        wall = time.perf_counter() - t0
        rec = {"kind": "op", "round": rnd, "op": op, "method": method, "rank": self.rank, "local_s": t_local,
               "wall_s": wall, "bytes": self.share if nbytes is None else nbytes, "rss_before": before,
               "rss_peak": peak, **(out if isinstance(out, dict) else {})}
        self.records.append(rec)
        extra = "".join(f"  {k.removesuffix('_s')} {rec[k]:.3f}s" for k in ("blocked_s", "staged_s") if rec.get(k))
        self.say(f"[round {rnd}] {op:<8} {method:<18} {wall:8.3f}s{extra}  rank0 RSS +{(peak - before) / MIB:.0f} MiB")
        return rec

    def fresh(self, name: str, *, make: bool) -> str:
        path = os.path.join(self.base, name)
        if self.rank == 0:
            remove(path)
            if make:
                os.makedirs(path)
        self.barrier()
        return path

    def cleanup(self, name: str) -> None:
        self.barrier()
        if self.rank == 0:
            remove(os.path.join(self.base, name))
        self.barrier()

    def check(self, tensors, what: str, *, resh: bool = False) -> None:
        """Rows 0, n/2 and n-1 of every tensor equal the formula, and no NaN is left anywhere."""
        import torch

        for i, ((fqn, _, c, dt_), t) in enumerate(zip(self.spec, tensors)):
            r0, (c0, c1) = (0, self.resh_cols[i]) if resh else (self.row0[i], (0, c))
            n = t.shape[0]
            bad = bool(torch.isnan(t).any())
            for k in sorted({0, n // 2, n - 1}):
                bad = bad or not torch.equal(t[k: k + 1], gen(i, r0 + k, r0 + k + 1, c0, c1, dt_, self.device))
            if bad:
                raise AssertionError(f"{what}: {fqn} differs from the saved data (rank {self.rank})")

    def load(self, rnd: int, op: str, method: str, ckpt: str, fn, *, resh: bool = False) -> None:
        """A cold, checked load: NaN-fill the targets, drop ``ckpt`` from the page cache, measure, check."""
        targets = self.resh if resh else self.same
        for t in targets:
            t.fill_(float("nan"))
        drop_cache(ckpt)
        self.measure(rnd, op, method, fn, nbytes=sum(t.numel() * t.element_size() for t in targets))
        self.check(targets, f"{op} {method} round {rnd}", resh=resh)

    def check_saved(self, ckpt: str, loader) -> None:
        """Load a checkpoint untimed into the same-topology targets and check them."""
        for t in self.same:
            t.fill_(float("nan"))
        self.barrier()
        loader(ckpt)
        self.sync_device()
        self.check(self.same, f"checkpoint {ckpt}")

    # ------------------------------------------------------------------ methods
    def memcpy(self) -> None:
        for h, t in zip(self.host, self.locals):
            h.copy_(t, non_blocking=self.cuda)

    def write_file(self, path: str, hashed: bool) -> None:
        from shardfmt.format.tensor_bytes import byte_view

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for h, t in zip(self.host, self.locals):
                if self.cuda:
                    h.copy_(t)  # synchronous D2H into the pinned buffer
                write_pieces(fd, byte_view(h if self.cuda else t), hashed=hashed)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read_file(self, path: str, hashed: bool) -> None:
        from shardfmt.format.tensor_bytes import byte_view

        fd = os.open(path, os.O_RDONLY)
        try:
            off = 0
            for h, t in zip(self.host, self.same):
                mv = byte_view(h if self.cuda else t)
                read_pieces(fd, mv, off, hashed=hashed, path=path)
                off += len(mv)
                if self.cuda:
                    t.copy_(h, non_blocking=True)
        finally:
            os.close(fd)

    def g_memcpy(self, rnd: int) -> None:
        self.measure(rnd, "snapshot", "memcpy", self.memcpy)

    def g_floor(self, rnd: int, name: str = "floor") -> None:
        d = self.fresh(name, make=True)
        path = os.path.join(d, f"rank_{self.rank}.bin")
        hashed = name == "floor"
        self.measure(rnd, "save", name, lambda: self.write_file(path, hashed))
        self.load(rnd, "load", name, d, lambda: self.read_file(path, hashed))

    def g_raw(self, rnd: int) -> None:
        self.g_floor(rnd, "raw")

    def g_shardfmt(self, rnd: int) -> None:
        import shardfmt

        path = self.fresh("shardfmt", make=False)
        self.measure(rnd, "save", "shardfmt", lambda: shardfmt.save(self.state, path, sync=self.fsync))

        def load(targets):
            rep = shardfmt.load(targets, path)
            return {"bytes_read": rep.bytes_read, "bytes_needed": rep.bytes_needed}

        self.load(rnd, "load", "shardfmt", path, lambda: load(self.same_state))
        self.load(rnd, "reshard", "shardfmt", path, lambda: load(self.resh_sf), resh=True)

    def g_sf_async(self, rnd: int, stage: str = "call") -> None:
        import shardfmt

        name = "shardfmt-async" if stage == "call" else "shardfmt-async-bg"
        path = self.fresh(name, make=False)

        def op() -> dict:
            t0 = time.perf_counter()
            h = shardfmt.async_save(self.state, path, sync=self.fsync, stager=self.stager, stage=stage)
            blocked = time.perf_counter() - t0
            h.wait_staged()
            staged = time.perf_counter() - t0
            h.wait()
            return {"blocked_s": blocked, "staged_s": staged, "sf_blocked_s": h.blocked_seconds,
                    "sf_staged_s": h.staged_seconds, "sf_total_s": h.total_seconds}

        self.measure(rnd, "async", name, op)
        if rnd == 1:
            self.check_saved(path, lambda p: shardfmt.load(self.same_state, p))

    def g_sf_async_bg(self, rnd: int) -> None:
        self.g_sf_async(rnd, "background")

    def dcp_load(self, targets, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(targets, storage_reader=dcp.FileSystemReader(path), no_dist=not self.dist)

    def g_dcp(self, rnd: int) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.fresh("dcp", make=True)
        self.measure(rnd, "save", "dcp", lambda: dcp.save(
            self.state, storage_writer=dcp.FileSystemWriter(path, sync_files=self.fsync), no_dist=not self.dist))
        self.load(rnd, "load", "dcp", path, lambda: self.dcp_load(self.same_state, path))

        def reshard() -> None:
            if self.resh_dcp is not None:
                self.dcp_load(self.resh_dcp, path)
                return
            self.dcp_load(self.same_state, path)  # 1 rank: the full tensors, then the half is copied out
            for h, f in zip(self.resh, self.same):
                h.copy_(f[:, : h.shape[1]])

        self.load(rnd, "reshard", "dcp", path, reshard, resh=True)

    def g_dcp_async(self, rnd: int, background: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        name = "dcp-async-bg" if background else "dcp-async"
        path = self.fresh(name, make=True)
        kw = {}
        if background:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            if self.dcp_stager is None:
                self.dcp_stager = DefaultStager(StagingOptions(
                    use_pinned_memory=self.cuda, use_shared_memory=False, use_async_staging=True,
                    use_non_blocking_copy=self.cuda))
            kw["async_stager"] = self.dcp_stager

        def op() -> dict:
            t0 = time.perf_counter()
            res = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(path, sync_files=self.fsync),
                                 no_dist=not self.dist, **kw)
            blocked = time.perf_counter() - t0
            staging = getattr(res, "staging_completion", None)  # AsyncSaveResponse with an async stager
            if staging is not None:
                staging.result()
            staged = time.perf_counter() - t0
            getattr(res, "upload_completion", res).result()
            return {"blocked_s": blocked, "staged_s": staged}

        self.measure(rnd, "async", name, op)
        if rnd == 1:
            self.check_saved(path, lambda p: self.dcp_load(self.same_state, p))

    def g_dcp_async_bg(self, rnd: int) -> None:
        self.g_dcp_async(rnd, background=True)

    def g_torch(self, rnd: int) -> None:
        import torch

        d = self.fresh("torch", make=True)
        path = os.path.join(d, f"rank_{self.rank}.pt")

        def save() -> None:
            with open(path, "wb") as f:
                torch.save({fqn: t for (fqn, *_), t in zip(self.spec, self.locals)}, f)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())

        def load() -> None:
            got = torch.load(path, weights_only=True, mmap=False, map_location=self.device)
            for (fqn, *_), t in zip(self.spec, self.same):
                t.copy_(got[fqn])

        self.measure(rnd, "save", "torch.save", save)
        self.load(rnd, "load", "torch.load", d, load)

    # ------------------------------------------------------------------ rounds
    def run(self) -> None:
        fns = {"memcpy": self.g_memcpy, "floor": self.g_floor, "raw": self.g_raw, "shardfmt": self.g_shardfmt,
               "shardfmt-async": self.g_sf_async, "shardfmt-async-bg": self.g_sf_async_bg, "dcp": self.g_dcp,
               "dcp-async": self.g_dcp_async, "dcp-async-bg": self.g_dcp_async_bg, "torch": self.g_torch}
        groups = [g for g in GROUPS if g in self.a["methods"]]
        for rnd in range(1, self.a["rounds"] + 1):
            self.records.append({"kind": "rss", "round": rnd, "rank": self.rank, "rss": self.sampler.rss()})
            for g in rotate(groups, rnd - 1):
                if g in self.failed:
                    continue
                try:
                    fns[g](rnd)
                except Exception as e:
                    if g not in TOLERATED:
                        raise
                    self.failed[g] = f"{type(e).__name__}: {e}"
                    self.records.append({"kind": "error", "group": g, "round": rnd, "rank": self.rank,
                                         "error": self.failed[g], "trace": traceback.format_exc()})
                    self.say(f"[round {rnd}] {g} FAILED (recorded, skipped from now on): {self.failed[g][:300]}")
                self.cleanup(g)
        self.records.append({"kind": "rss", "round": self.a["rounds"] + 1, "rank": self.rank,
                             "rss": self.sampler.rss()})
        if self.dcp_stager is not None:
            self.dcp_stager.close()
        self.stager.release()

    def env(self) -> dict:
        import torch

        name = torch.cuda.get_device_name(self.device) if self.cuda else platform.processor() or "cpu"
        if not self.cuda:
            try:
                with open("/proc/cpuinfo") as f:
                    name = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
            except (OSError, StopIteration):
                pass
        return {"kind": "env", "rank": self.rank, "device": str(self.device), "device_name": name,
                "torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads()}


def worker_main(argv: list[str]) -> None:
    _job, rank, world, port, raw = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    args = json.loads(raw)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=args["pg_timeout"]))
    bench = None
    try:
        bench = Bench(rank, world, args)
        bench.records.append(bench.env())
        bench.run()
        result = {"ok": True, "records": bench.records}
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which fails the run
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "records": bench.records if bench else []}
        print(f"rank {rank} FAILED: {traceback.format_exc()}", file=sys.stderr, flush=True)
    with open(os.path.join(args["out_dir"], f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


# ----------------------------------------------------------------------------- summary


def summarize(records: list[dict], rounds: int) -> dict:
    """Per (op, method): per-round figures (max over ranks) and medians over the judged rounds."""
    judged = list(range(2, rounds + 1)) or [1]
    rows = []
    keys = []
    for r in records:
        if r["kind"] == "op" and (r["op"], r["method"]) not in keys:
            keys.append((r["op"], r["method"]))
    keys.sort(key=lambda k: (OPS.index(k[0]), METHOD_ORDER.index(k[1])))
    for op, method in keys:
        rs = [r for r in records if r["kind"] == "op" and r["op"] == op and r["method"] == method]
        per_round = {}
        for k in sorted({r["round"] for r in rs}):
            mine = [r for r in rs if r["round"] == k]
            fig = {f: max(r[f] for r in mine) for f in ("wall_s", "local_s", "blocked_s", "staged_s")
                   if all(r.get(f) is not None for r in mine)}
            fig["rss_growth"] = max(r["rss_peak"] - r["rss_before"] for r in mine)
            per_round[k] = fig
        med = {f: statistics.median(per_round[k][f] for k in judged if k in per_round)
               for f in per_round[min(per_round)] if any(k in per_round for k in judged)}
        # the memcpy bound: the slowest rank's own copy time (no barrier latency), like "blocked"
        sec = med.get("local_s" if method == "memcpy" else "wall_s")
        nbytes = sum(r["bytes"] for r in rs if r["round"] == rs[0]["round"])
        rows.append({"op": op, "method": method, "bytes": nbytes, "seconds": sec, "median": med,
                     "gbps": nbytes / sec / 1e9 if sec else None, "per_round": per_round,
                     "rss_growth_round1": per_round.get(1, {}).get("rss_growth"),
                     "rss_growth_later_max": max((per_round[k]["rss_growth"] for k in per_round if k > 1),
                                                 default=None)})
    return {"rows": rows, "judged_rounds": judged}


def find(summary, op, method):
    return next((r for r in summary["rows"] if r["op"] == op and r["method"] == method), None)


def targets_of(summary) -> list[dict]:
    mem, asy = find(summary, "snapshot", "memcpy"), find(summary, "async", "shardfmt-async")
    sync, wfl = find(summary, "save", "shardfmt"), find(summary, "save", "floor")
    load, rfl = find(summary, "load", "shardfmt"), find(summary, "load", "floor")
    out = []

    def add(name, ok_if, parts, value_fn, fmt):
        if any(p is None for p in parts):
            out.append({"target": name, "pass": None, "shown": "n/a (a method did not run)"})
            return
        v = value_fn()
        out.append({"target": name, "value": v, "pass": ok_if(v), "shown": fmt(v)})

    add("async save blocks the caller <= 1.5x the pre-faulted memcpy of the rank's state", lambda v: v <= 1.5,
        (mem, asy), lambda: asy["median"]["blocked_s"] / mem["seconds"],
        lambda v: f"{v:.2f}x ({asy['median']['blocked_s']:.3f}s vs memcpy {mem['seconds']:.3f}s)")
    add("total async save time <= shardfmt's sync save + 1.0x that memcpy", lambda v: v <= 1.0,
        (mem, asy, sync), lambda: (asy["seconds"] - sync["seconds"]) / mem["seconds"],
        lambda v: f"(total - sync) = {v:.2f}x memcpy ({asy['seconds']:.3f}s vs {sync['seconds']:.3f}s"
                  f" + {mem['seconds']:.3f}s)")
    add("sync save >= 0.9x the write floor (throughput)", lambda v: v >= 0.9, (sync, wfl),
        lambda: wfl["seconds"] / sync["seconds"], lambda v: f"{v:.3f}x")
    add("same-topology load >= 0.9x the read floor (throughput)", lambda v: v >= 0.9, (load, rfl),
        lambda: rfl["seconds"] / load["seconds"], lambda v: f"{v:.3f}x")
    return out


def print_report(summary, targets, meta, errors) -> None:
    judged = summary["judged_rounds"]
    rj = f"rounds {judged[0]}..{judged[-1]}" if len(judged) > 1 else f"round {judged[0]}"
    mem = find(summary, "snapshot", "memcpy")
    sync = find(summary, "save", "shardfmt")
    print(f"\n{meta['machine']}\nstate {meta['state_bytes'] / 1e9:.3f} GB in {meta['tensors']} tensors on "
          f"{meta['ranks']} rank(s), device {meta['device']}, fsync {'on' if meta['fsync'] else 'off'}, "
          f"scratch {meta['scratch_fs']}; medians over {rj} (round 1 shown apart)")
    print("time = slowest rank's barrier-to-barrier seconds (memcpy, blocked, staged: slowest rank's own time); "
          "x floor = floor time / time (load and reshard: GB/s / read floor's GB/s)")
    hdr = f"{'op':<9}{'method':<19}{'median s':>9}{'GB/s':>8}{'x floor':>9}{'round 1':>9}  per round (s)"
    print(hdr + "\n" + "-" * (len(hdr) + 20))
    for r in summary["rows"]:
        if r["op"] == "async":
            continue
        fl = find(summary, "load" if r["op"] == "reshard" else r["op"], "floor")
        xf = "-"
        if fl and r["seconds"] and r["method"] != "floor" and r["op"] != "snapshot":
            xf = f"{r['gbps'] / fl['gbps']:.3f}"
        key = "local_s" if r["method"] == "memcpy" else "wall_s"
        runs = " ".join(f"{v[key]:.3f}" for v in r["per_round"].values())
        print(f"{r['op']:<9}{r['method']:<19}{r['seconds']:9.3f}{r['gbps']:8.2f}{xf:>9}"
              f"{r['per_round'].get(1, {}).get(key, float('nan')):9.3f}  {runs}")
    if "dcp" in errors:
        for op in ("save", "load", "reshard"):
            if find(summary, op, "dcp") is None:
                print(f"{op:<9}{'dcp':<19}  n/a (error: {errors['dcp'][:160]})")
    print("\nasync saves: blocked = the call; staged = until the snapshot is complete; total = until committed")
    hdr = (f"{'method':<19}{'blocked s':>10}{'x memcpy':>9}{'staged s':>9}{'total s':>9}{'(tot-sync)':>11}"
           f"{'RSS+ r1':>9}{'RSS+ r2..':>10}  blocked / total per round (s)")
    print(hdr + "\n" + "-" * (len(hdr) + 10))
    for name in ("shardfmt-async", "shardfmt-async-bg", "dcp-async", "dcp-async-bg"):
        r = find(summary, "async", name)
        if r is None:
            print(f"{name:<19}  n/a" + (f" (error: {errors[name][:160]})" if name in errors else " (not run)"))
            continue
        m = r["median"]
        if "blocked_s" not in m:  # failed after round 1: nothing in the judged rounds
            print(f"{name:<19}  n/a" + (f" (error: {errors[name][:160]})" if name in errors else ""))
            continue
        xm = f"{m['blocked_s'] / mem['seconds']:.2f}" if mem else "-"
        ts = f"{(r['seconds'] - sync['seconds']) / mem['seconds']:.2f}x" if mem and sync else "-"
        later = r["rss_growth_later_max"]
        runs = " ".join(f"{v['blocked_s']:.3f}/{v['wall_s']:.3f}" for v in r["per_round"].values())
        print(f"{name:<19}{m['blocked_s']:10.3f}{xm:>9}{m['staged_s']:9.3f}{r['seconds']:9.3f}{ts:>11}"
              f"{r['rss_growth_round1'] / MIB:8.0f}M{'-' if later is None else f'{later / MIB:.0f}M':>10}  {runs}")
    print("(tot-sync) = (async total - shardfmt sync save) / memcpy; RSS+ = peak RSS growth during the save, "
          "max over ranks, round 1 and the worst later round")
    rss = meta["rss_by_round"]
    print("process RSS at each round's start (MiB, max over ranks): "
          + " ".join(f"{'end' if k > meta['rounds'] else f'r{k}'} {v / MIB:.0f}" for k, v in sorted(rss.items())))
    print("\ntargets (" + rj + "):")
    for t in targets:
        flag = "n/a " if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        print(f"  {flag}  {t['target']:<82} {t['shown']}")


# ----------------------------------------------------------------------------- driver


def default_scratch_parent() -> str:
    parent = os.path.dirname(ROOT)
    return parent if os.access(parent, os.W_OK) else tempfile.gettempdir()


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="processes (default 2 on cpu, 1 on cuda)")
    p.add_argument("--size-mib", type=int, default=None, help="whole state in MiB, split over the ranks (3072)")
    p.add_argument("--rounds", type=int, default=None, help="rounds; targets judge rounds 2..N (default 5)")
    p.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="make every save durable (default on; --no-fsync to disable)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the state lives (cuda: ranks share cuda:0 when only one GPU exists)")
    p.add_argument("--methods", default=",".join(GROUPS), help=f"comma list of method groups (default all: "
                                                               f"{','.join(GROUPS)})")
    p.add_argument("--quick", action="store_true", help="smoke test: 128 MiB, 2 rounds (unless given)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir next to the repository)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds every rank waits before each measured op, so each starts from the same "
                        "memory state (a VM that hands freed memory back to its host makes the next op's "
                        "first touches slow, depending on what ran before; default 0)")
    p.add_argument("--json", default=None, help="write the raw per-round per-rank figures and the summary here")
    p.add_argument("--job-timeout", type=float, default=7200.0, help="seconds before the ranks are killed")
    args = p.parse_args(argv)
    size = args.size_mib or (128 if args.quick else 3072)
    rounds = args.rounds or (2 if args.quick else 5)
    ranks = args.ranks or (1 if args.device == "cuda" else 2)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(GROUPS))
    if unknown or ranks < 1 or rounds < 1:
        p.error(f"unknown method groups {unknown}" if unknown else "--ranks and --rounds must be >= 1")
    if args.dir is not None and not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir}: not an existing directory")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: no CUDA device is available (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda}); run on a machine with a GPU or use --device cpu", file=sys.stderr)
        return 2
    spec = make_spec(size, ranks)
    own = args.dir is None
    scratch = tempfile.mkdtemp(prefix="shardfmt-run-", dir=args.dir or default_scratch_parent())
    free = shutil.disk_usage(scratch).free
    kind = fs_type(scratch)
    print(f"state: {len(spec)} tensors, {spec_bytes(spec) / 1e9:.3f} GB; {ranks} rank(s) on {args.device}; "
          f"{rounds} rounds; fsync {'on' if args.fsync else 'off'}; scratch {scratch} ({kind}, "
          f"{free / 1e9:.0f} GB free)", flush=True)
    if kind in ("tmpfs", "ramfs"):
        print("WARNING: the scratch directory is in memory: fsync and cold loads mean nothing; use --dir", flush=True)
    if free < 1.5 * spec_bytes(spec):
        print("WARNING: less free disk than 1.5x the state: saves may fail", flush=True)
    code0, load0, t0 = code_fingerprint(), os.getloadavg()[0], time.perf_counter()
    wargs = {"size_mib": size, "rounds": rounds, "fsync": args.fsync, "device": args.device, "methods": methods,
             "settle": args.settle,
             "base": os.path.join(scratch, "ckpt"), "pg_timeout": max(900.0, args.job_timeout / 2)}
    os.makedirs(wargs["base"])
    try:
        records = launch(__file__, "run", ranks, wargs, os.path.join(scratch, "logs"), args.job_timeout)
    except RuntimeError as e:
        print(f"\nFAILED: {e}\n(logs in {os.path.join(scratch, 'logs')})", file=sys.stderr)
        remove(wargs["base"])
        return 2
    remove(wargs["base"])
    if own:
        shutil.rmtree(scratch, ignore_errors=True)
    code1 = code_fingerprint()
    env = next(r for r in records if r["kind"] == "env")
    errors = {}
    for r in records:
        if r["kind"] == "error":
            errors.setdefault(r["group"], r["error"])
    rss_by_round: dict[int, int] = {}
    for r in records:
        if r["kind"] == "rss":
            rss_by_round[r["round"]] = max(rss_by_round.get(r["round"], 0), r["rss"])
    summary = summarize(records, rounds)
    targets = targets_of(summary)
    import shardfmt

    meta = {"argv": sys.argv[1:], "ranks": ranks, "size_mib": size, "rounds": rounds, "fsync": args.fsync,
            "device": args.device, "device_name": env["device_name"], "state_bytes": spec_bytes(spec),
            "tensors": len(spec), "methods": methods, "scratch_fs": kind, "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": env["torch"], "cuda": env["cuda"],
            "shardfmt": shardfmt.__version__, "code_before": code0, "code_after": code1,
            "load_avg_before": load0, "load_avg_after": os.getloadavg()[0], "rss_by_round": rss_by_round,
            "machine": f"machine: {os.cpu_count()} CPUs, {env['device_name']}; python {platform.python_version()}, "
                       f"torch {env['torch']}" + (f" (CUDA {env['cuda']})" if env["cuda"] else "")
                       + f", shardfmt {shardfmt.__version__}"}
    if args.json:  # before the report: a figure the report cannot print is still kept
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "targets": targets, "errors": errors,
                       "records": records}, f, indent=1)
    print_report(summary, targets, meta, errors)
    wall = time.perf_counter() - t0
    print(f"\nwall {wall:.0f}s; load average before {load0:.2f}, after {meta['load_avg_after']:.2f} "
          "(the machine may be shared: a high value means noisy figures)")
    if code1 != code0:
        print(f"WARNING: shardfmt/reshard sources changed during the run ({code0} -> {code1})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "targets": targets, "errors": errors,
                       "records": records, "wall_s": wall}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(t["pass"] is not False for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
