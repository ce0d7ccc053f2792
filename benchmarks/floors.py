"""Raw I/O floors: the cheapest way to move the same bytes, and the memcpy bound.

- Write floor: each rank ``os.write``s its pieces (spec order, one file per rank) in 8 MiB
  pieces, xxh3-128 over every 1 MiB chunk first (``hashed``), then fsync: the least a
  hashed, durable writer must do. ``hashed=False`` is the raw write. It does not allocate
  its file first (``fallocate``) as shardfmt's saves do: allocated, it ran no faster here
  and slower in two harness runs, and a floor is the faster way (benchmarks/README.md,
  session 24).
- Read floor: ``os.preadv`` straight into the targets in 8 MiB pieces, then xxh3-128 per
  1 MiB chunk (single thread); the hinted read floor (``hinted``) asks the kernel for every
  range first (``POSIX_FADV_WILLNEED``, in ``HINT`` pieces: the kernel reads only the first
  read-ahead's worth of a longer hint), the device's depth without threads. The direct read
  floor (``read_floor_direct``) reads the same ranges around the page cache: ``O_DIRECT``
  blocks of 16 MiB, rounded out to 4 KiB, into two reused page-aligned buffers, the next
  block read on a thread while this one is hashed and copied into the targets.
  ``floor_reads`` plans which byte ranges of the saved floor files a target layout needs:
  exact ranges where the needed piece is contiguous in both the file and the target (same
  layout, a dim-0 reshard, a replicated tensor), widened to whole hash chunks as a verified
  reader must read them (chunks cut from each piece's start, as format v2 cuts them from
  each tensor's: the widening is read and hashed, not kept); otherwise an idealised bound —
  the same number of bytes read contiguously (a column reshard, whose bytes are strided in
  a row-major file). Only exact plans are checked against the formula.
- memcpy: the rank's pieces copied into pre-faulted buffers (pinned host buffers with
  non-blocking copies on CUDA: the device-to-host bound).
- Copy floors for offline tools: read every source data file and write it anew (plain,
  hashed on both sides, or with reads overlapped with writes).
On CUDA the floors copy each piece through a pinned host buffer (not overlapped).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from .states import Box, TensorSpec, box

PIECE = 8 << 20  # bytes per os.write / os.preadv call
CHUNK = 1 << 20  # bytes per hashed chunk (shardfmt's default chunk size)
DIRECT_ALIGN = 4096  # O_DIRECT offsets and lengths: multiples of this
DIRECT_BLOCK = 16 << 20  # bytes per O_DIRECT preadv of the direct read floor
HINT = 128 << 10  # bytes per WILLNEED hint: Linux reads at most a read-ahead's worth of one (128 KiB by default)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def hash_chunks(mv: memoryview) -> None:
    for pos in range(0, len(mv), CHUNK):
        xxhash.xxh3_128(mv[pos:pos + CHUNK]).digest()


def write_pieces(fd: int, mv: memoryview, *, hashed: bool) -> None:
    for pos in range(0, len(mv), PIECE):
        piece = mv[pos:pos + PIECE]
        if hashed:
            hash_chunks(piece)
        done = 0
        while done < len(piece):
            done += os.write(fd, piece[done:])


def read_pieces(fd: int, dst: memoryview, offset: int, *, hashed: bool, path: str) -> None:
    for pos in range(0, len(dst), PIECE):
        piece = dst[pos:pos + PIECE]
        got = 0
        while got < len(piece):
            n = os.preadv(fd, [piece[got:]], offset + pos + got)
            if n == 0:
                raise EOFError(f"{path}: short read at {offset + pos + got}")
            got += n
        if hashed:
            hash_chunks(piece)


def write_floor(path: str, tensors: Sequence[torch.Tensor], *, hashed: bool, fsync: bool,
                host: Sequence[torch.Tensor] | None = None) -> None:
    """Write ``tensors``' bytes to ``path`` (through ``host`` buffers when they live on a GPU)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i, t in enumerate(tensors):
            src = t if host is None else host[i].copy_(t)
            write_pieces(fd, byte_view(src), hashed=hashed)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True, kw_only=True)
class FloorRead:
    """``length`` bytes at ``src_offset`` of ``file`` into bytes ``dst_offset..`` of target ``index``,
    with the ``before`` bytes ahead of them and the ``after`` bytes past them read and hashed
    too (the rest of the hash chunks they lie in)."""

    file: str
    src_offset: int
    index: int
    dst_offset: int
    length: int
    before: int = 0
    after: int = 0

    def span(self, *, hashed: bool) -> tuple[int, int]:
        """The file's ``[start, end)`` this read takes: widened to whole chunks when ``hashed``."""
        if not hashed:
            return self.src_offset, self.src_offset + self.length
        return self.src_offset - self.before, self.src_offset + self.length + self.after


