"""Worker jobs for the multi-process tests: ``python -m tests.distributed.workers JOB RANK WORLD PORT ARGS``."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import shardfmt
from shardfmt.layout.topology import Mesh
from shardfmt.saving.options import SaveOptions, Seams
from tests.distributed.model import check_state, rank_state, specs, truth

JOBS = {}


def job(fn):
    JOBS[fn.__name__] = fn
    return fn


def _dtensor_targets(mesh, placements_for, fill=7.0):
    """DTensor targets on ``mesh`` for every spec (all stages), distributed from a sentinel."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for s in specs():
        full = torch.full(s.shape, fill).to(s.dtype) if s.shape else torch.tensor(fill).to(s.dtype)
        out[s.fqn] = distribute_tensor(full, mesh, placements_for(s))
    return out


def _check_dtensors(state) -> list[str]:
    bad = []
    by_name = {s.fqn: s for s in specs()}
    for fqn, v in state.items():
        s = by_name[fqn]
        full = v.full_tensor()  # torch's own redistribution: an independent check of the layout
        if not torch.equal(full.view(torch.uint8) if full.dim() else full, truth(fqn, s.shape, s.dtype).view(torch.uint8)
                           if full.dim() else truth(fqn, s.shape, s.dtype)):
            bad.append(fqn)
    return bad


@job
def save3d(rank, world, args):
    mesh = Mesh.parse("pp=2,dp=2,tp=2")
    state = rank_state(mesh, rank)
    state["optim.param_groups"] = [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}]
    state["step"] = 100
    state["rng"] = shardfmt.PerRank({"rank": rank, "seed": 1000 + rank})
    shardfmt.save(state, args["path"], step=100, mesh={"pp": 2, "dp": 2, "tp": 2}, check_replicas=True,
                  timeout=dt.timedelta(seconds=60))
    # same-topology load of what we just saved
    back = rank_state(mesh, rank, empty=True)
    back.update({"optim.param_groups": None, "step": None, "rng": shardfmt.PerRank(None)})
    rep = shardfmt.load(back, args["path"])
    bad = check_state(back)
    needed = sum(v.local.numel() * v.local.element_size() for k, v in back.items()
                 if isinstance(v, shardfmt.ShardedTensor))
    return {"bad": bad, "rng": back["rng"].value, "step": back["step"],
            "betas": list(back["optim.param_groups"][0]["betas"]),
            "bytes_read": rep.bytes_read, "needed": needed}


