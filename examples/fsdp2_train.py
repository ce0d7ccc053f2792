"""FSDP2 training with the Checkpointer: save every few steps, get killed, resume on any world size.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --root /tmp/fsdp2_ckpt --steps 12
    torchrun --nproc-per-node 4 examples/fsdp2_train.py --root /tmp/fsdp2_ckpt --steps 20  # resumes at 12

Every rank holds a quarter (half, ...) of each weight and of the AdamW state (DTensor Shard(0));
the Checkpointer writes each rank's shards in parallel, commits once every rank succeeded, and a
restore reads on the new world size exactly the slices each rank now holds. The batch of step n
is drawn from a generator seeded with n, so a resumed run sees the batches the uninterrupted one
saw. Rank 0 prints ``step <n> loss <value>`` each step. CPU with gloo, or CUDA with nccl (a GPU
per local rank).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardfmt


def build(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 8)).to(device)


def batch(step: int, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s global batch of 64 (the same global batch at any world
    size; every rank's part is the same size, so the same gradients, when the world size divides 64)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)
    return x[rank::world].to(device), y[rank::world].to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="the checkpoint root (a directory or an s3:// URL)")
    p.add_argument("--steps", type=int, default=12, help="train until this step")
    p.add_argument("--save-every", type=int, default=4, help="save every this many steps")
    args = p.parse_args()

    # a GPU per local rank, or CPU with gloo (nccl cannot share one GPU between two ranks)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    model = build(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    state = {"model": model, "optim": opt}
    with shardfmt.Checkpointer(args.root, keep_last=2, mesh={"dp": world}) as ckpt:
        start = ckpt.restore(state) or 0  # the newest valid checkpoint, on this world size
        if rank == 0:
            print(f"resumed from step {start} on {world} rank(s)" if start else f"fresh start on {world} rank(s)",
                  flush=True)
        for step in range(start + 1, args.steps + 1):
            x, y = batch(step, rank, world, device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step} loss {total.item() / world:.6f}", flush=True)
            if step % args.save_every == 0:
                ckpt.save(step, state)
    dist.barrier()  # every rank done before any leaves (gloo aborts a peer still talking)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization (the Checkpointer is closed: os._exit would skip
    # its exit-time wait for a background save). A gloo process group outlives
    # destroy_process_group here (torch's own objects still hold it), and its worker threads free
    # the tensors of the job's last collectives when they get to it: a thread that needs the GIL
    # for that once finalization has begun is stopped mid-destructor and the process aborts
    # ("terminate called without an active exception", exit -6: 5 of this script's 24 4-rank
    # resumes with a core kept busy; a core dump of examples/dcp_backend.py showed the stack).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
