"""Property: the load planner on files whose hash chunks are cut at each tensor entry (v2).

Each example builds a manifest in memory whose files carry ``FileRecord.segments``: the shards
are tensor entries packed from the header's end (as safetensors requires), between entries that
no target reads (other tensors' shards, in a real file) and empty ones. Random targets, tiny
chunk sizes, ``verify``, ``max_gap``, ``max_read`` and bounced targets as in
``test_planner_property``. Checked: every target element is copied once, from its source
element; a verified read is whole chunks of the file's segmented grid, so every copied byte is
hashed, and never reaches past the shards its copies come from; no chunk is read twice (where
chunk boundaries fall between elements); with no gap allowed, every chunk read holds a byte a
target needs, so a read costs at most the bytes needed plus two chunks per contiguous span.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner_property import (
    DTYPE_CODES,
    FAKE_DIGEST,
    element_grid,
    guillotine,
    shapes,
    sub_box,
)
from tiers import examples

from shardfmt.format.dtypes import itemsize
from shardfmt.format.manifest import FileRecord, Manifest, ShardRecord, TensorRecord, Topology
from shardfmt.layout.geometry import Box
from shardfmt.loading.planner import DEFAULT_MAX_GAP, DEFAULT_MAX_READ, TargetSlice, plan_load


@st.composite
def segmented_manifests(draw) -> Manifest:
    """Shards tiling their tensors, packed per file with unread and empty entries between them."""
    aligned = draw(st.booleans())  # shard starts on multiples of 8 and chunks whole elements
    chunk_size = draw(st.sampled_from([8, 16, 64, 4096] if aligned else [1, 3, 8, 64, 100]))
    names = [f"data/rank_{r:05d}.safetensors" for r in range(draw(st.integers(1, 3)))]
    placed: list[tuple[str, str, Box, int]] = []
    tensor_meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i in range(draw(st.integers(1, 3))):
        fqn, shape, dtype = f"t{i}", draw(shapes), draw(st.sampled_from(DTYPE_CODES))
        tensor_meta[fqn] = (dtype, shape)
        for box in draw(guillotine(shape)):
            placed.append((fqn, draw(st.sampled_from(names)), box, itemsize(dtype)))
    header = {n: draw(st.integers(8, 300)) for n in names}
    if aligned:
        header = {n: -(-h // 8) * 8 for n, h in header.items()}
    entries: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
    pos = dict(header)

    def entry(fname: str, n: int) -> tuple[int, int]:
        entries[fname].append((pos[fname], pos[fname] + n))
        pos[fname] += n
        return entries[fname][-1]

    shards: dict[str, list[ShardRecord]] = {f: [] for f in tensor_meta}
    for k in draw(st.permutations(range(len(placed)))):
        fqn, fname, box, isz = placed[k]
        other = draw(st.sampled_from([None, None, 0, 1, 5, 77]))  # an entry no target reads
        if other is not None:
            entry(fname, (-(-(pos[fname] + other) // 8) * 8 - pos[fname]) if aligned else other)
        start, end = entry(fname, box.numel * isz)
        shards[fqn].append(ShardRecord(offsets=box.offsets, lengths=box.lengths, file=fname,
                                       key=f"{fqn}@{box.offsets}", byte_range=(start, end), digest=FAKE_DIGEST))
    files = {}
    for r, n in enumerate(names):
        entry(n, draw(st.sampled_from([0, 3, 200])))
        frec = FileRecord(rank=r, size=pos[n], header_size=header[n], header_digest=FAKE_DIGEST, chunks=(),
                          digest=FAKE_DIGEST, segments=tuple(entries[n]))
        files[n] = FileRecord(rank=r, size=pos[n], header_size=header[n], header_digest=FAKE_DIGEST,
                              chunks=(FAKE_DIGEST,) * frec.grid(chunk_size).count, digest=FAKE_DIGEST,
                              segments=frec.segments)
    tensors = {fqn: TensorRecord(dtype=d, shape=s, shards=tuple(sorted(shards[fqn], key=lambda s: s.offsets)))
               for fqn, (d, s) in tensor_meta.items()}
    return Manifest(save_id="prop", created_at="2024-01-01T00:00:00.000000Z", chunk_size=chunk_size,
                    files=files, tensors=tensors, format_version=2)


@st.composite
def cases(draw) -> dict:
    m = draw(segmented_manifests())
    targets: list[TargetSlice] = []
    for fqn, rec in m.tensors.items():
        kind = draw(st.sampled_from(["none", "full", "tiling", "boxes"]))
        if kind == "none":
            continue
        boxes = ([Box.full(rec.shape)] if kind == "full" else draw(guillotine(rec.shape, max_tiles=5))
                 if kind == "tiling" else draw(st.lists(sub_box(rec.shape), min_size=1, max_size=4)))
        for b in boxes:
            targets.append(TargetSlice(index=len(targets), fqn=fqn, box=b))
    return {
        "manifest": m, "targets": targets,
        "verify": draw(st.booleans()),
        "max_gap": draw(st.sampled_from([0, 0, 1, 16, DEFAULT_MAX_GAP])),
        "max_read": draw(st.sampled_from([1, 7, 64, 500, DEFAULT_MAX_READ])),
        "bounce": frozenset(draw(st.sets(st.sampled_from(range(len(targets))))) if targets else ()),
        "max_bounce_read": draw(st.sampled_from([1, 7, 64, 500])),
    }


def element_bytes(it, isz: int) -> np.ndarray:
    """The file offset of every element an item copies."""
    idx = element_grid(it.src_lengths)
    strides = np.asarray(it.src_strides, dtype=np.int64).reshape(-1)
    return it.src_start + (idx @ strides if idx.shape[1] else np.zeros(len(idx), np.int64)) * isz


def runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The maximal contiguous runs of the union of ``spans``."""
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_plan_on_segmented_grids_reads_whole_chunks_of_each_shard_once(case):
    m: Manifest = case["manifest"]
    targets: list[TargetSlice] = case["targets"]
    plan = plan_load(m, targets, verify=case["verify"], max_gap=case["max_gap"], max_read=case["max_read"],
                     bounce=case["bounce"], max_bounce_read=case["max_bounce_read"])
    grids = {f: m.files[f].grid(m.chunk_size) for f in m.files}
    assert {f: plan.grids[f] for f in plan.grids} == {f: grids[f] for f in plan.grids}
    writes = [np.zeros(t.box.lengths, dtype=np.int64) for t in targets]
    needed: dict[str, list[tuple[int, int]]] = {}  # per file: the bytes of every element copied
    for read in plan.reads:
        g, rs, re_ = grids[read.file], read.byte_range.start, read.byte_range.end
        if case["verify"]:
            assert g.widen(rs, re_) == (rs, re_), f"verified read [{rs}, {re_}) is not whole chunks of {read.file}"
        for it in read.items:
            t = targets[it.target]
            rec = m.tensors[t.fqn]
            isz = rec.itemsize
            assert rs <= it.src_start < it.src_end <= re_
            (shard,) = [s for s in rec.shards if s.file == read.file
                        and s.byte_range[0] <= it.src_start and it.src_end <= s.byte_range[1]]
            if case["verify"]:  # the chunks hashed for this copy are its own shard's
                lo, hi = g.widen(it.src_start, it.src_end)
                assert shard.byte_range[0] <= lo and hi <= shard.byte_range[1], \
                    f"copy [{it.src_start}, {it.src_end}) widens to [{lo}, {hi}), past its shard {shard.byte_range}"
            byte = element_bytes(it, isz)
            needed.setdefault(read.file, []).extend((int(b), int(b) + isz) for b in byte)
            local = np.stack(np.unravel_index((byte - shard.byte_range[0]) // isz, shard.lengths), axis=-1) \
                if shard.lengths else np.zeros((len(byte), 0), dtype=np.int64)
            dst = element_grid(it.src_lengths) + np.asarray(it.dst_offsets, dtype=np.int64)
            assert np.array_equal(local + np.asarray(shard.offsets, dtype=np.int64),
                                  dst + np.asarray(t.box.offsets, dtype=np.int64)), "copy maps to the wrong element"
            if t.box.ndim:
                np.add.at(writes[it.target], tuple(dst.T), 1)
            else:
                writes[it.target] += 1
    for t, w in zip(targets, writes):
        assert w.size == 0 or (w.min() == 1 and w.max() == 1), f"target {t.index}: elements copied {w.min()}..{w.max()} times"
    if not case["verify"]:
        return
    c = m.chunk_size
    per_file: dict[str, list[int]] = {}
    for read in plan.reads:  # every chunk read, by index
        per_file.setdefault(read.file, []).extend(grids[read.file].span(read.byte_range.start, read.byte_range.end))
    if all(c % rec.itemsize == 0 for rec in m.tensors.values()):  # chunk boundaries between elements
        for f, ks in per_file.items():
            assert len(ks) == len(set(ks)), f"{f}: a chunk is read twice"
    if case["max_gap"] == 0:
        for f, ks in per_file.items():
            g, spans = grids[f], runs(needed[f])
            holding = {k for s, e in spans for k in g.span(s, e)}
            assert set(ks) <= holding, f"{f}: chunks {sorted(set(ks) - holding)} are read and hold no needed byte"
            got = sum(g.bounds(k)[1] - g.bounds(k)[0] for k in set(ks))
            assert got <= sum(e - s + 2 * c for s, e in spans), f"{f}: {got} bytes read for {spans}"


def test_a_shard_read_on_a_segmented_grid_stops_at_its_neighbours():
    """A 1000-byte shard between two others, C = 4096: v1 hashes the whole file's first chunk,
    v2 reads exactly the shard's own bytes."""
    f = "data/rank_00000.safetensors"
    ents = ((64, 564), (564, 1564), (1564, 2064))
    shards = tuple(ShardRecord(offsets=(o,), lengths=(n,), file=f, key=f"w@{o}", byte_range=e, digest=FAKE_DIGEST)
                   for o, n, e in zip((0, 500, 1500), (500, 1000, 500), ents))
    tensors = {"w": TensorRecord(dtype="U8", shape=(2000,), shards=shards)}
    want = [TargetSlice(index=0, fqn="w", box=Box((600,), (10,)))]
    for segments, chunks, expect in ((None, 1, (0, 2064)), (ents, 3, (564, 1564))):
        frec = FileRecord(rank=0, size=2064, header_size=64, header_digest=FAKE_DIGEST,
                          chunks=(FAKE_DIGEST,) * chunks, digest=FAKE_DIGEST, segments=segments)
        m = Manifest(save_id="x", created_at="x", chunk_size=4096, files={f: frec}, tensors=tensors)
        (read,) = plan_load(m, want, verify=True).reads
        assert (read.byte_range.start, read.byte_range.end) == expect
        assert math.prod(read.items[0].src_lengths) == 10


def test_a_copy_cut_short_by_an_unaligned_element_is_never_left_before_the_read_it_joins():
    """Hypothesis found it (CI, 2026-12-02): chunk 100 over 8-byte elements, reads of at most 64
    bytes. A read's end fell inside an element of the next copy, which was then left behind and
    joined the next read starting after it (bytes [144, 176) in a read [156, 216)). It is now
    carried whole: the next read starts in its chunk (read twice, as unaligned chunks may be)."""
    z = "xxh3-128:" + "0" * 32
    f = "data/rank_00000.safetensors"
    files = {f: FileRecord(rank=0, size=252, header_size=8, header_digest=z, chunks=(z,) * 5, digest=z,
                           segments=((8, 56), (56, 216), (216, 248), (248, 252), (252, 252)))}
    t0 = TensorRecord(dtype="I64", shape=(5, 6), shards=(
        ShardRecord(offsets=(0, 0), lengths=(1, 6), file=f, key="t0@(0, 0)", byte_range=(8, 56), digest=z),
        ShardRecord(offsets=(1, 0), lengths=(4, 5), file=f, key="t0@(1, 0)", byte_range=(56, 216), digest=z),
        ShardRecord(offsets=(1, 5), lengths=(4, 1), file=f, key="t0@(1, 5)", byte_range=(216, 248), digest=z)))
    m = Manifest(save_id="prop", created_at="2024-01-01T00:00:00.000000Z", step=None, writer={}, chunk_size=100,
                 metadata=None, topology=Topology(world_size=1, mesh=()), files=files, tensors={"t0": t0},
                 storages={}, values={}, format_version=2, ranks=())
    targets = [TargetSlice(index=0, fqn="t0", box=Box((0, 0), (5, 1))),
               TargetSlice(index=1, fqn="t0", box=Box((0, 1), (5, 5)))]
    plan = plan_load(m, targets, verify=True, max_gap=1 << 20, max_read=64, bounce=frozenset(), max_bounce_read=64)
    for read in plan.reads:
        for it in read.items:
            assert read.byte_range.start <= it.src_start < it.src_end <= read.byte_range.end, (read.byte_range, it)
    copied = sum(math.prod(it.src_lengths) * it.itemsize for r in plan.reads for it in r.items)
    assert copied == 30 * 8  # every element of the tensor, once
