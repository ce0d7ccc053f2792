"""Worker jobs for the DCP backend's flows (registered with ``workers.job``): DCP's own calls
(``get_state_dict``/``set_state_dict``, ``Stateful`` entries, ``dcp.save``/``async_save``/``load``)
with ``shardfmt.dcp.Writer``/``Reader`` as the storage, on an FSDP2 model and AdamW."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from shardfmt.dcp import Reader, Writer
from tests.distributed.workers import _fsdp_state, _fsdp_step, _full_params, job, main


class _App(Stateful):
    """DCP's recipe: the model and optimizer as one Stateful entry."""

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt

    def state_dict(self):
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o}

    def load_state_dict(self, state) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


class _Held(Stateful):
    """Any object with state_dict/load_state_dict (an LR scheduler), or a plain dict, as DCP sees it."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def state_dict(self):
        return self.obj.state_dict() if hasattr(self.obj, "state_dict") else dict(self.obj)

    def load_state_dict(self, state) -> None:
        if hasattr(self.obj, "load_state_dict"):
            self.obj.load_state_dict(state)
        else:
            self.obj.clear()
            self.obj.update(state)


def _titan(seed: int, world: int, saved_world: int, step: int):
    """A torchtitan-style state: model + optimizers, lr_schedulers, train_state, and a dataloader
    (its per-rank positions as plain values, not pickled bytes)."""
    model, opt = _fsdp_state(seed, world)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
    train = {"step": step, "global_avg_losses": [0.5] * step, "log_steps": list(range(step))}
    loader = {"world_size": saved_world, **{f"dp_rank_{r}": {"sample_idx": 100 * step + r} for r in range(saved_world)}}
    state = {"model_optim": _App(model, opt), "lr_schedulers": _Held(sched), "train_state": _Held(train),
             "dataloader": _Held(loader)}
    return model, opt, sched, state


def _train(model, opt, sched, steps) -> None:
    for i in steps:
        _fsdp_step(model, opt, i)
        sched.step()


@job
def dcp_titan_save(rank, world, args):
    """Train 3 steps, save with dcp.save (or dcp.async_save) through the Writer, take step 4."""
    model, opt, sched, state = _titan(0, world, world, 3)
    _train(model, opt, sched, range(3))
    writer = Writer(args["path"], step=3, mesh={"dp": world})
    if args.get("async"):
        dcp.async_save(state, storage_writer=writer).result()
    else:
        dcp.save(state, storage_writer=writer)
    _train(model, opt, sched, [3])
    return {"params": _full_params(model), "lr": opt.param_groups[0]["lr"]}


@job
def dcp_titan_resume(rank, world, args):
    """Fresh processes (other weights, a fresh AdamW) load the checkpoint with dcp.load through
    the Reader on this world size, then take step 4."""
    model, opt, sched, state = _titan(1, world, args["saved_world"], 0)
    dcp.load(state, storage_reader=Reader(args["path"]))
    train, loader = dict(state["train_state"].obj), dict(state["dataloader"].obj)
    epoch = sched.last_epoch
    _train(model, opt, sched, [3])
    return {"params": _full_params(model), "lr": opt.param_groups[0]["lr"], "train": train, "loader": loader,
            "sched_epoch": epoch}


@job
def dcp_plain_resume(rank, world, args):
    """DCP's plain flow (get_state_dict -> dcp.load -> set_state_dict) over a checkpoint
    ``shardfmt.save`` wrote, then step 4."""
    model, opt = _fsdp_state(1, world)
    m, o = get_state_dict(model, opt)
    state = {"model": m, "optim": o}
    dcp.load(state, storage_reader=Reader(args["path"]))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _fsdp_step(model, opt, 3)
    return {"params": _full_params(model)}


if __name__ == "__main__":
    main()