def _contiguous(outer: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> int | None:
    """Element offset of the sub-box in row-major ``outer`` when it is one contiguous run, else None."""
    partial = [d for d in range(len(outer)) if lengths[d] != outer[d]]
    if partial and any(lengths[d] != 1 for d in range(partial[-1])):
        return None
    stride, start = 1, 0
    for d in reversed(range(len(outer))):
        start += offsets[d] * stride
        stride *= outer[d]
    return start


def _intersect(a: Box, b: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a.offsets, a.lengths, b.offsets, b.lengths))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def floor_reads(specs: Sequence[TensorSpec], dst: Sequence[Box], floor_dir: str, *, src_world: int,
                rank: int) -> tuple[list[FloorRead], bool]:
    """The reads of the target pieces ``dst`` from a ``src_world``-rank floor save; (reads, exact)."""
    src = [[box(s, "rows", src_world, q) for s in specs] for q in range(src_world)]
    offs = [[0] * len(specs) for _ in range(src_world)]
    for q in range(src_world):
        pos = 0
        for i, s in enumerate(specs):
            offs[q][i] = pos
            pos += math.prod(src[q][i].lengths) * getattr(torch, s.dtype).itemsize
    reads: list[FloorRead] = []
    exact = True
    for i, (s, t) in enumerate(zip(specs, dst)):
        item = getattr(torch, s.dtype).itemsize
        owners = [rank % src_world] if src[0][i].placement in ("full", "replicate") else range(src_world)
        mine = _exact_reads(i, t, [(q, src[q][i]) for q in owners], offs, floor_dir, item)
        if mine is None:
            exact = False
            mine = _ideal_reads(i, t, [(q, src[q][i]) for q in owners], offs, floor_dir, item, rank)
        reads.extend(mine)
    return reads, exact


