"""The demo's training job (run by torchrun): a small transformer, resumable bit for bit.

Every rank logs, per step, the global mean loss and the sample ids it trained on to
``<dir>/<run>.rank<R>.jsonl``; a resumed run first drops the steps the lost run logged past
its checkpoint (``training.logs.rewind_jsonl``), so each step is in the log once. With ``--kill-at S`` rank 1 SIGKILLs itself after step S; the
job is then launched again, restores the newest checkpoint and carries on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys

import torch
import torch.distributed as dist

from shardfmt import Checkpointer, ResumableSampler
from shardfmt.training.logs import rewind_jsonl

VOCAB, SEQ, DIM, SAMPLES = 64, 16, 32, 256


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        layer = torch.nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.layers(self.embed(x), mask=mask, is_causal=True))


def dataset() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    base = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    steps = torch.randint(1, 4, (SAMPLES, 1), generator=g)
    return (base + steps * torch.arange(SEQ + 1)) % VOCAB  # learnable: arithmetic sequences


def main() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()

    # A bounded timeout: a rank that cannot connect fails fast instead of hanging the demo.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warm = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, a.steps - warm))))
    data = dataset()
    sampler = ResumableSampler(len(data), seed=7)
    # The loader gets its own generator: otherwise every new iterator draws a seed from the
    # global torch RNG, and a resumed run (new iterator mid-epoch) would diverge.
    loader_gen = torch.Generator().manual_seed(0)
    state = {"model": model, "optim": opt, "sched": sched, "sampler": sampler}
    ck = Checkpointer(os.path.join(a.dir, f"ckpt_{a.name}"), keep_last=2)
    step = ck.restore(state) or 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log_path = os.path.join(a.dir, f"{a.name}.rank{rank}.jsonl")
    # The lost run logged steps past the checkpoint: drop them, so the log holds each step once
    # (TensorBoard: SummaryWriter(purge_step=step + 1) does the same to its event files).
    rewound = rewind_jsonl(log_path, step) if step else []
    log = open(log_path, "a")
    if step:
        log.write(json.dumps({"resumed_from": step, "attempt": attempt, "rewound": rewound}) + "\n")
    while step < a.steps:
        loader = torch.utils.data.DataLoader(torch.arange(len(data)), batch_size=a.batch, sampler=sampler,
                                             generator=loader_gen, drop_last=True)
        for ids in loader:
            step += 1
            batch = data[ids]
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            sampler.advance(len(ids))
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            log.write(json.dumps({"step": step, "loss": (mean / world).item(), "ids": ids.tolist(),
                                  "lr": sched.get_last_lr()[0]}) + "\n")
            log.flush()
            if step % a.save_every == 0:
                ck.save(step, state)
            if a.kill_at is not None and step == a.kill_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= a.steps:
                break
        else:  # the epoch's batches are done (a tail short of a batch is dropped, never consumed)
            sampler.set_epoch(sampler.epoch + 1)
    log.close()
    ck.close()  # every save done (the exit below skips the exit-time wait)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization: a gloo worker thread that frees the last
    # collective's tensors after it has begun aborts the rank (exit -6; 1 run in 40 of this script
    # with a core kept busy). The examples (examples/fsdp2_train.py) say why.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
