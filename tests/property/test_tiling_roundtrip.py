"""Property: any guillotine tiling written over any ranks loads back, bit for bit, into any slices.

Each example draws 1-3 tensors (rank 0-4, dims 0-9, zero-size dims included), a dtype
each, data from a seed (sometimes raw random bytes, so NaN payloads and odd float8 bits
are covered), a random guillotine tiling per tensor whose tiles are spread over 1-4
ranks, and writes them with ``CheckpointWriter`` (one file per rank). It then loads a
second, unrelated set of slices (another tiling, or arbitrary and possibly overlapping
or empty sub-boxes) as ``ShardedTensor`` targets and compares bytes with the ground truth.
Targets are pre-filled with the complement of the expected bytes, so an element the
loader never writes cannot pass by accident.
"""

from __future__ import annotations

import math
import tempfile

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import examples

import shardfmt
from shardfmt import ShardedTensor
from shardfmt.layout.geometry import Box
from shardfmt.loading.planner import DEFAULT_MAX_GAP, DEFAULT_MAX_READ
from shardfmt.saving.writer import CheckpointWriter, ShardData

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool,
          torch.float8_e4m3fn)
CHUNK_SIZE = 4096  # the smallest the manifest allows: several chunks per file


# ----------------------------------------------------------------------------- helpers


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Return ``t``'s elements as a flat uint8 tensor (NaN-safe comparison)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def make_data(shape: tuple[int, ...], dtype: torch.dtype, seed: int, raw: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if raw and dtype != torch.bool:
        nbytes = math.prod(shape) * dtype.itemsize
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(1 << 62)), min(info.max, 1 << 62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def fill_complement(dst: torch.Tensor, expected: torch.Tensor) -> None:
    """Fill ``dst`` (any layout) so every byte differs from ``expected``'s."""
    if dst.numel() == 0:
        return
    if expected.dtype == torch.bool:
        dst.copy_(~expected)
    else:
        flipped = (as_bytes(expected) ^ 0xFF).view(expected.dtype).reshape(expected.shape)
        dst.copy_(flipped)  # same dtype: a byte copy, NaN bits survive


def split_box(b: Box, d: int, cut: int) -> tuple[Box, Box]:
    o, n = b.offsets, b.lengths
    lo = Box(o, n[:d] + (cut,) + n[d + 1:])
    hi = Box(o[:d] + (o[d] + cut,) + o[d + 1:], n[:d] + (n[d] - cut,) + n[d + 1:])
    return lo, hi


# ----------------------------------------------------------------------------- strategies


shapes = st.integers(0, 4).flatmap(
    lambda nd: st.lists(st.one_of(st.integers(1, 9), st.integers(0, 9)), min_size=nd, max_size=nd).map(tuple))


@st.composite
def guillotine(draw, shape: tuple[int, ...], *, max_tiles: int = 8, allow_empty: bool = False) -> list[Box]:
    """Recursively cut the full box of ``shape`` along random dims at random positions."""
    tiles = [Box.full(shape)]
    for _ in range(draw(st.integers(0, max_tiles - 1))):
        cuttable = [i for i, b in enumerate(tiles) if any(n >= 2 for n in b.lengths)]
        if not cuttable:
            break
        i = draw(st.sampled_from(cuttable))
        b = tiles[i]
        d = draw(st.sampled_from([d for d, n in enumerate(b.lengths) if n >= 2]))
        tiles[i:i + 1] = split_box(b, d, draw(st.integers(1, b.lengths[d] - 1)))
    if allow_empty and shape and draw(st.integers(0, 4)) == 0:
        # An empty tile at the far end of one dim, like a DTensor rank with no rows left.
        d = draw(st.integers(0, len(shape) - 1))
        offs = tuple(draw(st.integers(0, n)) if k != d else shape[d] for k, n in enumerate(shape))
        lens = tuple(draw(st.integers(0, shape[k] - offs[k])) if k != d else 0 for k in range(len(shape)))
        tiles.append(Box(offs, lens))
    return tiles


@st.composite
def sub_box(draw, shape: tuple[int, ...]) -> Box:
    offs, lens = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        offs.append(o)
        lens.append(draw(st.integers(0, n - o)))
    return Box(tuple(offs), tuple(lens))


@st.composite
def target_boxes(draw, shape: tuple[int, ...]) -> list[Box]:
    kind = draw(st.sampled_from(["tiling", "boxes", "full"]))
    if kind == "full":
        return [Box.full(shape)]
    if kind == "tiling":
        return draw(guillotine(shape, max_tiles=6))
    return draw(st.lists(sub_box(shape), min_size=1, max_size=4))


@st.composite
def tensor_case(draw, index: int, n_ranks: int) -> dict:
    shape = draw(shapes)
    dtype = draw(st.sampled_from(DTYPES))
    data = make_data(shape, dtype, draw(st.integers(0, 2**31 - 1)), raw=draw(st.booleans()))
    tiles = draw(guillotine(shape, allow_empty=True))
    ranks = [draw(st.integers(0, n_ranks - 1)) for _ in tiles]
    # One file cannot hold two shards of one tensor at the same offsets (an empty tile can
    # share its offsets with a neighbour); give such a tile a rank of its own.
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for k, b in enumerate(tiles):
        while (ranks[k], b.offsets) in seen:
            ranks[k] += n_ranks
        seen.add((ranks[k], b.offsets))
    return {
        "fqn": f"t{index}", "shape": shape, "dtype": dtype, "data": data, "tiles": tiles, "ranks": ranks,
        "targets": draw(target_boxes(shape)),
        "contiguous_shards": draw(st.booleans()),
        "strided_targets": draw(st.booleans()),
    }


@st.composite
def cases(draw) -> dict:
    n_ranks = draw(st.integers(1, 4))
    n_tensors = draw(st.integers(1, 3))
    return {
        "tensors": [draw(tensor_case(i, n_ranks)) for i in range(n_tensors)],
        "verify": draw(st.booleans()),
        "max_gap": draw(st.sampled_from([0, DEFAULT_MAX_GAP])),
        "max_read": draw(st.sampled_from([DEFAULT_MAX_READ, DEFAULT_MAX_READ, 64, 1000])),
        "workers": draw(st.sampled_from([1, 4])),
    }


# ----------------------------------------------------------------------------- the property


def write_checkpoint(path: str, case: dict) -> None:
    per_rank: dict[int, list[ShardData]] = {}
    for t in case["tensors"]:
        for box, rank in zip(t["tiles"], t["ranks"]):
            piece = t["data"][box.slices()]
            if t["contiguous_shards"]:
                piece = piece.clone()
            per_rank.setdefault(rank, []).append(
                ShardData(fqn=t["fqn"], data=piece, global_shape=t["shape"], offsets=box.offsets))
    with CheckpointWriter(path, chunk_size=CHUNK_SIZE, format_version=1) as w:
        for rank in sorted(per_rank):
            w.write_rank(rank, per_rank[rank])
        w.commit(step=1)


def make_target(t: dict, box: Box) -> tuple[ShardedTensor, torch.Tensor]:
    expected = t["data"][box.slices()]
    if t["strided_targets"] and box.ndim:
        backing = torch.empty(tuple(n + 1 for n in box.lengths), dtype=t["dtype"])
        local = backing[tuple(slice(0, n) for n in box.lengths)]  # non-contiguous window
    else:
        local = torch.empty(box.lengths, dtype=t["dtype"])
    fill_complement(local, expected)
    return ShardedTensor(local, t["shape"], box.offsets), expected


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_any_tiling_loads_back_into_any_slices(case):
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ckpt"
        write_checkpoint(path, case)
        rounds = max(len(t["targets"]) for t in case["tensors"])
        for r in range(rounds):
            # One target per tensor per load: a state dict holds each name once.
            sd: dict[str, ShardedTensor] = {}
            expected: dict[str, torch.Tensor] = {}
            for t in case["tensors"]:
                if r < len(t["targets"]):
                    sd[t["fqn"]], expected[t["fqn"]] = make_target(t, t["targets"][r])
            report = shardfmt.load(sd, path, verify=case["verify"], max_gap=case["max_gap"],
                                   max_read=case["max_read"], workers=case["workers"])
            assert sorted(report.loaded) == sorted(sd)
            needed = sum(e.numel() * e.element_size() for e in expected.values())
            assert report.bytes_needed == needed
            if not case["verify"] and case["max_gap"] == 0:
                assert report.bytes_read == needed, "unverified gap-free load read bytes it did not need"
            for fqn, want in expected.items():
                got = sd[fqn].local
                assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
                assert torch.equal(as_bytes(got), as_bytes(want)), (
                    f"{fqn}: slice {sd[fqn].offsets}+{list(got.shape)} differs from the saved data")
