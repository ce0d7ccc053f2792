"""The executor verifies reads against shard-aligned (v2) chunks of a real data file.

The file is written by the v1 writer (chunks from byte 0); its chunk digests are then
recomputed over its bytes with every tensor entry cut from its own start
(``FileRecord.segments``, as the v2 reader hands them over) and the load is planned and
executed against those records: the bytes must arrive intact, and a byte flipped inside one
shard-aligned chunk must be caught by that chunk. A v2 save must record exactly those digests.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import torch

import shardfmt
from shardfmt.errors import IntegrityError
from shardfmt.format.hashing import digest_bytes, v2_file_digest
from shardfmt.format.manifest import Manifest
from shardfmt.format.safetensors import decode_header
from shardfmt.loading.executor import Executor
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.planner import LoadPlan
from shardfmt.loading.reader import open_checkpoint
from shardfmt.loading.request import request_load
from shardfmt.loading.targets import plan_reads

C = 4096


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3000, generator=g),  # 12000 bytes: 3 chunks, the last partial
        "b": torch.randint(-999, 999, (5003,), dtype=torch.int16, generator=g),  # ends off the v1 grid
        "c": torch.randn(7, 33, generator=g).to(torch.bfloat16),
        "d": torch.zeros(0),  # an empty entry: no chunk
        "e": torch.tensor(3.5, dtype=torch.float64),
        "f": torch.randn(2048, generator=g),  # exactly 2 chunks
    }


def _segmented(path: str) -> Manifest:
    """The checkpoint's manifest with each file's chunks recomputed shard-aligned over its bytes."""
    m = open_checkpoint(path).manifest
    files = {}
    for name, frec in m.files.items():
        with open(os.path.join(path, name), "rb") as fh:
            blob = fh.read()
        entries = decode_header(blob[:frec.header_size], source=name, file_size=frec.size).entries.values()
        rec = replace(frec, segments=tuple(sorted((e.start, e.end) for e in entries)))
        h = rec.grid(m.chunk_size).hasher(frec.header_size)
        h.update(blob[frec.header_size:])
        chunks = tuple(h.finish())
        files[name] = replace(rec, chunks=chunks, digest=v2_file_digest(frec.header_digest, chunks))
    return replace(m, files=files)


def _load(path: str, m: Manifest, state: dict, opts: LoadOptions) -> LoadPlan:
    ckpt = open_checkpoint(path)
    opts = opts.for_storage(ckpt.storage)
    req = request_load(state, m, opts, rank=0, world_size=1, source=ckpt.path)
    plan = plan_reads(m, req.targets, opts)
    Executor(ckpt.storage, ckpt.path, req.targets, opts).run(plan)
    return plan


def _empty_like(state: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    out["c"] = torch.zeros(33, 7, dtype=torch.bfloat16).T  # strided: read through a bounce buffer
    return out


@pytest.mark.parametrize("opts", [LoadOptions(), LoadOptions(max_gap=0, max_read=5000, workers=1)],
                         ids=["default", "small-reads"])
def test_a_load_verifies_shard_aligned_chunks_and_gets_every_byte(tmp_path, opts):
    path = str(tmp_path / "ck")
    state = _state()
    shardfmt.save(state, path, chunk_size=C, format_version=1)
    m = _segmented(path)
    (name,) = m.files
    grid, v1 = m.files[name].grid(C), replace(m.files[name], segments=None).grid(C)
    assert grid != v1 and grid.count == sum(-(-t.nbytes // C) for t in state.values())
    out = _empty_like(state)
    plan = _load(path, m, out, opts)
    assert plan.grids[name] == grid
    for r in plan.reads:  # whole shard-aligned chunks, not v1 ones
        assert grid.widen(r.byte_range.start, r.byte_range.end) == (r.byte_range.start, r.byte_range.end)
    assert any(r.byte_range.start % C for r in plan.reads)
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_a_flipped_byte_is_caught_by_its_shard_aligned_chunk(tmp_path):
    """A byte of ``c`` (one chunk) is flipped: the load names that chunk. ``b``, the entry just
    before ``c``, shares a v1 chunk with that byte but none of its shard-aligned chunks does,
    so on its own it still loads (and only the v1 records refuse it)."""
    path = str(tmp_path / "ck")
    state = _state()
    shardfmt.save(state, path, chunk_size=C, format_version=1)
    v1 = open_checkpoint(path).manifest
    m = _segmented(path)
    (name,) = m.files
    frec = m.files[name]
    grid = frec.grid(C)
    (b,), (c,) = m.tensors["b"].shards, m.tensors["c"].shards
    assert b.byte_range[1] == c.byte_range[0]
    (k,) = grid.span(*c.byte_range)
    lo, hi = grid.bounds(k)
    assert (lo, hi) == c.byte_range and lo % C  # not a v1 chunk: the v1 one holds b's tail too
    with open(os.path.join(path, name), "r+b") as fh:
        fh.seek(lo + 1)
        byte = fh.read(1)
        fh.seek(lo + 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    want = re.escape(f"{name}: chunk {k} (bytes [{lo}, {hi})) hashes to ") + r"xxh3-128:[0-9a-f]{32}, " \
        + re.escape(f"manifest says {frec.chunks[k]}")
    with pytest.raises(IntegrityError, match=want):
        _load(path, m, _empty_like(state), LoadOptions())
    got = {"b": torch.zeros_like(state["b"])}
    _load(path, m, got, LoadOptions(strict=False))
    assert torch.equal(got["b"], state["b"])
    with pytest.raises(IntegrityError, match=re.escape(f"{name}: chunk {lo // C} ")):
        _load(path, v1, {"b": torch.zeros_like(state["b"])}, LoadOptions(strict=False))


def test_the_v2_writer_hashes_the_chunks_its_grid_bounds(tmp_path):
    """What a v2 save records is each chunk of the segmented grid hashed alone."""
    path = str(tmp_path / "ck")
    shardfmt.save(_state(), path, chunk_size=C)
    m = open_checkpoint(path).manifest
    assert m.format_version == 2
    for name, frec in m.files.items():
        with open(os.path.join(path, name), "rb") as fh:
            blob = fh.read()
        grid = frec.grid(C)
        assert frec.segments is not None and grid.chunked_from == frec.header_size
        assert frec.chunks == tuple(digest_bytes(blob[lo:hi]) for lo, hi in map(grid.bounds, range(grid.count)))
        assert frec.digest == v2_file_digest(digest_bytes(blob[:frec.header_size]), frec.chunks)
