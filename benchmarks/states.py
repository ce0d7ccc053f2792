"""State builders: which tensors a benchmark saves, how a layout splits them, their values.

Every element is given by a closed formula of its global index (``gen``), so any slice of
any tensor can be regenerated to check a load, and every rank builds its own piece (no data
moves between ranks to set up). Builders (``BUILDERS``), all sizes approximate:

- ``transformer``: 6 layers x {qkv, out, up, down} of a transformer, each as a bf16 weight
  and fp32 Adam state (master, exp_avg, exp_avg_sq); d a multiple of 64, so rows and
  columns divide by any world up to 64 (run.py's state). ``replicated=True`` adds per-layer
  fp32 norms and a 0-d ``step``, replicated on every rank (bench_s3's small tensors).
- ``llama``: a Llama-shaped fp32 model (bench_convert's), each tensor tagged with its
  tensor-parallel dim (column / row splits, replicated norms).
- ``small``: many tiny tensors (bench_distributed's "small"): half 0-d ``step`` tensors
  (replicated), half (64,) norms sharded on dim 0; its "size" counts thousands of tensors.

Layouts (``box``): ``rows`` shards each tensor's ``shard_dim`` over the world (the save
layout; others are replicated); ``cols`` shards dim 1 of 2-D tensors (on one process: the
left half of the columns, as a ``ShardedTensor``; others as ``rows``); ``full`` is every
tensor whole (one process: plain tensors; more: replicated DTensors, every rank a replica).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import shardfmt

MIB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One tensor of the state: name, global shape, dtype, the dim the save layout shards."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    shard_dim: int | None = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class Box:
    """A rank's piece of a tensor: ``offsets`` and ``lengths`` per dim, and how it is held."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    placement: str  # "shard:<d>", "replicate", "slice" (a ShardedTensor in one process) or "full"


