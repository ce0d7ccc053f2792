"""Worker jobs for the incremental-checkpoint tests (registered with ``workers.job``)."""

from __future__ import annotations

import torch

import shardfmt
from tests.distributed.workers import job, main


def _model(rank: int, world: int, seed: int = 0):
    """A frozen 4 MiB matrix and a small trainable head, each rank holding its rows (DTensor Shard(0))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(seed)
    full = {"frozen": torch.randn(2048, 512, generator=g), "head": torch.randn(64, 512, generator=g)}
    m = torch.nn.Module()
    for k, t in full.items():
        m.register_parameter(k, torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]), requires_grad=k == "head"))
    return m


@job
def incremental_train(rank, world, args):
    """Save steps 1-3 (every save after the first incremental: the head changes, the frozen part
    does not), the last one async; return every tensor whole."""
    model = _model(rank, world)
    with shardfmt.Checkpointer(args["root"], incremental=True, keep_last=1, mesh={"dp": world}) as ck:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.head += step
            h = ck.save(step, {"model": model}, async_=step == 3)
        h.wait()
    return {k: v.full_tensor().flatten().tolist()[:4096] for k, v in model.state_dict().items()}


@job
def incremental_restore(rank, world, args):
    model = _model(rank, world, seed=5)
    step = shardfmt.Checkpointer(args["root"]).restore({"model": model})
    return {"step": step, **{k: v.full_tensor().flatten().tolist()[:4096] for k, v in model.state_dict().items()}}


@job
def incremental_rollback(rank, world, args):
    """Roll back to step 1 on every rank: the state is step 1's, and step 3 is set aside once, by rank 0."""
    import warnings

    expected = _model(rank, world)
    with torch.no_grad():
        expected.head += 1
    model = _model(rank, world, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = shardfmt.Checkpointer(args["root"]).restore({"model": model}, step=1)
    same = all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
    return {"step": step, "same": same, "warned": [str(w.message) for w in caught if "rolled back" in str(w.message)]}


if __name__ == "__main__":
    main()