def _exact_reads(i, t: Box, owners, offs, floor_dir, item) -> list[FloorRead] | None:
    out = []
    for q, b in owners:
        hit = _intersect(t, b)
        if hit is None:
            continue
        lo, n = hit
        s_el = _contiguous(b.lengths, tuple(x - o for x, o in zip(lo, b.offsets)), n)
        d_el = _contiguous(t.lengths, tuple(x - o for x, o in zip(lo, t.offsets)), n)
        if s_el is None or d_el is None:
            return None
        start, length = s_el * item, math.prod(n) * item
        whole = math.prod(b.lengths) * item
        first, end = start - start % CHUNK, min(whole, -(-(start + length) // CHUNK) * CHUNK)
        out.append(FloorRead(file=os.path.join(floor_dir, f"rank_{q}.bin"), src_offset=offs[q][i] + start,
                             index=i, dst_offset=d_el * item, length=length, before=start - first,
                             after=end - start - length))
    return out


def _ideal_reads(i, t: Box, owners, offs, floor_dir, item, rank) -> list[FloorRead]:
    need = math.prod(t.lengths) * item
    owners = list(owners)
    piece = need // len(owners)
    out, done = [], 0
    for k, (q, b) in enumerate(owners):
        n = need - done if k == len(owners) - 1 else piece
        block = math.prod(b.lengths) * item
        start = (rank * n) % max(1, block - n + 1)
        out.append(FloorRead(file=os.path.join(floor_dir, f"rank_{q}.bin"), src_offset=offs[q][i] + start,
                             index=i, dst_offset=done, length=n))
        done += n
    return out


def read_floor(reads: Sequence[FloorRead], targets: Sequence[torch.Tensor], *, hashed: bool,
               host: Sequence[torch.Tensor] | None = None, hinted: bool = False) -> None:
    """Do ``reads`` into ``targets`` (through ``host`` buffers, then copied, for GPU targets).
    ``hinted``: every read's range (widened as it is read) is first asked of the kernel at once
    (``POSIX_FADV_WILLNEED``, in ``HINT`` pieces), so the device works at full depth from the start."""
    fds: dict[str, int] = {}
    spare = memoryview(bytearray(CHUNK)) if hashed and any(r.before or r.after for r in reads) else None
    try:
        views = [byte_view(t if host is None else host[i]) for i, t in enumerate(targets)]
        for r in reads if hinted else ():
            lo, hi = r.span(hashed=hashed)
            for pos in range(lo, hi, HINT):
                os.posix_fadvise(_fd(fds, r.file), pos, min(HINT, hi - pos), os.POSIX_FADV_WILLNEED)
        for r in reads:
            fd = _fd(fds, r.file)
            if r.before and hashed:  # a reader that verifies nothing reads no whole chunks
                read_pieces(fd, spare[:r.before], r.src_offset - r.before, hashed=hashed, path=r.file)
            read_pieces(fd, views[r.index][r.dst_offset:r.dst_offset + r.length], r.src_offset, hashed=hashed,
                        path=r.file)
            if r.after and hashed:
                read_pieces(fd, spare[:r.after], r.src_offset + r.length, hashed=hashed, path=r.file)
        _from_host(targets, host)
    finally:
        _close(fds)


def _fd(fds: dict[str, int], path: str) -> int:
    """``path`` opened for reading, once (kept in ``fds``)."""
    fd = fds.get(path)
    if fd is None:
        fd = fds[path] = os.open(path, os.O_RDONLY)
    return fd


def _from_host(targets: Sequence[torch.Tensor], host: Sequence[torch.Tensor] | None) -> None:
    """Copy the host buffers the floor read into to the (GPU) targets; nothing without them."""
    for t, h in zip(targets, host or ()):
        t.copy_(h, non_blocking=True)


def _close(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)


@dataclass(frozen=True, slots=True)
class _Block:
    """One ``O_DIRECT`` read of the direct floor: ``[start, end)`` of ``file`` (aligned; ``end`` may
    pass the file's end), of which ``[lo, hi)`` is hashed and ``[src, src + n)`` goes to target
    ``index`` at byte ``dst``."""

    file: str
    start: int
    end: int
    lo: int
    hi: int
    index: int
    src: int
    dst: int
    n: int


def _direct_blocks(reads: Sequence[FloorRead], *, hashed: bool) -> list[_Block]:
    out = []
    for r in reads:
        lo, hi = r.span(hashed=hashed)
        for start in range(lo - lo % DIRECT_ALIGN, hi, DIRECT_BLOCK):
            end = min(start + DIRECT_BLOCK, -(-hi // DIRECT_ALIGN) * DIRECT_ALIGN)
            src, stop = max(start, r.src_offset), min(end, r.src_offset + r.length)
            out.append(_Block(file=r.file, start=start, end=end, lo=max(start, lo), hi=min(end, hi), index=r.index,
                              src=src, dst=r.dst_offset + src - r.src_offset, n=max(0, stop - src)))
    return out


def read_floor_direct(reads: Sequence[FloorRead], targets: Sequence[torch.Tensor], *, hashed: bool,
                      host: Sequence[torch.Tensor] | None = None) -> None:
    """Do ``reads`` into ``targets`` around the page cache (``O_DIRECT``; module docstring).
    OSError EINVAL where the OS or the filesystem has no ``O_DIRECT``."""
    if not hasattr(os, "O_DIRECT"):
        raise OSError(errno.EINVAL, "no O_DIRECT on this OS")
    blocks = _direct_blocks(reads, hashed=hashed)
    bufs = [mmap.mmap(-1, DIRECT_BLOCK) for _ in range(2)]  # page-aligned, reused (unmapped when unreferenced)
    fds: dict[str, int] = {}

    def fetch(k: int) -> memoryview:
        b, mv = blocks[k], memoryview(bufs[k % 2])
        fd = fds.get(b.file)
        if fd is None:
            fd = fds[b.file] = os.open(b.file, os.O_RDONLY | os.O_DIRECT)
        got, want = 0, b.hi - b.start
        while got < want:
            n = os.preadv(fd, [mv[got:b.end - b.start]], b.start + got)
            nxt = got + n if got + n >= want else (got + n) // DIRECT_ALIGN * DIRECT_ALIGN  # aligned retries
            if nxt <= got:
                raise EOFError(f"{b.file}: short read at {b.start + got} ({n} bytes)")
            got = nxt
        return mv

    try:
        views = [byte_view(t if host is None else host[i]) for i, t in enumerate(targets)]
        with ThreadPoolExecutor(max_workers=1) as pool:
            nxt = pool.submit(fetch, 0) if blocks else None
            for k, b in enumerate(blocks):
                mv = nxt.result()
                if k + 1 < len(blocks):
                    nxt = pool.submit(fetch, k + 1)
                if hashed:
                    hash_chunks(mv[b.lo - b.start:b.hi - b.start])
                views[b.index][b.dst:b.dst + b.n] = mv[b.src - b.start:b.src - b.start + b.n]
        _from_host(targets, host)
    finally:
        _close(fds)


def memcpy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, non_blocking: bool) -> None:
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=non_blocking)


def copy_files(files: Sequence[str], out_dir: str, *, hashed: bool, overlapped: bool) -> int:
    """Read each file and write it anew under ``out_dir`` (fsync); return the bytes copied.

    ``hashed``: xxh3 over every chunk read (verify) and written (hash); ``overlapped``: the
    next piece is read on a thread while this one is written (two 8 MiB buffers).
    """
    os.makedirs(out_dir, exist_ok=True)
    bufs = [byte_view(torch.empty(PIECE, dtype=torch.uint8)) for _ in range(2)]
    total = 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        for k, path in enumerate(files):
            size = os.path.getsize(path)
            rfd = os.open(path, os.O_RDONLY)
            wfd = os.open(os.path.join(out_dir, f"f{k}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _copy_one(rfd, wfd, size, bufs, pool if overlapped else None, hashed, path)
                os.fsync(wfd)
            finally:
                os.close(rfd)
                os.close(wfd)
            total += size
    return total


def _copy_one(rfd, wfd, size, bufs, pool, hashed, path) -> None:
    def read(k: int, pos: int) -> memoryview:
        n = min(PIECE, size - pos)
        read_pieces(rfd, bufs[k][:n], pos, hashed=hashed, path=path)
        return bufs[k][:n]

    starts = list(range(0, size, PIECE))
    nxt = pool.submit(read, 0, 0) if pool and starts else None
    for j, pos in enumerate(starts):
        piece = nxt.result() if pool else read(0, pos)
        if pool and j + 1 < len(starts):
            nxt = pool.submit(read, (j + 1) % 2, starts[j + 1])
        write_pieces(wfd, piece, hashed=hashed)
