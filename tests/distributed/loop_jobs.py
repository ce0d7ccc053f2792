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


if __name__ == "__main__":
    main()
