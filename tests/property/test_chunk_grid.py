"""Chunk geometry (``hashing.ChunkGrid``) and the hasher that follows it.

The regular grid must be exactly the v1 arithmetic (``chunk_span`` and the reads' rounding of
spec section 6). The segmented (v2, shard-aligned) grid must cut every tensor entry into chunks
from its own start: its chunks partition ``[header_size, size)``, none crosses an entry start,
and widening a span to whole chunks never reaches past the entries the span touches (so a
verified read of one shard never reads its neighbours' bytes). ``grid.hasher`` must give, for
bytes fed in any pieces, exactly the digests of the chunks the grid's bounds name.
"""

from __future__ import annotations

import os

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfmt.errors import ManifestError
from shardfmt.format.hashing import (
    ChunkGrid,
    ChunkHasher,
    chunk_span,
    combine,
    digest_bytes,
    format_digest,
    parse_digest,
    v2_file_digest,
)
from shardfmt.format.manifest import FileRecord

D = "xxh3-128:" + "0" * 32


@st.composite
def regular_cases(draw):
    c = draw(st.sampled_from([1, 3, 8, 64, 100, 4096]))
    size = draw(st.integers(0, 5 * c + 7))
    start = draw(st.integers(0, size))
    end = draw(st.integers(start, size))
    return size, c, start, end


