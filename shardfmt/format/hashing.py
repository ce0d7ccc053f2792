"""Chunk hashing: the only home of the hash algorithm, of digest strings and of chunk geometry.

A data file is cut into chunks of at most ``chunk_size`` bytes (1 MiB by default); each
chunk is hashed with xxh3-128 while the file is written, in the same pass. A reader verifies
exactly the chunks it touches. Where the chunks lie is a ``ChunkGrid``: v1 cuts the whole
file from byte 0; v2 cuts each tensor entry from its own start (the header has its own
digest), so a reader of one shard never hashes its neighbour's bytes. The file digest and a
shard's digest are derived from chunk digests (never from a second pass over the data), so
saving costs one hash pass: a shard digest is ``combine`` over ``grid.span`` of its bytes
(v1 and v2 alike), a file digest ``combine`` over all chunks (v1) or ``v2_file_digest``.
xxh3-128 is not cryptographic: it detects corruption, not tampering.

Digest strings read ``"xxh3-128:<32 hex digits>"``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from shardfmt.errors import ManifestError

ALGORITHM = "xxh3-128"
DEFAULT_CHUNK_SIZE = 1 << 20
_PREFIX = ALGORITHM + ":"


def format_digest(raw: bytes) -> str:
    """Return the digest string for a raw 16-byte digest."""
    return _PREFIX + raw.hex()


_DIGEST_RE = re.compile(re.escape(_PREFIX) + "[0-9a-f]{32}")


def parse_digest(text: str) -> bytes:
    """Return the raw 16 bytes of a digest string; raise ValueError if malformed."""
    if not isinstance(text, str) or not _DIGEST_RE.fullmatch(text):
        raise ValueError(f"not a {ALGORITHM} digest (32 lowercase hex digits): {str(text)[:80]!r}")
    return bytes.fromhex(text[len(_PREFIX):])


def xxh3_raw(data) -> bytes:
    """Return the raw 16-byte digest of a bytes-like object."""
    return xxhash.xxh3_128(data).digest()


def digest_bytes(data) -> str:
    """Return the digest string of a bytes-like object."""
    return format_digest(xxhash.xxh3_128(data).digest())


def combine(chunk_digests: Iterable[str]) -> str:
    """Return the digest derived from an ordered run of chunk digests (file and shard digests)."""
    h = xxhash.xxh3_128()
    for d in chunk_digests:
        h.update(parse_digest(d))
    return format_digest(h.digest())


def shard_digest(pieces: Iterable, chunk_size: int) -> str:
    """The shard digest (spec section 6) of a shard's bytes, fed in pieces of any size: the
    digest of its ``chunk_size`` chunks' raw digests, concatenated. Raw digests throughout: no
    digest string is made per chunk."""
    out = xxhash.xxh3_128()
    h = xxhash.xxh3_128()
    whole = xxhash.xxh3_128_digest
    filled = 0
    for piece in pieces:
        mv = memoryview(piece).cast("B")
        pos, n = 0, len(mv)
        if filled == 0 and n >= chunk_size:  # whole chunks of the piece, one call each
            end = n - n % chunk_size
            out.update(b"".join([whole(mv[o:o + chunk_size]) for o in range(0, end, chunk_size)]))
            pos = end
        while pos < n:
            take = min(chunk_size - filled, n - pos)
            h.update(mv[pos:pos + take])
            pos += take
            filled += take
            if filled == chunk_size:
                out.update(h.digest())
                h.reset()
                filled = 0
    if filled:
        out.update(h.digest())
    return format_digest(out.digest())


def v2_file_digest(header_digest: str, chunk_digests: Iterable[str]) -> str:
    """Return a v2 file digest: xxh3-128 of the raw header digest, then every raw chunk digest
    in file order (the header has no chunk in v2, so its digest is chained in first)."""
    h = xxhash.xxh3_128(parse_digest(header_digest))
    for d in chunk_digests:
        h.update(parse_digest(d))
    return format_digest(h.digest())


def chunk_span(start: int, end: int, chunk_size: int) -> range:
    """Return the indices of the chunks that bytes ``[start, end)`` touch."""
    if end <= start:
        return range(start // chunk_size, start // chunk_size)
    return range(start // chunk_size, (end - 1) // chunk_size + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkGrid:
    """Where a data file's hash chunks lie: the only home of chunk arithmetic for readers.

    Regular (v1, ``starts`` None): chunk ``i`` is bytes ``[i*C, min((i+1)*C, size))``, from
    byte 0, header included. Segmented (v2, shard-aligned): bytes ``[chunked_from, size)``
    (``chunked_from`` = the header size) are cut into segments, one per non-empty tensor entry,
    starting at ``starts``; each segment is cut into chunks from its own start, so no chunk
    crosses an entry start. The header has no chunk (``header_digest`` covers it): a span that
    reaches into it is an error. Chunks are numbered in file order. A query costs O(1) on a
    regular grid and a bisection over the segment starts on a segmented one; no per-chunk list
    is built. Build one with ``regular`` or ``segmented``.
    """

    size: int
    chunk_size: int
    chunked_from: int = 0
    starts: tuple[int, ...] | None = None  # segmented: start of each non-empty entry, ascending
    firsts: tuple[int, ...] = ()  # segmented: index of each segment's first chunk, then the count

    @classmethod
    def regular(cls, *, size: int, chunk_size: int) -> ChunkGrid:
        """The v1 grid: fixed-size chunks from byte 0."""
        return cls(size=size, chunk_size=chunk_size)

    @classmethod
    def segmented(cls, *, size: int, chunk_size: int, header_size: int,
                  entries: Iterable[tuple[int, int]]) -> ChunkGrid:
        """The v2 grid of a file whose tensor entries hold byte ranges ``entries`` ([start, end),
        in file order, contiguous from ``header_size`` to ``size``, as safetensors requires).
        An empty entry has no chunk: it is skipped wherever it sits in ``[header_size, size]``."""
        starts: list[int] = []
        firsts = [0]
        pos = header_size
        for s, e in entries:
            if e == s and header_size <= s <= size:
                continue
            if s != pos or e < s:
                raise ManifestError(f"entry bytes [{s}, {e}) do not follow on at byte {pos}: the tensor "
                                    f"entries must be sorted and contiguous from the header's end ({header_size})")
            starts.append(s)
            firsts.append(firsts[-1] + -(-(e - s) // chunk_size))
            pos = e
        if pos != size:
            raise ManifestError(f"the tensor entries end at byte {pos}, the file at {size}")
        return cls(size=size, chunk_size=chunk_size, chunked_from=header_size, starts=tuple(starts),
                   firsts=tuple(firsts))

    @property
    def count(self) -> int:
        """The number of chunks (the length of the file's ``chunks``)."""
        if self.starts is None:
            return -(-self.size // self.chunk_size)
        return self.firsts[-1]

    def _check(self, start: int, end: int) -> None:
        if not (self.chunked_from <= start <= self.size and end <= self.size):
            where = " (the header has no chunk: a data read never starts there)" if start < self.chunked_from else ""
            raise ManifestError(f"bytes [{start}, {end}) are not in the chunked bytes "
                                f"[{self.chunked_from}, {self.size}) of the file{where}")

    def _segment(self, pos: int) -> int:
        """Segmented: the index of the segment holding byte ``pos`` (``_check``ed)."""
        return bisect.bisect_right(self.starts, pos) - 1

    def _segment_end(self, j: int) -> int:
        return self.starts[j + 1] if j + 1 < len(self.starts) else self.size

    def span(self, start: int, end: int) -> range:
        """Return the indices of the chunks that bytes ``[start, end)`` touch (an empty span:
        none, at the chunk holding ``start``)."""
        c = self.chunk_size
        self._check(start, end)
        if self.starts is None:
            if end <= start:
                return range(start // c, start // c)
            return range(start // c, (end - 1) // c + 1)
        if end <= start:
            k = self.count if start == self.size else self._index(start)
            return range(k, k)
        return range(self._index(start), self._index(end - 1) + 1)

    def _index(self, pos: int) -> int:
        """Segmented: the index of the chunk holding byte ``pos`` (``_check``ed)."""
        j = self._segment(pos)
        return self.firsts[j] + (pos - self.starts[j]) // self.chunk_size

    def bounds(self, i: int) -> tuple[int, int]:
        """Return the byte bounds ``(start, end)`` of chunk ``i``."""
        if not 0 <= i < self.count:
            raise IndexError(f"chunk {i} of a file with {self.count} chunks")
        c = self.chunk_size
        if self.starts is None:
            return i * c, min(i * c + c, self.size)
        j = bisect.bisect_right(self.firsts, i) - 1
        lo = self.starts[j] + (i - self.firsts[j]) * c
        return lo, min(lo + c, self._segment_end(j))

    def floor(self, pos: int) -> int:
        """Return the first byte of the chunk holding byte ``pos``."""
        c = self.chunk_size
        self._check(pos, pos + 1)
        if self.starts is None:
            return pos // c * c
        s = self.starts[self._segment(pos)]
        return s + (pos - s) // c * c

    def widen(self, start: int, end: int) -> tuple[int, int]:
        """Return ``[start, end)`` widened to whole chunks: from the start of the chunk holding
        ``start`` to the end of the chunk holding ``end - 1`` (an empty span stays empty). On a
        segmented grid the result never leaves the entries the span touches."""
        c, starts = self.chunk_size, self.starts
        if starts is None and 0 <= start < end <= self.size:  # v1, the planner's hot path
            return start // c * c, min(-(-end // c) * c, self.size)
        self._check(start, end)
        if end <= start:
            return start, start
        if starts is None:
            return start // c * c, min(-(-end // c) * c, self.size)
        j = bisect.bisect_right(starts, start) - 1
        k = j if j + 1 == len(starts) or end <= starts[j + 1] else bisect.bisect_right(starts, end - 1) - 1
        s, e = starts[j], starts[k]
        return s + (start - s) // c * c, min(e + ((end - 1 - e) // c + 1) * c, self._segment_end(k))

    def hasher(self, start: int) -> ChunkHasher:
        """Return a hasher for the file's bytes from ``start`` (a chunk's first byte, or the
        file's end) on: its digests are those of chunks ``span(start, size)`` in order."""
        if start != self.size and self.floor(start) != start:
            raise ManifestError(f"byte {start} is not the first byte of a chunk")
        if self.starts is None:
            return ChunkHasher(self.chunk_size, at=start)
        return ChunkHasher(self.chunk_size, cuts=self.starts, at=start)


class ChunkHasher:
    """Hash a byte stream fed in arbitrary pieces into chunk digests.

    ``update`` accepts any buffer (memoryview of tensor memory: no copy); ``finish``
    closes the last partial chunk and returns the list of digest strings. A chunk closes
    after ``chunk_size`` bytes, or earlier at a file offset in ``cuts`` (sorted: where a
    shard-aligned grid starts a segment, ``ChunkGrid.hasher``); ``at`` is the file offset
    of the first byte fed, which must be a chunk start. With no ``cuts`` this is the v1
    hasher: chunk ``i`` of the stream is bytes ``[i*C, (i+1)*C)``.
    """

    __slots__ = ("chunk_size", "_h", "_filled", "_limit", "_digests", "total", "_cuts", "_next_cut", "_chunk_at")

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, *, cuts: Sequence[int] = (), at: int = 0) -> None:
        self.chunk_size = chunk_size
        self._h = xxhash.xxh3_128()
        self._filled = 0
        self._digests: list[str] = []
        self.total = 0
        self._cuts = cuts
        self._next_cut = bisect.bisect_right(cuts, at)  # index of the first cut after the chunk's start
        self._chunk_at = at  # file offset of the open chunk's first byte
        self._limit = self._chunk_limit()

    def _chunk_limit(self) -> int:
        """The length of the chunk opening at ``_chunk_at``: ``chunk_size``, or up to the next cut."""
        cuts, k, at = self._cuts, self._next_cut, self._chunk_at
        while k < len(cuts) and cuts[k] <= at:
            k += 1
        self._next_cut = k
        return min(self.chunk_size, cuts[k] - at) if k < len(cuts) else self.chunk_size

    def _close(self) -> None:
        self._digests.append(format_digest(self._h.digest()))
        self._h.reset()
        self._chunk_at += self._filled
        self._filled = 0
        if self._cuts:
            self._limit = self._chunk_limit()

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        n = len(mv)
        self.total += n
        pos = 0
        h = self._h
        while pos < n:
            take = min(self._limit - self._filled, n - pos)
            h.update(mv[pos : pos + take])
            self._filled += take
            pos += take
            if self._filled == self._limit:  # the chunk is whole: close it (``_close``, inlined)
                self._digests.append(format_digest(h.digest()))
                h.reset()
                self._chunk_at += self._filled
                self._filled = 0
                if self._cuts:
                    self._limit = self._chunk_limit()

    @property
    def completed(self) -> list[str]:
        """Digests of the whole chunks fed so far (read-only use)."""
        return self._digests

    def finish(self) -> list[str]:
        if self._filled:
            self._close()
        return self._digests
