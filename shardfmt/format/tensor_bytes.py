"""Zero-copy byte views of tensors, for writing and for reading straight into memory.

A contiguous CPU tensor is exposed as a memoryview of its own memory (no copy). A
non-contiguous or non-CPU tensor is copied in bounded row blocks, so writing a strided
view never materialises the whole tensor. ``BufferFile`` presents any buffer as a read-only
file without copying it.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import torch

DEFAULT_PIECE_BYTES = 8 << 20


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with a lazy conjugation or negation applied: its memory then holds the
    values it shows (``x.conj()`` and ``-x`` share ``x``'s storage, flagged, not rewritten)."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.detach()


def byte_view(t: torch.Tensor) -> memoryview:
    """Return a writable memoryview over a contiguous CPU tensor's bytes."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    # as_strided, not reshape: a contiguous tensor may still carry a non-unit stride on a
    # dimension of size 1 (``zeros(1, 2)[:, 0]``), which ``view(uint8)`` refuses
    flat = t.detach().as_strided((t.numel(),), (1,)).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def is_direct(t: torch.Tensor) -> bool:
    """Whether reads can land in ``t``'s memory without a bounce buffer."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def byte_pieces(t: torch.Tensor, *, piece_bytes: int = DEFAULT_PIECE_BYTES) -> Iterator[memoryview]:
    """Yield the tensor's bytes in row-major order, in pieces of at most ~``piece_bytes``."""
    if t.numel() == 0:
        return
    if is_direct(t):
        mv = byte_view(t)
        for pos in range(0, len(mv), piece_bytes):
            yield mv[pos : pos + piece_bytes]
        return
    if t.dim() == 0:
        yield byte_view(t.detach().to("cpu").clone())
        return
    row_bytes = max(1, t[0].numel() * t.element_size())
    rows = max(1, piece_bytes // row_bytes)
    for i in range(0, t.shape[0], rows):
        block = t[i : i + rows].detach().to("cpu", copy=True).contiguous()
        yield from byte_pieces(block, piece_bytes=piece_bytes)


class BufferFile(io.RawIOBase):
    """A read-only, seekable file over a buffer that, unlike ``io.BytesIO``, never copies it.

    For request bodies (given a bytearray, botocore and aiohttp copy it once or twice more;
    given this, none) and for parsers that want a file (zipfile, torch.load).
    """

    def __init__(self, data) -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._mv))[whence]
        self._pos = max(0, min(len(self._mv), base + offset))
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), len(self._mv) - self._pos)
        memoryview(b).cast("B")[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = bytes(self._mv[self._pos : end])
        self._pos = end
        return out

    def __len__(self) -> int:
        return len(self._mv)
