"""What the scale simulation saves and loads: Llama-shaped states on FSDP2-over-TP meshes. Pure.

A ``Model`` lists its parameters with their tensor-parallel style, as torchtitan's Llama TP
plan sets them: ``wq wk wv w1 w3`` and ``output`` ColwiseParallel (``Shard(0)`` on tp),
``wo w2`` RowwiseParallel (``Shard(1)``), ``tok_embeddings`` RowwiseParallel, which on an
``nn.Embedding`` shards the vocab dim (``Shard(0)``, torch's ``_partition_embedding_fn``),
the norms SequenceParallel (``Replicate()``). FSDP2 over that (``fully_shard`` on the dp
mesh) adds dp placements by ``FSDPParam._init_sharding_spec_tp``: a tp ``Shard(0)`` makes
the dp one ``_StridedShard(0, split_factor=tp)``, anything else gives dp ``Shard(0)``:

    colwise, embedding   (dp: strided_shard(0, tp), tp: shard(0))
    rowwise              (dp: shard(0),             tp: shard(1))
    norms                (dp: shard(0),             tp: replicate)

A ``Job`` is one model saved on a (pp x) dp x tp mesh and loaded on another: every tensor is
fp32 (FSDP2 keeps fp32 sharded parameters; AdamW's ``exp_avg``/``exp_avg_sq`` follow them,
its ``step`` is a 0-d fp32 plain tensor on every rank of the stage), so the 8B state is
8.03 G params x 12 bytes = 96 GB, as issue 18 measured. Pipeline stages own contiguous
blocks of layers (torch.chunk semantics), the embedding stage 0, ``norm``/``output`` the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from shardfmt.layout.topology import Layout, Mesh, Replicate, Shard, StridedShard, chunk_range

COLWISE, ROWWISE, NORM, EMBEDDING = "colwise", "rowwise", "norm", "embedding"
DTYPE = "F32"
MOMENTS = ("exp_avg", "exp_avg_sq")
LR = 3e-4  # the optimizer's hyperparameters, recorded in ``optim.param_groups``


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    """One model parameter: its name (without ``model.``), global shape, TP style and layer."""

    name: str
    shape: tuple[int, ...]
    style: str
    layer: int | None = None  # None: outside the layers (embedding, final norm, output)


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    """Llama dimensions (``head_dim = hidden / heads``)."""

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int

    def params(self) -> list[Param]:
        h, f, kv = self.hidden, self.ffn, self.hidden // self.heads * self.kv_heads
        out = [Param(name="tok_embeddings.weight", shape=(self.vocab, h), style=EMBEDDING)]
        per_layer = (("attention.wq.weight", (h, h), COLWISE), ("attention.wk.weight", (kv, h), COLWISE),
                     ("attention.wv.weight", (kv, h), COLWISE), ("attention.wo.weight", (h, h), ROWWISE),
                     ("feed_forward.w1.weight", (f, h), COLWISE), ("feed_forward.w2.weight", (h, f), ROWWISE),
                     ("feed_forward.w3.weight", (f, h), COLWISE), ("attention_norm.weight", (h,), NORM),
                     ("ffn_norm.weight", (h,), NORM))
        for i in range(self.layers):
            out += [Param(name=f"layers.{i}.{n}", shape=s, style=st, layer=i) for n, s, st in per_layer]
        out += [Param(name="norm.weight", shape=(h,), style=NORM),
                Param(name="output.weight", shape=(self.vocab, h), style=COLWISE)]
        return out


LLAMA_8B = Model(name="8b", layers=32, hidden=4096, ffn=14336, vocab=128256, heads=32, kv_heads=8)
TINY = Model(name="tiny", layers=2, hidden=64, ffn=96, vocab=256, heads=4, kv_heads=2)  # the 8B's structure, narrow
LLAMA_70B = Model(name="70b", layers=80, hidden=8192, ffn=28672, vocab=128256, heads=64, kv_heads=8)


@dataclass(frozen=True, slots=True, kw_only=True)
class Topo:
    """A (pp x) dp x tp mesh of ``world`` ranks (``pp=1``: no pp dim)."""

    world: int
    tp: int
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def mesh(self) -> Mesh:
        dims = ((("pp", self.pp),) if self.pp > 1 else ()) + (("dp", self.dp), ("tp", self.tp))
        return Mesh(dims)

    def check(self) -> str | None:
        """Why this mesh cannot be built (None: it can)."""
        if self.world % (self.tp * self.pp) or self.dp < 1:
            return f"{self.world} ranks is not a multiple of tp={self.tp} x pp={self.pp}"
        return None


def placements(style: str, tp: int) -> tuple:
    """The (dp, tp) placements FSDP2-over-TP gives a parameter of this TP style."""
    if style in (COLWISE, EMBEDDING):  # tp Shard(0): FSDP2 strides its dp shards
        return (StridedShard(0, tp) if tp > 1 else Shard(0), Shard(0))
    if style == ROWWISE:
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())


@dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    """One saved tensor: ``param`` names the model parameter it belongs to (its layout)."""

    fqn: str
    shape: tuple[int, ...]
    param: Param
    plain: bool = False  # AdamW's step: a plain 0-d tensor on every rank of the stage


def param_fqn(p: Param) -> str:
    return f"model.{p.name}"


def state_fqn(p: Param, key: str) -> str:
    return f"optim.state.{p.name}.{key}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """``model`` saved on ``save`` and loaded on ``load``; ``load_rank`` is the rank whose
    load is measured (None: ``world // 2 + 1``)."""

    model: Model
    save: Topo
    load: Topo
    load_rank: int | None = None

    @property
    def name(self) -> str:
        pp = f"pp{self.save.pp}x" if self.save.pp > 1 else ""
        return f"{self.model.name}-{pp}tp{self.save.tp}-to-tp{self.load.tp}-n{self.save.world}"

    @property
    def world(self) -> int:
        return self.save.world

    @property
    def reader(self) -> int:
        r = self.world // 2 + 1 if self.load_rank is None else self.load_rank
        return min(r, self.load.world - 1)

    def check(self) -> str | None:
        return self.save.check() or self.load.check()

    @property
    def params(self) -> tuple[Param, ...]:
        return _params(self.model)

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """Every saved tensor, sorted by fqn (the order ``flatten`` gives)."""
        return _tensors(self.model)

    def stage(self, p: Param, pp: int) -> int | None:
        """The pipeline stage owning ``p`` on a mesh of ``pp`` stages (None: pp == 1)."""
        if pp == 1:
            return None
        if p.layer is None:
            return 0 if p.name.startswith("tok_embeddings") else pp - 1
        for s in range(pp):
            lo, hi = chunk_range(self.model.layers, pp, s)
            if lo <= p.layer < hi:
                return s
        raise ValueError(f"{p.name}: no stage holds layer {p.layer}")

    def layout(self, p: Param, topo: Topo) -> Layout:
        """The (dp, tp) Layout of ``p`` on ``topo``, as the DTensor adapter reads it (no stage:
        a DTensor on a stage's sub-mesh does not say which stage it is)."""
        return Layout(("dp", "tp"), placements(p.style, topo.tp))

    def held_by(self, t: Tensor, topo: Topo, coords: dict[str, int]) -> bool:
        s = self.stage(t.param, topo.pp)
        return s is None or coords.get("pp") == s

    def total_bytes(self) -> int:
        return sum(math.prod(t.shape) * 4 for t in self.tensors)


@cache
def _params(model: Model) -> tuple[Param, ...]:
    return tuple(model.params())


@cache
def _tensors(model: Model) -> tuple[Tensor, ...]:
    out = []
    for p in _params(model):
        out.append(Tensor(fqn=param_fqn(p), shape=p.shape, param=p))
        out += [Tensor(fqn=state_fqn(p, k), shape=p.shape, param=p) for k in MOMENTS]
        out.append(Tensor(fqn=state_fqn(p, "step"), shape=(), param=p, plain=True))
    return tuple(sorted(out, key=lambda t: t.fqn))


LAYOUTS = {
    # 8B: saved tp=8 (dp = N/8), loaded tp=4 (dp = N/4)
    "8b": lambda n: Job(model=LLAMA_8B, save=Topo(world=n, tp=8), load=Topo(world=n, tp=4)),
    # 70B: saved tp8 x pp16 (dp = N/128; 32 at 4096), loaded tp4 x pp16 (dp = N/64)
    "70b": lambda n: Job(model=LLAMA_70B, save=Topo(world=n, tp=8, pp=16), load=Topo(world=n, tp=4, pp=16)),
    # tests and smoke runs: the 8B's tensors, narrow, saved tp=4 (dp = N/4) and loaded tp=2
    "tiny": lambda n: Job(model=TINY, save=Topo(world=n, tp=4), load=Topo(world=n, tp=2)),
}
DEFAULT_RANKS = {"8b": (64, 1024, 4096), "70b": (4096,), "tiny": (8,)}
