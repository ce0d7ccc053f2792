"""What the streaming engine moves: pieces of destination files, and the windows that carry them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reshard._shardfmt import Box

ALIGN = 8  # every part starts at a multiple of the largest element size


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Strided:
    """Write ``as_strided(shape, stride, offset)`` of a piece's (1-D) box instead of the box:
    a view of a shared storage, materialised (plain safetensors has no views)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One slice destination file ``file`` holds: ``box`` of source record ``src``, as ``dtype``."""

    file: int
    src: str
    box: Box
    dtype: torch.dtype
    strided: Strided | None = None

    @property
    def buffer_bytes(self) -> int:
        """Bytes the buffer holds for the whole piece."""
        return self.box.numel * self.dtype.itemsize

    @property
    def out_bytes(self) -> int:
        """Bytes the piece adds to its file."""
        n = math.prod(self.strided.shape) if self.strided is not None else self.box.numel
        return n * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """The part ``box`` (record coordinates) of piece ``piece`` a window holds, at ``offset``."""

    piece: int
    box: Box
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """One fill of the buffer; ``parts`` are written in this order."""

    parts: tuple[Part, ...]
    nbytes: int


__all__ = ["ALIGN", "Part", "Piece", "Strided", "Window", "aligned"]
