"""Worker jobs for the training-loop tests (registered with ``workers.job``)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import shardfmt
from tests.distributed.workers import job, main


def _loader(seed: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = torch.utils.data.DistributedSampler(torch.arange(400), shuffle=True, seed=11)
    return StatefulDataLoader(torch.arange(400), batch_size=4, num_workers=2, in_order=True, sampler=sampler,
                              generator=torch.Generator().manual_seed(seed))


@job
def loader_save(rank, world, args):
    """Read 7 batches, save, then read the rest (what an uninterrupted run sees)."""
    dl = _loader(seed=rank)
    it = iter(dl)
    for _ in range(7):
        next(it)
    shardfmt.Checkpointer(args["root"]).save(7, {"loader": dl})
    return {"rest": [b.tolist() for b in it]}


@job
def loader_restore(rank, world, args):
    dl = _loader(seed=100 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = shardfmt.Checkpointer(args["root"]).restore({"loader": dl})
    dist.barrier()
    return {"step": step, "rest": [b.tolist() for b in dl],
            "warnings": [str(w.message) for w in caught if "cannot be resharded" in str(w.message)]}


def _values_state(world: int, placement: str):
    """A DTensor matrix (placed as ``placement`` on a 1-d mesh of every rank), a replicated DTensor
    vector and a plain tensor, the same values on every rank; ``placement="empty..."``: zeros."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(3)
    w, v, b = torch.randn(64, 48, generator=g), torch.randn(40, generator=g), torch.randn(48, generator=g)
    place = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[placement.removeprefix("empty-")]
    if placement.startswith("empty-"):
        w, v, b = torch.zeros_like(w), torch.zeros_like(v), torch.zeros_like(b)
    m = torch.nn.Module()
    m.register_parameter("w", torch.nn.Parameter(distribute_tensor(w, mesh, [place]), requires_grad=False))
    m.register_parameter("v", torch.nn.Parameter(distribute_tensor(v, mesh, [Replicate()]), requires_grad=False))
    m.register_buffer("b", b)
    return m


@job
def values_check(rank, world, args):
    """Save on a 1-d mesh with ``w`` sharded by rows; load it placed as ``args["into"]`` and compare
    the ranks' summed statistics with the saved ones; ``args["flip_on"]``: that rank's loader
    reverses the rows of every strided copy it makes (a loader bug the digests cannot see)."""
    from shardfmt.api import load
    from shardfmt.errors import IntegrityError
    from shardfmt.loading import executor
    from shardfmt.loading.options import LoadOptions
    from shardfmt.training.ranks import Ranks
    from shardfmt.training.sanity import check_values

    if args["save"]:
        shardfmt.Checkpointer(args["root"]).save(1, {"m": _values_state(world, "shard0")})
    dist.barrier()
    if args.get("flip_on") == rank:
        real = executor._src_view
        executor._src_view = lambda *a: real(*a).flip(0)
    back = {"m": _values_state(world, "empty-" + args["into"]).state_dict()}
    path = args["root"] + "/step_000000001"
    rep = load(back, path, options=LoadOptions(value_stats=True))
    check = check_values(rep.value_stats, shardfmt.read_manifest(path), Ranks(None))
    try:
        shardfmt.Checkpointer(args["root"]).restore({"m": _values_state(world, "empty-" + args["into"])})
        error = None
    except IntegrityError as e:
        error = str(e)
    return {"checked": list(check.checked), "unchecked": list(check.unchecked), "bad": list(check.bad),
            "restore_error": error}


@job
def grads_save(rank, world, args):
    """A model whose weight is a DTensor split by rows, a gradient accumulated in it: saved with
    ``save_grads`` on ``world`` ranks; returns the whole gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    m = torch.nn.Module()
    w = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) / 100
    m.register_parameter("w", torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])))
    m.register_parameter("r", torch.nn.Parameter(distribute_tensor(torch.ones(6), mesh, [Replicate()])))
    x = distribute_tensor(torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6), mesh, [Shard(0)])
    ((m.w * m.w).sum() + (x * m.r).sum()).backward()  # r's gradient: a sum over the ranks' rows, Partial
    partial = [str(p) for p in m.r.grad.placements]
    shardfmt.Checkpointer(args["root"], save_grads=True).save(3, {"model": m}, metadata={"micro_step": 1})
    return {"grad": m.w.grad.full_tensor().tolist(), "r_grad": m.r.grad.full_tensor().tolist(),
            "r_placements": partial}


@job
def shared_cache(rank, world, args):
    """Each rank loads the whole of a plain-tensor checkpoint (the bytes the ranks share), through
    the page cache: what stays cached after a plain load, after ``release_cached``, and after a
    ``Checkpointer.restore`` (every rank's residency of the data files, measured once all are done)."""
    import glob
    import os

    from tests.pagecache import resident_fraction
    from tests.test_page_cache import _Model

    root = args["root"]
    path = root + "/step_000000001"
    files = sorted(glob.glob(os.path.join(path, "data", "*")))
    back = _Model().state_dict()
    rep = shardfmt.load({"model": back}, path, strict=False)
    dist.barrier()
    out = {"cached_ranges": len(rep.cached), "after_load": resident_fraction(files)}
    dist.barrier()
    shardfmt.api.release_cached(rep.source, rep.cached)
    dist.barrier()
    out["after_release"] = resident_fraction(files)
    shardfmt.Checkpointer(root).restore({"model": _Model()})
    dist.barrier()
    out["after_restore"] = resident_fraction(files)
    return out


if __name__ == "__main__":
    main()