def transformer(size_mib: int, *, replicated: bool = False, layers: int = 6) -> list[TensorSpec]:
    """bf16 weights + fp32 master/exp_avg/exp_avg_sq of ``layers`` layers, about ``size_mib`` in all."""
    per_d2 = layers * 12 * (2 + 3 * 4)  # qkv 3d^2 + out d^2 + up 4d^2 + down 4d^2 = 12 d^2 elements
    d = max(64, int(math.sqrt(size_mib * MIB / per_d2)) // 64 * 64)
    out = []
    for layer in range(layers):
        for pname, shape in (("attn.qkv", (3 * d, d)), ("attn.out", (d, d)), ("mlp.up", (4 * d, d)),
                             ("mlp.down", (d, 4 * d))):
            out.append(TensorSpec(fqn=f"model.layers.{layer}.{pname}.weight", shape=shape, dtype="bfloat16"))
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                out.append(TensorSpec(fqn=f"optim.state.layers.{layer}.{pname}.{kind}", shape=shape,
                                      dtype="float32"))
        if replicated:
            out.append(TensorSpec(fqn=f"model.layers.{layer}.norm.weight", shape=(d,), dtype="float32",
                                  shard_dim=None))
    if replicated:
        out.append(TensorSpec(fqn="optim.state.step", shape=(), dtype="float32", shard_dim=None))
    return out


LLAMA_HIDDEN, LLAMA_FFN, LLAMA_VOCAB = 2048, 5632, 32000


def llama(size_mib: int) -> list[TensorSpec]:
    """A Llama-shaped fp32 model of about ``size_mib``; ``shard_dim`` = its tensor-parallel dim.

    Hidden 2048, FFN 5632, vocabulary 32000 (all divided by 8 under 512 MiB, so a small run
    stays small); at least two layers, an even number (two pipeline stages)."""
    k = 1 if size_mib >= 512 else 8
    h, f, v = LLAMA_HIDDEN // k, LLAMA_FFN // k, LLAMA_VOCAB // k
    fixed = [("model.embed_tokens.weight", (v, h), 0), ("lm_head.weight", (v, h), 0), ("model.norm.weight", (h,), None)]
    layer = [("self_attn.q_proj.weight", (h, h), 0), ("self_attn.k_proj.weight", (h, h), 0),
             ("self_attn.v_proj.weight", (h, h), 0), ("self_attn.o_proj.weight", (h, h), 1),
             ("mlp.gate_proj.weight", (f, h), 0), ("mlp.up_proj.weight", (f, h), 0),
             ("mlp.down_proj.weight", (h, f), 1), ("input_layernorm.weight", (h,), None),
             ("post_attention_layernorm.weight", (h,), None)]
    per_layer = sum(4 * math.prod(s) for _, s, _ in layer)
    layers = max(2, round((size_mib * MIB - sum(4 * math.prod(s) for _, s, _ in fixed)) / per_layer))
    layers += layers % 2
    specs = [(n, s, d) for n, s, d in fixed]
    specs += [(f"model.layers.{i}.{n}", s, d) for i in range(layers) for n, s, d in layer]
    return [TensorSpec(fqn=n, shape=s, dtype="float32", shard_dim=d) for n, s, d in specs]


def small(size_mib: int) -> list[TensorSpec]:
    """``1000 * size_mib`` tiny tensors (for this builder the size counts thousands of tensors):
    0-d replicated steps and (64,) dim-0 shards."""
    n = 1000 * size_mib
    steps = [TensorSpec(fqn=f"optim.state.{i}.step", shape=(), dtype="float32", shard_dim=None)
             for i in range(n // 2)]
    return steps + [TensorSpec(fqn=f"model.norms.{i}.weight", shape=(64,), dtype="float32")
                    for i in range(n - n // 2)]


BUILDERS = {"transformer": transformer, "llama": llama, "small": small}


def build_specs(builder: str, size_mib: int, *, replicated: bool = False) -> list[TensorSpec]:
    if builder not in BUILDERS:
        raise ValueError(f"unknown state builder {builder!r} (known: {sorted(BUILDERS)})")
    if builder == "transformer":
        return transformer(size_mib, replicated=replicated)
    return BUILDERS[builder](size_mib)


def spec_bytes(specs: Sequence[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def box(spec: TensorSpec, layout: str, world: int, rank: int) -> Box:
    """The piece of ``spec`` rank ``rank`` of ``world`` holds in ``layout``."""
    shape = spec.shape
    full = Box(offsets=(0,) * len(shape), lengths=shape, placement="full" if world == 1 else "replicate")
    if layout == "full":
        return full
    dim = spec.shard_dim
    if layout == "cols" and len(shape) == 2:
        if world == 1:
            return Box(offsets=(0, 0), lengths=(shape[0], shape[1] // 2), placement="slice")
        dim = 1
    if dim is None or world == 1:
        return full
    if shape[dim] % world:
        raise ValueError(f"{spec.fqn}: dim {dim} of {shape} does not divide by the world {world}")
    n = shape[dim] // world
    offsets = tuple(rank * n if d == dim else 0 for d in range(len(shape)))
    lengths = tuple(n if d == dim else x for d, x in enumerate(shape))
    return Box(offsets=offsets, lengths=lengths, placement=f"shard:{dim}")


def gen(tid: int, b: Box, dtype: str, device) -> torch.Tensor:
    """Element i of tensor ``tid`` = fl(fl(i0*a) + fl(i_last*c)) + tid/2, cast: the same bits for any slice."""
    shape = b.lengths
    if not shape:
        return torch.tensor(float(tid) * 0.5 + 1.0, device=device).to(getattr(torch, dtype))
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    coefs = (0.0009765,) + (0.0,) * (len(shape) - 2) + (1.7071,) if len(shape) > 1 else (1.7071,)
    for d, (o, n, c) in enumerate(zip(b.offsets, shape, coefs)):
        if c:
            idx = torch.arange(o, o + n, dtype=torch.float32, device=device) * c
            out += idx.view((1,) * d + (n,) + (1,) * (len(shape) - d - 1))
    out.add_(float(tid) * 0.5)
    return out.to(getattr(torch, dtype))


@dataclass(frozen=True, slots=True, kw_only=True)
class Built:
    """A rank's tensors in one layout: its local pieces, their boxes, and the state dict over them."""

    specs: tuple[TensorSpec, ...]
    boxes: tuple[Box, ...]
    locals: tuple[torch.Tensor, ...]
    state: dict

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.locals)


def build(specs: Sequence[TensorSpec], layout: str, world: int, rank: int, *, device, mesh=None,
          values: bool) -> Built:
    """The rank's pieces in ``layout`` (formula values, or NaN targets), and a state dict over them."""
    boxes = tuple(box(s, layout, world, rank) for s in specs)
    locs = []
    for i, (s, b) in enumerate(zip(specs, boxes)):
        if values:
            locs.append(gen(i, b, s.dtype, device))
        else:
            locs.append(torch.full(b.lengths, float("nan"), dtype=getattr(torch, s.dtype), device=device))
    return Built(specs=tuple(specs), boxes=boxes, locals=tuple(locs), state=state_dict(specs, boxes, locs, mesh))


def state_dict(specs, boxes, locs, mesh) -> dict:
    """DTensors on ``mesh`` (a 1-D mesh of the world), else plain tensors / ShardedTensor slices."""
    out = {}
    for s, b, t in zip(specs, boxes, locs):
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            place = Shard(int(b.placement.split(":")[1])) if b.placement.startswith("shard:") else Replicate()
            stride = tuple(math.prod(s.shape[d + 1:]) for d in range(len(s.shape)))
            out[s.fqn] = DTensor.from_local(t, mesh, [place], run_check=False, shape=torch.Size(s.shape),
                                            stride=stride)
        elif b.placement == "slice":
            out[s.fqn] = shardfmt.ShardedTensor(t, s.shape, b.offsets)
        else:
            out[s.fqn] = t
    return out


def fill_nan(built: Built) -> None:
    for t in built.locals:
        t.fill_(float("nan"))


def check(built: Built, what: str) -> None:
    """First, middle and last index along dim 0 of every piece equal the formula; no NaN anywhere."""
    for i, (s, b, t) in enumerate(zip(built.specs, built.boxes, built.locals)):
        bad = bool(torch.isnan(t).any())
        if t.dim() == 0 or bad:
            bad = bad or not torch.equal(t, gen(i, b, s.dtype, t.device))
        else:
            n = t.shape[0]
            for k in sorted({0, n // 2, n - 1}):
                sub = Box(offsets=(b.offsets[0] + k,) + b.offsets[1:], lengths=(1,) + b.lengths[1:],
                          placement=b.placement)
                bad = bad or not torch.equal(t[k:k + 1], gen(i, sub, s.dtype, t.device))
        if bad:
            raise AssertionError(f"{what}: {s.fqn} differs from the saved data")
