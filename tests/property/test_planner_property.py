"""Property: the load planner's copies fill every target element exactly once, from the right source.

No files: each example builds a ``Manifest`` in memory (random tensors, random guillotine
tilings, shards laid out consecutively per file with random header sizes and gaps,
random tiny chunk sizes), asks ``plan_load`` for random target slices with random
``verify``/``max_gap``/``max_read``, then simulates every ``CopyItem`` element by element:
which file byte it reads, which shard element that byte is, and which target element it
lands in. Checked: exact single coverage of every target element, value mapping (source
global index == destination global index), items inside one shard, reads containing their
items, chunk alignment of verified reads, and exact byte counts for unverified gap-free
plans.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfmt.format.dtypes import itemsize
from shardfmt.format.manifest import FileRecord, Manifest, ShardRecord, TensorRecord
from shardfmt.layout.geometry import Box, intersect
from shardfmt.loading.planner import (
    DEFAULT_MAX_BOUNCE_READ,
    DEFAULT_MAX_GAP,
    DEFAULT_MAX_READ,
    TargetSlice,
    plan_load,
)

FAKE_DIGEST = "xxh3-128:" + "0" * 32
DTYPE_CODES = ("F32", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "F64")

shapes = st.integers(0, 4).flatmap(
    lambda nd: st.lists(st.one_of(st.integers(1, 9), st.integers(0, 9)), min_size=nd, max_size=nd).map(tuple))


def split_box(b: Box, d: int, cut: int) -> tuple[Box, Box]:
    o, n = b.offsets, b.lengths
    return (Box(o, n[:d] + (cut,) + n[d + 1:]),
            Box(o[:d] + (o[d] + cut,) + o[d + 1:], n[:d] + (n[d] - cut,) + n[d + 1:]))


@st.composite
def guillotine(draw, shape: tuple[int, ...], *, max_tiles: int = 8) -> list[Box]:
    tiles = [Box.full(shape)]
    for _ in range(draw(st.integers(0, max_tiles - 1))):
        cuttable = [i for i, b in enumerate(tiles) if any(n >= 2 for n in b.lengths)]
        if not cuttable:
            break
        i = draw(st.sampled_from(cuttable))
        b = tiles[i]
        d = draw(st.sampled_from([d for d, n in enumerate(b.lengths) if n >= 2]))
        tiles[i:i + 1] = split_box(b, d, draw(st.integers(1, b.lengths[d] - 1)))
    return tiles


@st.composite
def sub_box(draw, shape: tuple[int, ...]) -> Box:
    offs, lens = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        offs.append(o)
        lens.append(draw(st.integers(0, n - o)))
    return Box(tuple(offs), tuple(lens))


def file_record(**fields) -> FileRecord:
    """Build a FileRecord from whichever of ``fields`` the record has (it is gaining fields)."""
    known = {f.name for f in dataclasses.fields(FileRecord)}
    return FileRecord(**{k: v for k, v in fields.items() if k in known})


@st.composite
def manifests(draw) -> Manifest:
    """A manifest whose shards tile their tensors and sit at consecutive byte ranges per file."""
    # aligned: every shard starts at a multiple of 8 and every chunk boundary on an element
    # boundary (what shardfmt writes); otherwise anything goes (files from other writers)
    aligned = draw(st.booleans())
    chunk_size = draw(st.sampled_from([8, 64, 4096] if aligned else [1, 3, 8, 64, 100, 4096]))
    n_files = draw(st.integers(1, 3))
    names = [f"data/rank_{r:05d}.safetensors" for r in range(n_files)]
    placed: list[tuple[str, str, Box, int]] = []  # (fqn, file, box, itemsize)
    tensor_meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i in range(draw(st.integers(1, 3))):
        fqn = f"t{i}"
        shape = draw(shapes)
        dtype = draw(st.sampled_from(DTYPE_CODES))
        tensor_meta[fqn] = (dtype, shape)
        for box in draw(guillotine(shape)):
            placed.append((fqn, draw(st.sampled_from(names)), box, itemsize(dtype)))
    order = draw(st.permutations(range(len(placed))))
    header = {n: draw(st.integers(8, 300)) for n in names}  # a header of any size
    if aligned:
        header = {n: -(-h // 8) * 8 for n, h in header.items()}
    pos = dict(header)
    shards: dict[str, list[ShardRecord]] = {f: [] for f in tensor_meta}
    for k in order:
        fqn, fname, box, isz = placed[k]
        start = pos[fname] + draw(st.sampled_from([0, 0, 0, 1, 5, 77]))  # gaps: the planner must not care
        if aligned:
            start = -(-start // 8) * 8
        end = start + box.numel * isz
        pos[fname] = end
        shards[fqn].append(ShardRecord(offsets=box.offsets, lengths=box.lengths, file=fname,
                                       key=f"{fqn}@{box.offsets}", byte_range=(start, end), digest=FAKE_DIGEST))
    files = {}
    for r, n in enumerate(names):
        size = pos[n] + draw(st.sampled_from([0, 0, 3, 200]))
        files[n] = file_record(rank=r, size=size, chunks=(FAKE_DIGEST,) * math.ceil(size / chunk_size),
                               digest=FAKE_DIGEST, header_size=header[n], header_digest=FAKE_DIGEST)
    tensors = {fqn: TensorRecord(dtype=d, shape=s, shards=tuple(sorted(shards[fqn], key=lambda s: s.offsets)))
               for fqn, (d, s) in tensor_meta.items()}
    return Manifest(save_id="prop", created_at="2024-01-01T00:00:00.000000Z", chunk_size=chunk_size,
                    files=files, tensors=tensors)


@st.composite
def plan_cases(draw) -> dict:
    m = draw(manifests())
    targets: list[TargetSlice] = []
    for fqn, rec in m.tensors.items():
        kind = draw(st.sampled_from(["none", "full", "tiling", "boxes"]))
        if kind == "none":
            continue
        if kind == "full":
            boxes = [Box.full(rec.shape)]
        elif kind == "tiling":
            boxes = draw(guillotine(rec.shape, max_tiles=5))
        else:
            boxes = draw(st.lists(sub_box(rec.shape), min_size=1, max_size=4))
        for b in boxes:
            targets.append(TargetSlice(index=len(targets), fqn=fqn, box=b))
    return {
        "manifest": m,
        "targets": targets,
        "verify": draw(st.booleans()),
        "max_gap": draw(st.sampled_from([0, 0, 1, 16, DEFAULT_MAX_GAP])),
        "max_read": draw(st.sampled_from([1, 7, 64, 500, DEFAULT_MAX_READ])),
        # targets read through a bounce buffer (casts, CUDA), in reads of at most max_bounce_read
        "bounce": frozenset(draw(st.sets(st.sampled_from(range(len(targets))))) if targets else ()),
        "max_bounce_read": draw(st.sampled_from([1, 7, 64, 500, DEFAULT_MAX_BOUNCE_READ])),
    }


def plan_of(case: dict):
    return plan_load(case["manifest"], case["targets"], verify=case["verify"], max_gap=case["max_gap"],
                     max_read=case["max_read"], bounce=case.get("bounce", frozenset()),
                     max_bounce_read=case.get("max_bounce_read", DEFAULT_MAX_BOUNCE_READ))


def chunks_fall_between_elements(m: Manifest) -> bool:
    """Every chunk boundary of every file lies between two elements of any tensor it cuts."""
    for rec in m.tensors.values():
        isz = rec.itemsize
        if m.chunk_size % isz or any(s.byte_range[0] % isz for s in rec.shards):
            return False
    return True


def element_grid(lengths: tuple[int, ...]) -> np.ndarray:
    """Every multi-index of a box of ``lengths``, as an (n, ndim) array (one row for 0-d)."""
    if not lengths:
        return np.zeros((1, 0), dtype=np.int64)
    grids = np.meshgrid(*[np.arange(n, dtype=np.int64) for n in lengths], indexing="ij")
    return np.stack(grids, axis=-1).reshape(-1, len(lengths))


def targets_overlap(targets: list[TargetSlice]) -> bool:
    for i, a in enumerate(targets):
        for b in targets[i + 1:]:
            if a.fqn == b.fqn and not a.box.is_empty() and not b.box.is_empty():
                if a.box.ndim == 0 or intersect(a.box, b.box) is not None:
                    return True
    return False


def _carried_copy_case() -> dict:
    """Found by hypothesis: a verified read closed at a chunk boundary carries a column copy's
    tail; a later copy starting before that boundary must join the closed read, not the next."""
    u8 = [((0, 0, 0), (1, 1, 1), 8), ((0, 0, 1), (1, 1, 1), 9), ((0, 0, 2), (1, 1, 1), 10),
          ((0, 0, 3), (1, 1, 1), 11), ((0, 1, 0), (1, 1, 4), 12), ((1, 0, 0), (1, 2, 4), 17)]
    f = "data/rank_00000.safetensors"
    shards = tuple(ShardRecord(offsets=o, lengths=n, file=f, key=f"t0@{o}", byte_range=(b, b + math.prod(n)),
                               digest=FAKE_DIGEST) for o, n, b in u8)
    m = Manifest(save_id="prop", created_at="2024-01-01T00:00:00.000000Z", chunk_size=8,
                 files={f: file_record(rank=0, size=25, chunks=(FAKE_DIGEST,) * 4, digest=FAKE_DIGEST,
                                       header_size=8, header_digest=FAKE_DIGEST)},
                 tensors={"t0": TensorRecord(dtype="U8", shape=(2, 2, 4), shards=shards)})
    boxes = [Box((0, 0, 0), (1, 2, 1)), Box((1, 0, 0), (1, 2, 1)), Box((0, 0, 1), (2, 2, 3))]
    return {"manifest": m, "targets": [TargetSlice(index=i, fqn="t0", box=b) for i, b in enumerate(boxes)],
            "verify": True, "max_gap": 1, "max_read": 7}


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=plan_cases())
@example(case=_carried_copy_case())
def test_plan_copies_every_target_element_once_from_its_source(case):
    m: Manifest = case["manifest"]
    targets: list[TargetSlice] = case["targets"]
    plan = plan_of(case)
    assert plan.verify == case["verify"]
    writes = [np.zeros(t.box.lengths, dtype=np.int64) for t in targets]
    needed = 0
    for t in targets:
        needed += t.box.numel * m.tensors[t.fqn].itemsize
    assert plan.needed_bytes == needed

    for read in plan.reads:
        frec = m.files[read.file]
        rs, re_ = read.byte_range.start, read.byte_range.end
        assert 0 <= rs <= re_ <= frec.size, f"read [{rs}, {re_}) outside {read.file} ({frec.size} bytes)"
        if case["verify"]:
            c = m.chunk_size
            assert rs % c == 0, f"verified read starts at {rs}, not a multiple of chunk {c}"
            assert re_ % c == 0 or re_ == frec.size, f"verified read ends at {re_} mid-chunk (chunk {c})"
        else:
            biggest = max(m.tensors[targets[it.target].fqn].itemsize for it in read.items)
            assert read.byte_range.length <= max(case["max_read"], biggest), "read exceeds max_read"
        assert read.items, "a read with nothing to copy"
        for it in read.items:
            assert rs <= it.src_start < it.src_end <= re_, \
                f"item [{it.src_start}, {it.src_end}) not inside its read [{rs}, {re_})"
            t = targets[it.target]
            rec = m.tensors[t.fqn]
            isz = rec.itemsize
            homes = [s for s in rec.shards if s.file == read.file
                     and s.byte_range[0] <= it.src_start and it.src_end <= s.byte_range[1]]
            assert len(homes) == 1, f"item [{it.src_start}, {it.src_end}) of {t.fqn} lies in {len(homes)} shards"
            shard = homes[0]
            assert len(it.src_lengths) == len(it.dst_offsets) == len(rec.shape) == len(it.src_strides)
            assert it.numel > 0
            idx = element_grid(it.src_lengths)
            strides = np.asarray(it.src_strides, dtype=np.int64).reshape(-1)
            byte = it.src_start + (idx @ strides if idx.shape[1] else np.zeros(len(idx), np.int64)) * isz
            assert byte.min() == it.src_start, "item's first element is not at src_start"
            assert byte.max() + isz == it.src_end, "item's bytes are not tight around its elements"
            rel = byte - shard.byte_range[0]
            assert np.all(rel % isz == 0)
            flat = rel // isz
            assert np.all(flat < max(1, math.prod(shard.lengths)))
            if shard.lengths:
                local = np.stack(np.unravel_index(flat, shard.lengths), axis=-1)
            else:
                local = np.zeros((len(flat), 0), dtype=np.int64)
            src_global = local + np.asarray(shard.offsets, dtype=np.int64)
            dst_local = idx + np.asarray(it.dst_offsets, dtype=np.int64)
            dst_global = dst_local + np.asarray(t.box.offsets, dtype=np.int64)
            assert np.array_equal(src_global, dst_global), \
                f"{t.fqn}: item maps source elements to other destination elements"
            assert np.all(dst_local >= 0) and np.all(dst_local < np.asarray(t.box.lengths, dtype=np.int64)), \
                "item writes outside its target"
            if t.box.ndim:
                np.add.at(writes[it.target], tuple(dst_local.T), 1)
            else:
                writes[it.target] += 1

    for t, w in zip(targets, writes):
        if w.size:
            assert w.min() == 1 and w.max() == 1, (
                f"target {t.index} ({t.fqn} {list(t.box.offsets)}+{list(t.box.lengths)}): elements written "
                f"{w.min()}..{w.max()} times")

    if not case["verify"] and case["max_gap"] == 0:
        if targets_overlap(targets):
            assert plan.bytes_to_read <= plan.needed_bytes
        else:
            assert plan.bytes_to_read == plan.needed_bytes, (
                f"unverified, gap-free plan reads {plan.bytes_to_read} bytes for {plan.needed_bytes} needed")


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data())
def test_split_block_puts_every_element_on_its_side_of_the_cut_once(data):
    from shardfmt.layout.geometry import block_end, row_major_strides, split_block

    shape = data.draw(st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple))
    sub = data.draw(sub_box(shape))
    isz = data.draw(st.sampled_from([1, 2, 4, 8]))
    strides = row_major_strides(shape)
    start = sum(o * s for o, s in zip(sub.offsets, strides)) * isz
    end = block_end(sub.lengths, strides, isz, start)
    cut = data.draw(st.integers(start - 2, end + 2))
    got = split_block(sub.lengths, strides, isz, start, cut)
    if got is None:  # only when the cut falls strictly inside an element
        assert (cut - start) % isz and start < cut < end
        return
    seen = np.zeros(sub.lengths, dtype=np.int64)
    for boxes, side in zip(got, ("before", "after")):
        for b in boxes:
            assert not b.is_empty() and Box.full(sub.lengths).contains(b)
            first = start + sum(o * s for o, s in zip(b.offsets, strides)) * isz
            last = block_end(b.lengths, strides, isz, first)
            assert (last <= cut) if side == "before" else (first >= cut), (side, b, first, last, cut)
            seen[b.slices()] += 1
    assert seen.size == 0 or (seen.min() == 1 and seen.max() == 1)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=plan_cases())
@example(case=_carried_copy_case())
def test_no_byte_of_a_file_is_read_twice_in_one_plan(case):
    """In-place and bounced copies sharing bytes or a hash chunk: the bytes are read once (the
    in-place part is copied out of the bounced read), verified or not. Verified plans can cut a
    copy only between elements, so that half is checked where chunk boundaries fall there."""
    m: Manifest = case["manifest"]
    plan = plan_of(case)
    if case["verify"] and not chunks_fall_between_elements(m):
        return
    per_file: dict[str, list[tuple[int, int]]] = {}
    for read in plan.reads:
        per_file.setdefault(read.file, []).append((read.byte_range.start, read.byte_range.end))
    for fname, spans in per_file.items():
        spans.sort()
        union = 0
        reach = 0
        for s, e in spans:
            union += max(0, e - max(s, reach))
            reach = max(reach, e)
        assert sum(e - s for s, e in spans) == union, f"{fname}: reads {spans} overlap"
    cap = min(case.get("max_bounce_read", DEFAULT_MAX_BOUNCE_READ), case["max_read"])
    for read in plan.reads:
        if not case["verify"] and any(it.target in case.get("bounce", ()) for it in read.items):
            biggest = max(it.itemsize for it in read.items)
            assert read.byte_range.length <= max(cap, biggest), "a bounced read exceeds max_bounce_read"