@settings(max_examples=examples(500), deadline=None)
@given(case=regular_cases())
def test_regular_grid_is_the_v1_arithmetic(case):
    size, c, start, end = case
    g = ChunkGrid.regular(size=size, chunk_size=c)
    assert g.count == -(-size // c) == len(range(0, size, c))
    assert g.span(start, end) == chunk_span(start, end, c)
    if end > start:  # a verified read of [start, end) in v1: [floor(s / C) * C, min(ceil(e / C) * C, size))
        span = chunk_span(start, end, c)
        assert g.widen(start, end) == (span.start * c, min(span.stop * c, size))
        assert g.floor(start) == start // c * c
    for i in range(g.count):
        assert g.bounds(i) == (i * c, min(i * c + c, size))
    assert FileRecord(rank=0, size=size, header_size=0, header_digest=D, chunks=(), digest=D).grid(c) == g


def test_a_huge_regular_grid_answers_without_listing_its_chunks():
    g = ChunkGrid.regular(size=1 << 60, chunk_size=4096)
    assert g.count == 1 << 48
    assert g.span((1 << 59) + 5, (1 << 59) + 4097) == range(1 << 47, (1 << 47) + 2)
    assert g.bounds(g.count - 1) == ((1 << 60) - 4096, 1 << 60)


@st.composite
def segmented_files(draw):
    """(header_size, entries, chunk_size): entries contiguous from the header's end, some empty."""
    c = draw(st.sampled_from([1, 3, 8, 64, 100]))
    header = draw(st.integers(8, 40))
    entries = []
    pos = header
    for n in draw(st.lists(st.one_of(st.just(0), st.integers(1, 3 * c + 5)), max_size=8)):
        entries.append((pos, pos + n))
        pos += n
    return header, entries, c


def brute_chunks(header: int, entries, c: int) -> list[tuple[int, int]]:
    """Spec: every entry [s, e) cut into [s + i*C, min(s + (i+1)*C, e)); an empty entry has none."""
    return [(lo, min(lo + c, e)) for s, e in entries for lo in range(s, e, c)]


@settings(max_examples=examples(400), deadline=None)
@given(f=segmented_files(), data=st.data())
def test_segmented_grid_cuts_each_entry_from_its_own_start(f, data):
    header, entries, c = f
    size = entries[-1][1] if entries else header
    g = ChunkGrid.segmented(size=size, chunk_size=c, header_size=header, entries=entries)
    chunks = brute_chunks(header, entries, c)
    assert g.count == len(chunks)
    assert [g.bounds(i) for i in range(g.count)] == chunks
    # the chunks partition [header_size, size): the header has none, and each is 1..C bytes
    assert all(lo < hi <= lo + c for lo, hi in chunks)
    assert [lo for lo, _ in chunks[1:]] == [hi for _, hi in chunks[:-1]]
    assert (chunks[0][0], chunks[-1][1]) == (header, size) if chunks else size == header
    if size == header:
        return
    start = data.draw(st.integers(header, size - 1))
    end = data.draw(st.integers(start + 1, size))
    touched = [i for i, (lo, hi) in enumerate(chunks) if lo < end and start < hi]
    assert list(g.span(start, end)) == touched
    lo, hi = g.widen(start, end)
    assert (lo, hi) == (chunks[touched[0]][0], chunks[touched[-1]][1])
    assert g.widen(lo, hi) == (lo, hi) and g.floor(start) == lo
    assert hi - lo < (end - start) + 2 * c
    # widening never leaves the entries the span touches: not before the start of the entry
    # holding ``start``, not past the end of the entry holding ``end - 1``
    first = next((s, e) for s, e in entries if s <= start < e)
    last = next((s, e) for s, e in entries if s <= end - 1 < e)
    assert first[0] <= lo and hi <= last[1]
    k = g.span(start, start)  # an empty span touches no chunk
    assert len(k) == 0 and k.start == touched[0]
    assert g.span(size, size) == range(g.count, g.count)


def test_a_segmented_grid_refuses_the_header_and_bad_entries():
    g = ChunkGrid.segmented(size=100, chunk_size=8, header_size=10, entries=[(10, 30), (30, 30), (30, 100)])
    assert g.count == 3 + 9
    for call in (lambda: g.span(9, 12), lambda: g.widen(0, 10), lambda: g.floor(5), lambda: g.span(3, 3),
                 lambda: g.span(90, 101), lambda: g.hasher(0)):
        with pytest.raises(ManifestError, match=r"not in the chunked bytes \[10, 100\)"):
            call()
    with pytest.raises(ManifestError, match="byte 12 is not the first byte of a chunk"):
        g.hasher(12)
    with pytest.raises(ManifestError, match=r"entry bytes \[12, 30\) do not follow on at byte 10"):
        ChunkGrid.segmented(size=100, chunk_size=8, header_size=10, entries=[(12, 30), (30, 100)])
    with pytest.raises(ManifestError, match=r"entry bytes \[20, 100\) do not follow on at byte 30"):
        ChunkGrid.segmented(size=100, chunk_size=8, header_size=10, entries=[(10, 30), (20, 100)])
    with pytest.raises(ManifestError, match="the tensor entries end at byte 90, the file at 100"):
        ChunkGrid.segmented(size=100, chunk_size=8, header_size=10, entries=[(10, 90)])
    with pytest.raises(IndexError):
        g.bounds(12)


def test_a_huge_segmented_grid_answers_by_bisection():
    entries = [(64 + i * (1 << 40), 64 + (i + 1) * (1 << 40)) for i in range(1000)]
    g = ChunkGrid.segmented(size=entries[-1][1], chunk_size=1 << 20, header_size=64, entries=entries)
    assert g.count == 1000 << 20
    s = entries[500][0]
    assert g.widen(s - 1, s + 1) == (s - (1 << 20), s + (1 << 20))
    assert g.span(s - 1, s + 1) == range((500 << 20) - 1, (500 << 20) + 1)


def pieces(data: bytes, cuts: list[int]):
    edges = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


@settings(max_examples=examples(300), deadline=None)
@given(f=segmented_files(), data=st.data())
def test_the_grid_hasher_gives_the_digest_of_every_chunk_the_grid_bounds(f, data):
    header, entries, c = f
    size = entries[-1][1] if entries else header
    regular = data.draw(st.booleans())
    g = (ChunkGrid.regular(size=size, chunk_size=c) if regular
         else ChunkGrid.segmented(size=size, chunk_size=c, header_size=header, entries=entries))
    blob = os.urandom(size)
    k = data.draw(st.integers(0, g.count))  # start at any chunk (a part of a parallel write, a read)
    at = g.bounds(k)[0] if k < g.count else size
    fed = blob[at:]
    h = g.hasher(at)
    for piece in pieces(fed, data.draw(st.lists(st.integers(0, len(fed)), max_size=6))):
        h.update(piece)
    want = [digest_bytes(blob[lo:hi]) for lo, hi in map(g.bounds, range(k, g.count))]
    assert h.finish() == want and h.total == len(fed)


def test_the_v1_hasher_is_unchanged():
    blob = os.urandom(10_000)
    h = ChunkHasher(4096)
    for piece in pieces(blob, [1, 4095, 4097, 9000]):
        h.update(piece)
    assert h.finish() == [digest_bytes(blob[i:i + 4096]) for i in range(0, 10_000, 4096)]


def test_v2_derived_digests():
    """Shard digest: over its own chunks only, so it does not change when a neighbour does;
    file digest: the raw header digest, then every raw chunk digest in file order."""
    header, c = 24, 64
    entries = [(24, 24 + 150), (174, 174 + 64), (238, 238 + 10)]
    g = ChunkGrid.segmented(size=248, chunk_size=c, header_size=header, entries=entries)

    def digests(blob: bytes) -> list[str]:
        h = g.hasher(header)
        h.update(blob[header:])
        return h.finish()

    blob = bytearray(os.urandom(248))
    chunks = digests(bytes(blob))
    head = digest_bytes(bytes(blob[:header]))
    raw = parse_digest(head) + b"".join(parse_digest(d) for d in chunks)
    assert v2_file_digest(head, chunks) == format_digest(xxhash.xxh3_128(raw).digest()) != combine(chunks)
    shard = [combine(chunks[g.span(s, e).start:g.span(s, e).stop]) for s, e in entries]
    assert shard[1] == combine([digest_bytes(bytes(blob[174:238]))])
    blob[100] ^= 1  # a byte of the first entry changes: only its chunks and digest do
    again = digests(bytes(blob))
    assert [a != b for a, b in zip(chunks, again)] == [False, True, False, False, False]
    assert [combine(again[g.span(s, e).start:g.span(s, e).stop]) for s, e in entries][1:] == shard[1:]
    assert combine([]) == digest_bytes(b"") == "xxh3-128:99aa06d3014798d86001c324468d497f"