@job
def savefsdp(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    state = {}
    for s in specs():
        t = truth(s.fqn, s.shape, s.dtype)
        place = [Shard(0)] if s.shape else [Replicate()]
        state[s.fqn] = distribute_tensor(t, mesh, place)
    # disjoint ranges per rank: FSDP2-over-TP's strided sharding on a 1-d mesh
    # (split with torch's own _StridedShard code, so the layout is torch's, not ours)
    from torch.distributed.tensor import DTensor

    full = truth("extra.strided", (50, 8))
    placement = _StridedShard(0, split_factor=2)
    pieces, _ = placement._split_tensor(full, world, with_padding=False, contiguous=True)
    state["extra.strided"] = DTensor.from_local(pieces[rank], mesh, [placement], shape=full.shape,
                                                stride=full.stride(), run_check=False)
    shardfmt.save(state, args["path"], step=5, mesh={"dp": world}, timeout=dt.timedelta(seconds=60))
    return {"bad": []}


def _load_ckpt3d_sharded(mesh, rank, path, split="tp"):
    targets = rank_state(mesh, rank, split=split, empty=True)
    shardfmt.load(targets, path, strict=True)
    return check_state(targets), len(targets)


@job
def load2(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    out["tp2"] = _load_ckpt3d_sharded(Mesh.parse("tp=2"), rank, args["ckpt3d"])
    out["pp2"] = _load_ckpt3d_sharded(Mesh.parse("pp=2"), rank, args["ckpt3d"])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for name in ("ckpt3d", "fsdp"):
        targets = _dtensor_targets(mesh, lambda s: [Shard(0)] if s.shape else [Replicate()])
        shardfmt.load(targets, args[name], strict=True)
        out[f"dtensor_dp2_{name}"] = (_check_dtensors(targets), len(targets))
    out.update(_direct_reads_by_placement(mesh, args["out_dir"]))
    return out


def _direct_reads_by_placement(mesh, out_dir: str) -> dict:
    """Large reads of bytes only this rank needs (rows: Shard(0)) go around the page cache
    (O_DIRECT) and leave nothing cached; bytes both ranks read stay in the cache for the other
    (``LoadReport.cached``): Replicate, and columns (Shard(1)), whose rows each rank reads whole
    to take its half (dropping them as read made the other rank read them from the disk again)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(2 << 20, dtype=torch.float32).reshape(1024, 2048)  # 8 MiB: 4 MiB a rank
    path = os.path.join(out_dir, "direct_reads")
    # 4 MiB hash chunks: a column slice's reads are then as large as a row slice's (direct-sized)
    shardfmt.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, path, chunk_size=4 << 20)
    real, opened = os.open, []

    def spy(p, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0) and not flags & (os.O_WRONLY | os.O_RDWR):
            opened.append(p)
        return real(p, flags, *a, **k)

    out = {}
    os.open = spy
    try:
        for label, placement in (("shard", Shard(0)), ("replicate", Replicate()), ("columns", Shard(1))):
            opened.clear()
            target = {"w": distribute_tensor(torch.zeros_like(full), mesh, [placement])}
            report = shardfmt.load(target, path)
            bad = [] if torch.equal(target["w"].full_tensor(), full) else ["w"]
            if hasattr(os, "O_DIRECT") and bool(opened) != (label == "shard"):
                bad.append(f"O_DIRECT opens {len(opened)}")
            if bool(report.cached) == (label == "shard"):  # what both ranks read stays cached for the other
                bad.append(f"left cached: {report.cached}")
            shardfmt.api.release_cached(report.source, report.cached)
            out[f"direct_reads_{label}"] = (bad, 1)
    finally:
        os.open = real
    return out


@job
def load3(rank, world, args):
    out = {"rows3_ckpt3d": _load_ckpt3d_sharded(Mesh.parse("x=3"), rank, args["ckpt3d"], split="rows"),
           "rows3_fsdp": _load_ckpt3d_sharded(Mesh.parse("x=3"), rank, args["fsdp"], split="rows")}
    targets = {"extra.strided": shardfmt.ShardedTensor(torch.zeros(17, 8) if rank < 2 else torch.zeros(16, 8),
                                                       (50, 8), (17 * rank, 0))}
    shardfmt.load(targets, args["fsdp"], strict=False)
    want = truth("extra.strided", (50, 8))[17 * rank: 17 * rank + targets["extra.strided"].local.shape[0]]
    out["strided_rows3"] = ([] if torch.equal(targets["extra.strided"].local, want) else ["extra.strided"], 1)
    return out


@job
def load4(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {"tp4": _load_ckpt3d_sharded(Mesh.parse("tp=4"), rank, args["ckpt3d"])}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))

    def grid(s):
        if len(s.shape) >= 2:
            return [Shard(0), Shard(1)]
        return [Shard(0), Replicate()] if s.shape else [Replicate(), Replicate()]

    def strided(s):
        return [_StridedShard(0, split_factor=2), Shard(0)] if s.shape else [Replicate(), Replicate()]

    for name in ("ckpt3d", "fsdp"):
        for label, fn in (("grid", grid), ("strided", strided)):
            targets = _dtensor_targets(mesh, fn)
            shardfmt.load(targets, args[name], strict=True)
            out[f"{label}_{name}"] = (_check_dtensors(targets), len(targets))
    return out


@job
def faulty_save(rank, world, args):
    from tests.distributed import faulty_fs

    faulty_fs.register()
    os.environ["RANK"] = str(rank)
    state = {"w": shardfmt.ShardedTensor(torch.full((64, 64), float(rank)), (128, 64), (64 * rank, 0)),
             "b": torch.ones(8)}
    t0 = time.monotonic()
    try:
        shardfmt.save(state, args["path"], timeout=dt.timedelta(seconds=args.get("timeout", 20)))
    except shardfmt.errors.ShardfmtError as e:
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


@job
def save_errors(rank, world, args):
    """Errors on one rank or in the state: every rank raises the same typed error, none hangs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    out = {}
    td = dt.timedelta(seconds=30)

    def attempt(label, state, **kw):
        try:
            shardfmt.save(state, os.path.join(args["root"], label), timeout=td, **kw)
            out[label] = None
        except shardfmt.errors.ShardfmtError as e:
            out[label] = [type(e).__name__, str(e)]

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    attempt("partial", {"p": DTensor.from_local(torch.ones(4), mesh, [Partial()])})
    attempt("replicas", {"w": torch.full((4,), float(rank)), "ok": torch.ones(2)}, check_replicas=True)
    attempt("values", {"w": torch.ones(2), "lr": 0.1 * (rank + 1)}, check_replicas=True)

    class Opaque:
        pass

    attempt("one_rank_bad_value", {"w": torch.ones(2), "x": Opaque() if rank == 1 else 1})
    attempt("bad_mesh", {"w": torch.ones(2)}, mesh={"dp": world + 1})
    # per-rank values on another world size: saved by this 2-rank job, loaded "as" 1 rank
    shardfmt.save({"rng": shardfmt.PerRank(rank)}, os.path.join(args["root"], "perrank"), timeout=td)
    return out


@job
def save_disagree(rank, world, args):
    """Ranks that disagree on what they save: every rank's outcome (error or None) and warnings.

    Rank 0 names paths relative to the root (its working directory), the others absolute: the
    same location either way. ``async`` runs the async path and the Checkpointer instead."""
    import warnings

    root = args["root"]
    os.chdir(root)
    td = dt.timedelta(seconds=30)
    out = {}

    def here(name):
        return name if rank == 0 else os.path.join(root, name)

    def attempt(label, run):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run()
                raised = None
            except shardfmt.errors.ShardfmtError as e:
                raised = [type(e).__name__, str(e)]
        out[label] = {"raised": raised, "warnings": [str(w.message) for w in caught]}

    state = {"w": shardfmt.ShardedTensor(torch.full((4,), float(rank)), (4 * world,), (4 * rank,)),
             "norm": torch.ones(3), "lr": 0.1, "cfg": {"layers": [1, 2], "name": "x"}}
    if args.get("async"):
        ck = shardfmt.Checkpointer(here("ck_async"), timeout=td)
        attempt("async_steps", lambda: shardfmt.async_save(state, here("async_steps"), step=400 - rank,
                                                           stager=shardfmt.Stager(), timeout=td).wait())
        rows = {"rows": RowShard(rank, world, 1)}
        attempt("ckpt_async_steps", lambda: ck.save(400 - rank, rows, async_=True).wait())
        attempt("ckpt_sync_steps", lambda: shardfmt.Checkpointer(here("ck_sync"), timeout=td).save(400 - rank, rows))
        return out
    attempt("steps", lambda: shardfmt.save(state, here("steps"), step=400 - rank, timeout=td))
    attempt("step_none", lambda: shardfmt.save(state, here("step_none"), step=None if rank else 7, timeout=td))
    attempt("paths", lambda: shardfmt.save(state, here(f"paths_{rank}"), step=1, timeout=td))
    attempt("loader", lambda: shardfmt.save({**state, "loader": {"pos": rank, "epoch": 0}}, here("loader"),
                                            step=1, timeout=td))
    attempt("per_rank", lambda: shardfmt.save({**state, "loader": shardfmt.PerRank({"pos": rank, "epoch": 0})},
                                              here("per_rank"), step=1, timeout=td))
    attempt("only_rank1", lambda: shardfmt.save({**state, **({"extra": 5} if rank else {})}, here("only_rank1"),
                                                step=1, timeout=td))
    attempt("strict", lambda: shardfmt.save({**state, "loader": {"pos": rank}}, here("strict"), step=1,
                                            timeout=td, check_replicas=True))
    return out


def _train_state(seed=0):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    if dist.get_world_size() > 1:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sampler = shardfmt.ResumableSampler(100, seed=5)
    return {"model": model, "optim": opt, "sched": sched, "sampler": sampler}


@job
def ckpt_save(rank, world, args):
    """Drill b, first half: train 5 steps on this world size and save."""
    state = _train_state()
    ids = []
    it = iter(state["sampler"])
    for _ in range(5):
        batch = [next(it) for _ in range(4)]
        ids.extend(batch)
        x = torch.randn(4, 8)
        loss = state["model"](x).pow(2).mean()
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        state["sched"].step()
        state["sampler"].advance(4)
    shardfmt.Checkpointer(args["root"]).save(5, state)
    inner = state["model"].module if hasattr(state["model"], "module") else state["model"]
    exp_avg = state["optim"].state[inner.weight]["exp_avg"]
    return {"ids": ids, "lr": state["sched"].get_last_lr()[0], "exp_avg": exp_avg.flatten().tolist()}


@job
def ckpt_restore(rank, world, args):
    """Drill b, second half: restore on another world size and read the rest of the epoch."""
    import warnings

    state = _train_state(seed=99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = shardfmt.Checkpointer(args["root"]).restore(state)
    inner = state["model"].module if hasattr(state["model"], "module") else state["model"]
    exp_avg = state["optim"].state[inner.weight]["exp_avg"]
    return {"step": step, "ids": list(state["sampler"]), "lr": state["sched"].get_last_lr()[0],
            "exp_avg": exp_avg.flatten().tolist(), "warnings": [str(w.message) for w in caught]}


class RowShard:
    """A user object holding this rank's rows of a matrix (only this rank reads them back)."""

    def __init__(self, rank, world, fill):
        self.rank, self.world = rank, world
        self.local = torch.full((64, 256), float(fill))

    def state_dict(self):
        return {"w": shardfmt.ShardedTensor(self.local, (64 * self.world, 256), (64 * self.rank, 0))}

    def load_state_dict(self, sd):
        pass  # filled in place


@job
def ckpt_torn(rank, world, args):
    """Drill c: step 1 saved; during step 2's save every rank dies after writing its file."""
    import signal

    import shardfmt.saving.protocol as P
    import shardfmt.saving.writer as W

    ck = shardfmt.Checkpointer(args["root"])
    ck.save(1, {"rows": RowShard(rank, world, 1)})

    def dying(orig):
        def wrapped(*a, **k):
            out = orig(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapped

    P.write_shard_file = dying(P.write_shard_file)
    W.write_shard_file = dying(W.write_shard_file)
    if args.get("async"):
        h = ck.save(2, {"rows": RowShard(rank, world, 2)}, async_=True)
        assert ck.latest().endswith("step_000000001")  # in flight: not the latest
        h.wait()  # the background thread kills the process before this returns
    else:
        ck.save(2, {"rows": RowShard(rank, world, 2)})
    return {}


@job
def ckpt_two_steps(rank, world, args):
    ck = shardfmt.Checkpointer(args["root"])
    ck.save(1, {"rows": RowShard(rank, world, 1)})
    ck.save(2, {"rows": RowShard(rank, world, 2)})
    return {}


@job
def ckpt_restore_rows(rank, world, args):
    import warnings

    rows = RowShard(rank, world, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = shardfmt.Checkpointer(args["root"]).restore({"rows": rows})
    return {"step": step, "value": rows.local[0, 0].item(), "warnings": [str(w.message) for w in caught]}


@job
def async_save2(rank, world, args):
    """Async saves of DTensor/ShardedTensor/replicated/PerRank state while training collectives run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    full = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    rows = 64 // world
    state = {"w": DTensor.from_local(full[rank * rows:(rank + 1) * rows].clone(), mesh, [Shard(0)]),
             "s": shardfmt.ShardedTensor(torch.full((4, 8), float(rank)), (4 * world, 8), (4 * rank, 0)),
             "norm": torch.ones(16), "rng": shardfmt.PerRank(rank * 10), "lr": 0.5}
    stager = shardfmt.Stager()
    h = shardfmt.async_save(state, args["path"], step=1, stager=stager, timeout=dt.timedelta(seconds=60))
    # The training thread goes on: in-place updates and collectives on the default group, while
    # the background save runs its own collectives on its own group.
    for _ in range(20):
        x = torch.ones(1000)
        dist.all_reduce(x)
        assert x[0].item() == world
        state["w"].to_local().add_(1.0)
        state["norm"].mul_(3.0)
    m = h.wait()
    # skip policy: rank 0 holds its commit, so every rank is still busy; all ranks skip together
    hold = {"on": True}

    def slow_commit(name):
        if hold["on"] and name == "files_written":
            time.sleep(1.5)
    h2 = shardfmt.async_save(state, args["path"] + "_b", stager=stager,
                            options=SaveOptions(_seams=Seams(on_step=slow_commit)))
    time.sleep(0.3)
    h3 = shardfmt.async_save(state, args["path"] + "_c", stager=stager, policy="skip")
    hold["on"] = False
    h2.wait()
    h4 = shardfmt.async_save(state, args["path"] + "_d", stager=stager, policy="skip", stage="background")
    h4.wait_staged()
    h4.wait()
    return {"step": m.step, "skipped": [h2.skipped, h3.skipped, h4.skipped],
            "blocked": h.blocked_seconds, "total": h.total_seconds}


@job
def async_snapshot_fails_on_one_rank(rank, world, args):
    """Rank 1's snapshot copy fails; its only piece is replicated and written by rank 0. Every
    rank's save must still fail, fast, naming rank 1, and nothing is committed."""
    from shardfmt.saving.stager import StagedCopy

    if rank == 1:
        orig = StagedCopy.run

        def broken(self):
            self._sources = [torch.ones(7) for _ in self._sources]  # copy_ fails: shapes differ
            return orig(self)

        StagedCopy.run = broken
    t0 = time.monotonic()
    h = shardfmt.async_save({"norm": torch.ones(1000)}, args["path"], stager=shardfmt.Stager(),
                            check_replicas=args["check_replicas"], timeout=dt.timedelta(seconds=60))
    try:
        h.wait()
        outcome = "committed"
    except shardfmt.errors.StateDictError as e:
        outcome = str(e)
    return {"outcome": outcome, "seconds": time.monotonic() - t0}


def _fsdp_state(seed, world):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _full_params(model):
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).flatten().tolist()
    return out


@job
def fsdp_save(rank, world, args):
    model, opt = _fsdp_state(0, world)
    for _ in range(3):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    shardfmt.Checkpointer(args["root"]).save(3, {"model": model, "optim": opt})
    return {"params": _full_params(model)}


@job
def fsdp_restore(rank, world, args):
    model, opt = _fsdp_state(1, world)
    step = shardfmt.Checkpointer(args["root"]).restore({"model": model, "optim": opt})
    return {"step": step, "params": _full_params(model)}


def _fsdp_step(model, opt, i):
    """One training step on batch ``i`` (the same on every rank)."""
    opt.zero_grad()
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
    opt.step()


@job
def fsdp_helpers_save(rank, world, args):
    """The plain API under FSDP2: train 3 steps, save get_state_dict's state, then take step 4."""
    model, opt = _fsdp_state(0, world)
    for i in range(3):
        _fsdp_step(model, opt, i)
    shardfmt.save(shardfmt.get_state_dict(model, opt), args["path"], timeout=dt.timedelta(seconds=60))
    _fsdp_step(model, opt, 3)
    return {"params": _full_params(model)}


@job
def fsdp_helpers_resume(rank, world, args):
    """A fresh model and optimizer (other weights, no optimizer state) resume the plain API's
    checkpoint on this world size and take step 4."""
    model, opt = _fsdp_state(1, world)
    state = shardfmt.get_state_dict(model, opt)
    report = shardfmt.load(state, args["path"])
    shardfmt.set_state_dict(model, opt, state)
    stepped = sorted(n for n, p in model.named_parameters() if p in opt.state)
    _fsdp_step(model, opt, 3)
    return {"params": _full_params(model), "missing": list(report.missing), "stepped": stepped,
            "unexpected": list(report.unexpected)}


DCP_SHARDED = {  # fqn -> (global shape, dtype): DTensors with Shard(0) over the whole world
    "model.embed.weight": ((10, 6), torch.float32),
    "model.proj.weight": ((5, 3), torch.bfloat16),  # uneven on 2 ranks: rows 3 + 2
    "model.proj.bias": ((1, 4), torch.float32),  # rank 1 holds an empty (0, 4) slice
    "optim.state.model.embed.weight.exp_avg": ((10, 6), torch.float32),
}
DCP_PLAIN = {  # plain (replicated) tensors: DCP writes each once
    "model.norm.weight": ((6,), torch.float32),
    "model.count": ((), torch.int64),
}
DCP_VALUES = {"step": 123, "name": "run-7", "sched": {"lr": 0.001, "betas": (0.9, 0.95)}}


def dcp_full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors of the ``dcp_save`` job, the same on every rank and in the test."""
    return {fqn: truth(fqn, shape, dtype) for fqn, (shape, dtype) in {**DCP_SHARDED, **DCP_PLAIN}.items()}


@job
def dcp_save(rank, world, args):
    """torch.distributed.checkpoint.save of DTensor Shard(0) slices, plain tensors and values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    full = dcp_full_tensors()
    state = {fqn: distribute_tensor(full[fqn], mesh, [Shard(0)]) for fqn in DCP_SHARDED}
    state.update({fqn: full[fqn].clone() for fqn in DCP_PLAIN})
    state.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in DCP_VALUES.items()})
    dcp.save(state, checkpoint_id=args["path"])
    return {"local_rows": {fqn: state[fqn].to_local().shape[0] for fqn in DCP_SHARDED}}


@job
def s3_save2(rank, world, args):
    """A 2-rank save straight to S3 (the endpoint comes from AWS_ENDPOINT_URL): row halves + a replica."""
    full = torch.arange(4096 * 512, dtype=torch.float32).reshape(4096, 512)
    rows = 4096 // world
    state = {"w": shardfmt.ShardedTensor(full[rows * rank: rows * (rank + 1)].clone(), (4096, 512), (rows * rank, 0)),
             "bias": torch.linspace(0, 1, 512), "step": 5}
    m = shardfmt.save(state, args["path"], step=5, timeout=dt.timedelta(seconds=120))
    return {"files": sorted(m.files) if m is not None else None}


@job
def hf_llama_tp_pp(rank, world, args):
    """A tiny transformers Llama held as a tp=2 x pp=2 job holds it (DTensors on the tp
    sub-mesh, one pp stage's layers per rank, Megatron column/row splits), saved with Adam-like
    optimizer state and the HF config in the metadata; rank 0 returns the full model's logits."""
    import re

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**args["config"])
    model = LlamaForCausalLM(cfg).eval()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_coordinate()[0]
    layers = cfg.num_hidden_layers

    def stage_of(name):
        m = re.search(r"layers\.(\d+)\.", name)
        if m:
            return int(m.group(1)) * 2 // layers
        return 0 if "embed_tokens" in name else 1

    params, optim = {}, {}
    for name, t in model.state_dict().items():
        if stage_of(name) != stage:
            continue
        if re.search(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|embed_tokens|lm_head)\.weight$", name):
            place = [Shard(0)]
        elif re.search(r"(o_proj|down_proj)\.weight$", name):
            place = [Shard(1)]
        else:
            place = None  # norms: replicated over tp
        for where, key, x in ((params, name, t.detach().clone()), (optim, f"{name}.exp_avg", t.detach() * 0.5)):
            where[key] = distribute_tensor(x, mesh["tp"], place) if place else x
    shardfmt.save({"model": params, "optim": {"state": optim}, "step": 7}, args["path"], step=7,
                  mesh={"pp": 2, "tp": 2}, metadata={"hf_config": cfg.to_dict()}, timeout=dt.timedelta(seconds=90))
    out = {}
    if rank == 0:
        with torch.no_grad():
            out["logits"] = model(torch.tensor(args["input"])).logits.flatten().tolist()
    return out


@job
def flat_save(rank, world, args):
    """Each rank saves its flat partitions (``tests.test_flat_shard``): ZeRO-3 or ZeRO-1/2."""
    from tests import test_flat_shard as flat

    name, _, placed = args["kind"].partition("_")
    kind = {"zero3": flat.zero3, "zero12": flat.zero12}[name]
    state = kind(flat.truth(), rank, world, mesh_dim="dp" if placed else None)
    shardfmt.save(state, args["path"], step=1, mesh={"dp": world} if placed else None)
    return {}


@job
def flat_load_dtensor(rank, world, args):
    """Load the flat partitions' checkpoint into DTensors sharded on their last dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests import test_flat_shard as flat

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    full = flat.truth()
    targets = {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(t.dim() - 1)] if t.dim() else [Replicate()])
               for k, t in full.items()}
    shardfmt.load(targets, args["path"])
    return {"equal": sorted(k for k, t in targets.items() if torch.equal(t.full_tensor(), full[k]))}


def shared_state() -> dict[str, torch.Tensor]:
    """The state the shared-read tests save (one process) and every rank loads: 5 MiB."""
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(1024, 1024, generator=g), "e": torch.randn(512, 256, generator=g).bfloat16(),
            "b": torch.randn(1024, generator=g)}


@job
def shared_load(rank, world, args):
    """Load ``shared_state`` from ``path``: ``layout`` "full" (every rank the whole state: one
    read group of all ranks) or "dp_tp" (a dp=2 x tp=2 mesh, DTensors Shard(0) on tp and
    replicated on dp: a read group per tp coordinate); ``share_reads`` as given. Returns what
    matched, the bytes this rank read, or the error it raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = shared_state()
    if args["layout"] == "full":
        targets = {k: torch.zeros_like(t) for k, t in full.items()}
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        targets = {k: distribute_tensor(torch.zeros_like(t), mesh, [Replicate(), Shard(0)]) for k, t in full.items()}
    group = None
    if args.get("sub_group"):  # only these ranks load, on their own process group
        group = dist.new_group(args["sub_group"])
        if rank not in args["sub_group"]:
            return {"outside": True}
    dist.barrier(group=group)
    if rank == args.get("skip_rank"):  # this rank gives the load up: it joins the others' agreement
        shardfmt.skip_load(args["path"], share_reads=args.get("share_reads"))
        return {"skipped": True}
    try:
        rep = shardfmt.load(targets, args["path"], share_reads=args.get("share_reads"), process_group=group)
    except shardfmt.errors.ShardfmtError as e:
        return {"error": type(e).__name__, "message": str(e)}
    got = {k: (t.full_tensor() if hasattr(t, "full_tensor") else t) for k, t in targets.items()}
    return {"equal": sorted(k for k in full if torch.equal(got[k], full[k])), "bytes_read": rep.bytes_read}


def main() -> None:
    name, rank, world, port, raw = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    args = json.loads(raw)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=args.get("pg_timeout", 120)))
    try:
        result = {"ok": True, **JOBS[name](rank, world, args)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(os.path.join(args["out_dir"], f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
