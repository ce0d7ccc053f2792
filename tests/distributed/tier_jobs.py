"""Worker jobs for the node-local tier tests (registered with ``workers.job``).

"Nodes" on one machine: each rank's node is named by ``args["nodes"]`` ("blocks": ranks
``2k, 2k+1`` share node ``n<k>``; "stripes": rank ``r`` is on node ``n<r % 2>``), and the local
tier's path holds ``{node}``, so every node has a directory of its own.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

import shardfmt
from tests.distributed.workers import job, main


def _node(rank: int, how: str) -> str:
    return f"n{rank // 2}" if how == "blocks" else f"n{rank % 2}"


def _model(world: int, seed: int, replicated: bool):
    """Rows of two matrices on each rank (DTensor Shard(0)), and a plain buffer every rank holds
    whole (``replicated``: written once, by rank 0, on node 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Module()
    for k in ("a", "b"):
        m.register_parameter(k, torch.nn.Parameter(distribute_tensor(torch.randn(512, 256, generator=g), mesh,
                                                                     [Shard(0)])))
    if replicated:
        m.register_buffer("bias", torch.randn(1024, 1024, generator=g))  # 4 MiB: most of rank 0's file, read by node 1
    return m


def _whole(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        t = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = t.flatten()[::97].tolist()
    return out


def _checkpointer(rank: int, args: dict) -> shardfmt.Checkpointer:
    return shardfmt.Checkpointer(args["root"], local=args["local"], node=_node(rank, args.get("nodes", "blocks")),
                                 keep_last=args.get("keep_last", 3), replicate=args.get("replicate", "skip"),
                                 archive_backoff=0.0)


@job
def tier_train(rank, world, args):
    """Save ``steps`` (each after changing the weights), then wait for the copies; with
    ``slow_copy`` every copy to the root takes that many seconds longer."""
    if args.get("slow_copy"):
        from shardfmt.training import replicate

        copy = replicate.copy_part

        def slow(*a, **k):
            time.sleep(args["slow_copy"])
            return copy(*a, **k)
        replicate.copy_part = slow
    model = _model(world, 0, args.get("replicated", True))
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("shardfmt").addHandler(handler)
    blocked = []
    with _checkpointer(rank, args) as ck:
        for step in args["steps"]:
            with torch.no_grad():
                model.a += step
            t0 = time.perf_counter()
            ck.save(step, {"model": model}, async_=args.get("async", False))
            blocked.append(time.perf_counter() - t0)
        ck.wait()
        errors = ck.replication_errors
    return {"state": _whole(model), "log": [r for r in records if "node-local" in r or "copy of" in r],
            "errors": errors, "blocked": blocked}


@job
def tier_restore(rank, world, args):
    model = _model(world, 5, args.get("replicated", True))
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = _checkpointer(rank, args)
        try:
            step = ck.restore({"model": model})
        except shardfmt.errors.ShardfmtError as e:
            step, error = None, f"{type(e).__name__}: {e}"
        ck.close()
    return {"step": step, "tier": ck.restored_tier, "state": _whole(model), "error": error,
            "warned": [str(w.message) for w in caught]}


if __name__ == "__main__":
    main()
