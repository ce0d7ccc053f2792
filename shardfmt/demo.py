"""``shardfmt demo``: the format end to end on local disk, in one process.

Builds a small transformer-like model with AdamW state, saves it, then loads it back as
if on a 4-way tensor-parallel job (each "rank" asks for its row slice of every matrix and
reads only those bytes), checks every byte, and validates the checkpoint deeply.
"""

from __future__ import annotations

import tempfile
import time

import torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, dropout=0.1,
                                             batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def run_demo(args) -> int:
    from . import ShardedTensor, load, read_manifest, save
    from .validation import validate

    root = args.dir or tempfile.mkdtemp(prefix="shardfmt-demo-")
    path = f"{root}/step_000000003"
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, 64)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    t0 = time.perf_counter()
    manifest = save(state, path, step=3, metadata={"demo": True}, overwrite=True)
    t_save = time.perf_counter() - t0
    nbytes = sum(f.size for f in manifest.files.values())
    print(f"saved step 3 to {path}: {len(manifest.tensors)} tensors, {nbytes / 1e6:.2f} MB in "
          f"{t_save * 1e3:.0f} ms")

    ref = model.state_dict()
    world = 4
    total_read = 0
    for rank in range(world):
        targets = {}
        for name, t in ref.items():
            if t.dim() >= 1 and t.shape[0] % world == 0:
                rows = t.shape[0] // world
                targets[name] = ShardedTensor(torch.empty((rows, *t.shape[1:]), dtype=t.dtype),
                                              tuple(t.shape), (rank * rows,) + (0,) * (t.dim() - 1))
            else:
                targets[name] = torch.empty_like(t)
        report = load({"model": targets}, path, strict=True)
        total_read += report.bytes_read
        for name, t in ref.items():
            got = targets[name]
            want = t[got.offsets[0]:got.offsets[0] + got.local.shape[0]] if isinstance(got, ShardedTensor) else t
            if not torch.equal(got.local if isinstance(got, ShardedTensor) else got, want):
                print(f"MISMATCH on rank {rank}: {name}")
                return 1
    print(f"loaded as {world} row-sharded ranks: every slice bit-exact; {total_read / 1e6:.2f} MB read in all")

    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(opt.state_dict())  # same structure; values get overwritten below
    full = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": 0}
    load(full, path)
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ref.values()))
    print(f"loaded into a fresh model + optimizer: weights equal = {same}, step = {full['step']}")
    rep = validate(path, deep=True)
    print(f"validate --deep: {'valid' if rep.ok else 'INVALID'}; manifest step {read_manifest(path).step}")
    return 0 if (same and rep.ok) else 1
