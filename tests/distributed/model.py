"""A transformer-like training state with known ground truth, laid out on any mesh.

Every global tensor is a deterministic function of its name, so any rank of any job can
build its own slice of it and any test can check any slice of a loaded result.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from shardfmt.layout.topology import Layout, Mesh, Shard, default_stage, held_boxes

VOCAB, HIDDEN, FFN, LAYERS = 96, 32, 64, 4


@dataclass(frozen=True)
class Spec:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int | None  # tensor dim split over tp (None: replicated over tp)
    stage_of: str  # FQN used for the PP stage rule


def _params() -> list[Spec]:
    out = [Spec("model.embed.weight", (VOCAB, HIDDEN), torch.float32, 0, "model.layers.0.")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            Spec(p + "attn.wq.weight", (HIDDEN, HIDDEN), torch.float32, 0, p),   # column-parallel
            Spec(p + "attn.wo.weight", (HIDDEN, HIDDEN), torch.float32, 1, p),   # row-parallel
            Spec(p + "mlp.w1.weight", (FFN, HIDDEN), torch.float32, 0, p),
            Spec(p + "mlp.w1.bias", (FFN,), torch.float32, 0, p),
            Spec(p + "mlp.w2.weight", (HIDDEN, FFN), torch.float32, 1, p),
            Spec(p + "norm.weight", (HIDDEN,), torch.bfloat16, None, p),         # replicated norm
        ]
    last = f"model.layers.{LAYERS - 1}."
    out += [Spec("model.final_norm.weight", (HIDDEN,), torch.bfloat16, None, last),
            Spec("model.lm_head.weight", (VOCAB, HIDDEN), torch.float32, 0, last)]
    return out


def specs() -> list[Spec]:
    out = []
    for s in _params():
        out.append(s)
        name = s.fqn
        out.append(Spec(f"optim.state.{name}.exp_avg", s.shape, torch.float32, s.tp_dim, s.stage_of))
        out.append(Spec(f"optim.state.{name}.exp_avg_sq", s.shape, torch.float32, s.tp_dim, s.stage_of))
        out.append(Spec(f"optim.state.{name}.step", (), torch.float32, None, s.stage_of))
    return out


def truth(fqn: str, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
    if len(shape) == 0:
        return torch.tensor(float(zlib.crc32(fqn.encode()) % 1000), dtype=dtype)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def layout_for(spec: Spec, mesh: Mesh, *, split: str = "tp") -> Layout:
    """``tp``: Megatron-style (tp_dim over tp, PP stages when the mesh has pp);
    ``rows``: dim 0 of every tensor with a dim over the mesh's single dim."""
    names = mesh.names
    stage = default_stage(spec.stage_of, LAYERS, mesh.size("pp")) if "pp" in names else None
    if split == "rows":
        if len(spec.shape) == 0:
            return Layout((), (), stage=stage)
        return Layout((names[-1],), (Shard(0),), stage=stage)
    if "tp" in names and spec.tp_dim is not None:
        return Layout(("tp",), (Shard(spec.tp_dim),), stage=stage)
    return Layout((), (), stage=stage)


def rank_state(mesh: Mesh, rank: int, *, split: str = "tp", empty: bool = False) -> dict:
    """This rank's slices as ShardedTensors (filled with truth, or with a sentinel)."""
    from shardfmt import ShardedTensor

    coords = mesh.coords(rank)
    sizes = dict(mesh.dims)
    state: dict = {}
    for s in specs():
        lay = layout_for(s, mesh, split=split)
        boxes = held_boxes(s.shape, lay, coords, sizes)
        if not boxes:
            continue
        (hb,) = boxes
        if empty:
            local = torch.full(hb.box.lengths, 7.0).to(s.dtype) if s.shape else torch.tensor(7.0).to(s.dtype)
        else:
            local = truth(s.fqn, s.shape, s.dtype)[hb.box.slices()].clone()
        state[s.fqn] = ShardedTensor(local, s.shape, hb.box.offsets, layout=lay)
    return state


def check_state(state: dict) -> list[str]:
    """Return the FQNs whose loaded slice differs from the ground truth."""
    from shardfmt import ShardedTensor

    bad = []
    by_name = {s.fqn: s for s in specs()}
    for fqn, v in state.items():
        if fqn not in by_name:
            continue
        s = by_name[fqn]
        full = truth(fqn, s.shape, s.dtype)
        if isinstance(v, ShardedTensor):
            want = full[tuple(slice(o, o + n) for o, n in zip(v.offsets, v.local.shape))]
            got = v.local
        else:
            want, got = full, v
        if not torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got,
                           want.contiguous().reshape(-1).view(torch.uint8) if want.numel() else want):
            bad.append(fqn)
    return bad
