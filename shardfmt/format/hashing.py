"""Chunk hashing: the only home of the hash algorithm and of digest strings.

A data file is cut into fixed-size chunks (``chunk_size`` bytes, 1 MiB by default, the
last one shorter); each chunk is hashed with xxh3-128 while the file is written, in the
same pass. A reader verifies exactly the chunks it touches. The file digest and a shard's
digest are derived from chunk digests (never from a second pass over the data), so saving
costs one hash pass. xxh3-128 is not cryptographic: it detects corruption, not tampering.

Digest strings read ``"xxh3-128:<32 hex digits>"``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import xxhash

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


def digest_bytes(data) -> str:
    """Return the digest string of a bytes-like object."""
    return format_digest(xxhash.xxh3_128(data).digest())


def combine(chunk_digests: Iterable[str]) -> str:
    """Return the digest derived from an ordered run of chunk digests (file and shard digests)."""
    h = xxhash.xxh3_128()
    for d in chunk_digests:
        h.update(parse_digest(d))
    return format_digest(h.digest())


def chunk_span(start: int, end: int, chunk_size: int) -> range:
    """Return the indices of the chunks that bytes ``[start, end)`` touch."""
    if end <= start:
        return range(start // chunk_size, start // chunk_size)
    return range(start // chunk_size, (end - 1) // chunk_size + 1)


class ChunkHasher:
    """Hash a byte stream fed in arbitrary pieces into fixed-size chunk digests.

    ``update`` accepts any buffer (memoryview of tensor memory: no copy); ``finish``
    closes the last partial chunk and returns the list of digest strings.
    """

    __slots__ = ("chunk_size", "_h", "_filled", "_digests", "total")

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self._h = xxhash.xxh3_128()
        self._filled = 0
        self._digests: list[str] = []
        self.total = 0

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        n = len(mv)
        self.total += n
        pos = 0
        while pos < n:
            take = min(self.chunk_size - self._filled, n - pos)
            self._h.update(mv[pos : pos + take])
            self._filled += take
            pos += take
            if self._filled == self.chunk_size:
                self._digests.append(format_digest(self._h.digest()))
                self._h.reset()
                self._filled = 0

    @property
    def completed(self) -> list[str]:
        """Digests of the whole chunks fed so far (read-only use)."""
        return self._digests

    def finish(self) -> list[str]:
        if self._filled:
            self._digests.append(format_digest(self._h.digest()))
            self._h.reset()
            self._filled = 0
        return self._digests
