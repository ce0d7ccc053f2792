"""The real run the scale simulation is checked against: ``python -m tests.distributed.scale_workers``.

``scale_fsdp_tp`` builds a Llama-shaped model with torchtitan's module names (narrow: the
``tiny`` job of ``benchmarks.scale.layouts``), applies torchtitan's TP plan with
``parallelize_module`` on the tp mesh and FSDP2 (``fully_shard`` per layer, then the root) on
the dp mesh, steps AdamW once on zero gradients (every tensor stays zero; the ``step``
counters are zeroed after), and saves ``shardfmt.get_state_dict(model, opt)`` with the
simulation's save options (pinned save id and clock). Each rank reports the ``RankState``
``describe`` makes of its state.
"""

from __future__ import annotations

import torch
from torch import nn

import shardfmt
from benchmarks.scale import sim_v1, v2
from benchmarks.scale.layouts import LAYOUTS, LR, Model
from shardfmt.saving.describe import describe
from tests.distributed.workers import job, main


class Block(nn.Module):
    def __init__(self, m: Model) -> None:
        super().__init__()
        kv = m.hidden // m.heads * m.kv_heads
        self.attention = nn.Module()
        for name, (i, o) in {"wq": (m.hidden, m.hidden), "wk": (m.hidden, kv), "wv": (m.hidden, kv),
                             "wo": (m.hidden, m.hidden)}.items():
            setattr(self.attention, name, nn.Linear(i, o, bias=False))
        self.feed_forward = nn.Module()
        for name, (i, o) in {"w1": (m.hidden, m.ffn), "w2": (m.ffn, m.hidden), "w3": (m.hidden, m.ffn)}.items():
            setattr(self.feed_forward, name, nn.Linear(i, o, bias=False))
        self.attention_norm = nn.RMSNorm(m.hidden)
        self.ffn_norm = nn.RMSNorm(m.hidden)


class Llama(nn.Module):
    def __init__(self, m: Model) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleDict({str(i): Block(m) for i in range(m.layers)})
        self.norm = nn.RMSNorm(m.hidden)
        self.output = nn.Linear(m.hidden, m.vocab, bias=False)


def parallelize(model: Llama, mesh) -> None:
    """torchtitan's Llama TP plan (the parameters' part of it), then FSDP2 per layer and the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh["tp"]
    parallelize_module(model, tp, {"tok_embeddings": RowwiseParallel(), "norm": SequenceParallel(),
                                   "output": ColwiseParallel()})
    for block in model.layers.values():
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


@job
def scale_fsdp_tp(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh

    sim = LAYOUTS["tiny"](world)
    mesh = init_device_mesh("cpu", sim.save.mesh.shape, mesh_dim_names=sim.save.mesh.names)
    model = Llama(sim.model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for st in opt.state.values():
        st["step"].zero_()  # the data stays all zeros, as in the simulation's sparse files
    state = shardfmt.get_state_dict(model, opt)
    held, _ = describe(state, rank)
    shardfmt.save(state, args["path"], step=sim_v1.STEP, options=sim_v1.save_options(sim))
    if "path_v2" in args:  # the chunk left to the save, as a user's save leaves it
        shardfmt.save(state, args["path_v2"], step=sim_v1.STEP, options=v2.save_options(sim, None))
    return {"state": held.to_json(),
            "placements": {k: [repr(p) for p in v.placements] for k, v in state["model"].items()}}


if __name__ == "__main__":
    main()
