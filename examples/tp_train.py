"""Tensor parallelism with the plain API: save a TP job's state, load it on another TP size.

    torchrun --nproc-per-node 2 examples/tp_train.py --ckpt /tmp/tp_ckpt --steps 4           # train, save
    torchrun --nproc-per-node 1 examples/tp_train.py --ckpt /tmp/tp_ckpt --steps 8 --resume  # tp=1 goes on

An MLP whose first layer is split by columns and second by rows (Megatron style: DTensor
``Shard(0)`` and ``Shard(1)`` over a ``tp`` mesh); AdamW's state is split like its weights.
``shardfmt.save`` records each tensor's placement over the mesh (``mesh={"tp": N}``), so
``shardfmt inspect --tensors`` shows ``tp:Shard(0)``; ``shardfmt.load`` on another TP size reads
the slices each rank now holds. Rank 0 prints ``step <n> loss <value>`` each step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardfmt


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="where the checkpoint is saved (and read with --resume)")
    p.add_argument("--steps", type=int, default=4, help="train until this step, then save")
    p.add_argument("--resume", action="store_true", help="load --ckpt first and go on from its step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    start = 0
    if args.resume:
        state = {**shardfmt.get_state_dict(model, opt), "step": None}
        shardfmt.load(state, args.ckpt)  # each rank reads the slices it holds on this mesh
        shardfmt.set_state_dict(model, opt, state)
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start} on tp={world}", flush=True)
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step)  # every TP rank sees the whole batch
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if args.steps > start:  # a step ran: save it (never relabel a later checkpoint with an earlier step)
        state = {**shardfmt.get_state_dict(model, opt), "step": args.steps}
        shardfmt.save(state, args.ckpt, step=args.steps, mesh={"tp": world}, overwrite=True)
    dist.barrier()  # every rank done before any leaves (gloo aborts a peer still talking)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization: examples/fsdp2_train.py says why.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
