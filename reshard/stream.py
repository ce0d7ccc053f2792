"""Budgeted streaming: slices of a checkpoint -> new files written in order, in bounded memory.

The offline tools (``convert``, ``export-hf``, ``import-hf``) read slices of a source and
write them into new files whose layout is fixed up front (every file's slices in a known
order). This module is their one engine::

    plan (pure, no I/O)                   run (the I/O)
    pieces + units -> windows             per window: plan_load -> Executor fills the buffer,
                                          then each file's parts are written, in order

- A *piece* is one slice a destination file holds: a box of a source record (a tensor or a
  storage of the source manifest), written in an output dtype. The pieces of one file
  appear in ``pieces`` in that file's order.
- A *unit* is the list of pieces of one record (its boxes in every file). Units come in an
  order consistent with every file's order, so writing unit after unit appends to each file.
- A *window* is one fill of the buffer. Whole units are packed while they fit; a larger unit
  is cut into row-major runs of its record (``geometry.box_spans``) and each run is
  intersected with every piece, so each source byte is read once even when it feeds several
  files. When a file holds several pieces of the unit in an order the runs would interleave
  (boxes side by side along an inner dim), the unit is cut piece by piece instead.

Trade-offs: windows are sized in output bytes, which is what the buffer holds. Reads that
cast or land in a strided region go through fixed bounce buffers (``MemoryPlan``), small ones
outside the budget (in its 32 MiB slack), larger ones taken from it; a plan reads a hash chunk
once per window (``plan_load``). Hash chunks at window edges are read twice: those are the
only re-reads, fewer with a larger budget. The budget is split in two slots so that the next
window's reads overlap this window's writes, and windows are kept to ~1/16 of the data (at
least 64 MiB) so that the unoverlapped first read and last write stay short.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from shardfmt.errors import PlanError, ShardfmtError
from shardfmt.format.dtypes import torch_dtype
from shardfmt.format.manifest import Manifest
from shardfmt.format.tensor_bytes import byte_pieces, byte_view
from shardfmt.io.storage import Storage
from shardfmt.layout.geometry import Box, box_spans, intersect, is_run, row_major_strides
from shardfmt.loading.executor import Executor
from shardfmt.loading.options import DEFAULT_WORKERS, LoadOptions
from shardfmt.loading.planner import TargetSlice
from shardfmt.loading.reader import check_headers
from shardfmt.loading.targets import ReadTarget, plan_reads

DEFAULT_BUDGET = 1 << 30
MIN_BUDGET = 1 << 20
BOUNCE_READ = 4 << 20  # smallest cap on a read gathered through a bounce buffer (casts, strided pieces)
BOUNCE_SLACK = 16 << 20  # bounce buffers held outside the budget, at most
_ALIGN = 8  # every part starts at a multiple of the largest element size


class BudgetError(ShardfmtError, ValueError):
    """The memory budget is malformed or too small for what must be held at once."""


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: int | str, *, what: str = "size") -> int:
    """Return bytes for ``1073741824``, ``"1GiB"``, ``"256MiB"``, ``"5GB"`` (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, bool):
        raise BudgetError(f"{what}: {text!r} is not a size")
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m:
            raise BudgetError(f"{what}: {text!r} is not a size (e.g. 1073741824, 1GiB, 256MiB, 5GB)")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise BudgetError(f"{what}: {text!r} must be positive")
    return n


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


# ----------------------------------------------------------------------------- records


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


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """How a budget is spent: ``slots`` windows of ``window`` bytes (two: reads of the next
    overlap writes of this one), and ``workers`` bounce buffers of ``bounce`` bytes each."""

    budget: int
    window: int
    slots: int
    workers: int
    bounce: int
    bounce_read: int


UPLOAD_CLIENT_BYTES = 16 << 20


def fit_uploads(storage, budget: int) -> int:
    """Make an object store's upload buffers part of ``budget``; return what is left for data.

    A multipart upload holds ``(write_concurrency + 1) x part_size`` bytes of part buffers
    (shardfmt.io.fsspec), and the S3 client about UPLOAD_CLIENT_BYTES more while requests are in
    flight (measured). For one file open at a time, parts shrink to ``budget / 16`` (at least
    S3's 5 MiB) and at most ``budget / 8`` of parts are in flight; local disk needs nothing.
    """
    if not getattr(storage, "multipart", False):
        return budget
    part = max(5 << 20, min(storage.part_size, budget // 16))
    conc = max(1, min(storage.write_concurrency, budget // 8 // part))
    storage.part_size, storage.write_concurrency = part, conc
    uploads = (conc + 1) * part + UPLOAD_CLIENT_BYTES
    if budget - uploads < MIN_BUDGET:
        raise BudgetError(f"memory budget {human(budget)} is too small to upload to {storage.url('')}: "
                          f"its uploads alone take {human(uploads)} (give at least {human(uploads + MIN_BUDGET)})")
    return budget - uploads


def memory_plan(budget: int, *, chunk_size: int, verify: bool, workers: int = DEFAULT_WORKERS) -> MemoryPlan:
    """Split ``budget`` into window buffers and bounce buffers.

    Bounced reads (casts, strided pieces) are ``budget / 16`` (4 to 64 MiB): a verified read
    is widened to whole hash chunks, so each read boundary may re-read a chunk and larger
    reads re-read less. Bounce buffers of at most BOUNCE_SLACK in all are held outside the
    budget (its slack); larger ones are taken from it.
    """
    if budget < MIN_BUDGET:
        raise BudgetError(f"memory budget {human(budget)} is below the minimum of {human(MIN_BUDGET)}")
    workers = max(1, workers)
    widen = 2 * chunk_size if verify else 0  # a verified read is widened to whole chunks
    bounce_read = min(max(budget // 16, BOUNCE_READ), 64 << 20)
    per = bounce_read + widen
    data = budget - workers * per if workers * per > BOUNCE_SLACK else budget
    if data < budget // 2:  # a small budget: small bounce buffers, outside the budget when they fit
        bounce_read = BOUNCE_READ
        per = bounce_read + widen
        workers = max(1, min(workers, BOUNCE_SLACK // per))
        data = budget - per if per > BOUNCE_SLACK else budget
    if data < MIN_BUDGET:
        raise BudgetError(f"memory budget {human(budget)} is too small: one verified read of a checkpoint "
                          f"with {human(chunk_size)} hash chunks needs {human(per)}")
    slots = 2 if data >= 2 * MIN_BUDGET else 1
    window = data // slots // _ALIGN * _ALIGN
    return MemoryPlan(budget=budget, window=window, slots=slots, workers=workers, bounce=per,
                      bounce_read=bounce_read)


PIPELINE_MIN_WINDOW = 64 << 20


def window_capacity(mem: MemoryPlan, total: int) -> int:
    """The window size for streaming ``total`` bytes: the budget's slot, but at most ~1/16 of
    the data (at least 64 MiB) so that the first fill and the last write, which nothing
    overlaps, stay short."""
    return min(mem.window, max(PIPELINE_MIN_WINDOW, _aligned(-(-total // 16))))


# ----------------------------------------------------------------------------- planning (pure)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Packer:
    """Pack parts into windows of at most ``capacity`` bytes, in order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.windows: list[Window] = []
        self._parts: list[Part] = []
        self._used = 0

    def room(self) -> int:
        return self.capacity - self._used

    def add(self, piece: int, box: Box, nbytes: int) -> None:
        self._parts.append(Part(piece=piece, box=box, offset=self._used, nbytes=nbytes))
        self._used += _aligned(nbytes)

    def flush(self) -> None:
        if self._parts:
            self.windows.append(Window(parts=tuple(self._parts), nbytes=self._used))
        self._parts, self._used = [], 0


def plan_windows(pieces: Sequence[Piece], units: Sequence[Sequence[int]], shapes: Mapping[str, Sequence[int]],
                 *, capacity: int, names: Mapping[int, str] | None = None) -> list[Window]:
    """Return the windows that stream every piece of ``units``, in order, ``capacity`` bytes each.

    ``shapes`` maps each source record to its shape; ``names`` (piece -> tensor name, for
    errors) defaults to the record name. Raises ``BudgetError`` when a piece that cannot be
    cut (a materialised view) exceeds the capacity.
    """
    pack = _Packer(capacity)
    for unit in units:
        live = [i for i in unit if pieces[i].buffer_bytes]
        size = sum(_aligned(pieces[i].buffer_bytes) for i in live)
        if size <= pack.room():
            for i in live:
                pack.add(i, pieces[i].box, pieces[i].buffer_bytes)
            continue
        pack.flush()
        if size <= capacity:
            for i in live:
                pack.add(i, pieces[i].box, pieces[i].buffer_bytes)
            continue
        _cut_unit(pieces, live, shapes, pack, names)
    pack.flush()
    check_windows(pieces, pack.windows)
    return pack.windows


def _cut_unit(pieces: Sequence[Piece], live: list[int], shapes: Mapping[str, Sequence[int]], pack: _Packer,
              names: Mapping[int, str] | None) -> None:
    """A unit larger than a window: cut by runs of its record, or piece by piece."""
    for i in live:
        if pieces[i].strided is not None and _aligned(pieces[i].buffer_bytes) > pack.capacity:
            name = names.get(i, pieces[i].src) if names else pieces[i].src
            raise BudgetError(f"tensor {name!r}: a view of {human(pieces[i].buffer_bytes)} of a shared storage "
                              f"must be held whole; the memory budget allows {human(pack.capacity)} per window")
    srcs = {pieces[i].src for i in live}
    dtypes = {pieces[i].dtype for i in live}
    if len(srcs) == 1 and len(dtypes) == 1 and all(pieces[i].strided is None for i in live):
        src = next(iter(srcs))
        isz = next(iter(dtypes)).itemsize
        shape = tuple(shapes[src])
        cap = pack.capacity - _ALIGN * len(live)
        if cap >= isz:
            runs = [s.box for s in box_spans(shape, Box.full(shape), isz, max_span=cap)]
            if _runs_keep_file_order(pieces, live, runs):
                for run in runs:
                    parts = []
                    for i in live:
                        inter = intersect(pieces[i].box, run)
                        if inter is not None and not inter.is_empty():
                            parts.append((i, inter, inter.numel * isz))
                    if sum(_aligned(n) for _, _, n in parts) > pack.room():
                        pack.flush()
                    for i, box, n in parts:
                        pack.add(i, box, n)
                return
    for i in live:  # piece by piece: whole when it fits, else runs of the piece
        p = pieces[i]
        if _aligned(p.buffer_bytes) <= pack.room():
            pack.add(i, p.box, p.buffer_bytes)
            continue
        pack.flush()
        if _aligned(p.buffer_bytes) <= pack.capacity:
            pack.add(i, p.box, p.buffer_bytes)
            continue
        isz = p.dtype.itemsize
        for s in box_spans(p.box.lengths, Box.full(p.box.lengths), isz, max_span=pack.capacity):
            box = Box(tuple(a + b for a, b in zip(p.box.offsets, s.box.offsets)), s.box.lengths)
            if _aligned(box.numel * isz) > pack.room():
                pack.flush()
            pack.add(i, box, box.numel * isz)


def _runs_keep_file_order(pieces: Sequence[Piece], live: list[int], runs: list[Box]) -> bool:
    """Whether writing run after run appends to every file in its order (no file goes back to
    an earlier piece of the unit after starting a later one)."""
    by_file: dict[int, list[int]] = {}
    for i in live:
        by_file.setdefault(pieces[i].file, []).append(i)
    for idxs in by_file.values():
        if len(idxs) < 2:
            continue
        last = -1
        for run in runs:
            touched = [k for k, i in enumerate(idxs)
                       if (b := intersect(pieces[i].box, run)) is not None and not b.is_empty()]
            if touched:
                if touched[0] < last:
                    return False
                last = touched[-1]
    return True


def check_windows(pieces: Sequence[Piece], windows: Sequence[Window]) -> None:
    """Raise PlanError unless the windows write every file in order: per file, pieces in
    increasing index; per piece, parts that continue its row-major bytes exactly."""
    last_piece: dict[int, int] = {}
    done: dict[int, int] = {}
    for w in windows:
        for part in w.parts:
            p = pieces[part.piece]
            if last_piece.get(p.file, -1) > part.piece:
                raise PlanError(f"internal: file {p.file} goes back to piece {part.piece}")
            last_piece[p.file] = part.piece
            local = part.box.relative_to(p.box)
            if not p.box.contains(part.box) or not is_run(p.box.lengths, local):
                raise PlanError(f"internal: part {part.box} of piece {part.piece} is not a run of it")
            start = sum(o * s for o, s in zip(local.offsets, row_major_strides(p.box.lengths)))
            if start != done.get(part.piece, 0):
                raise PlanError(f"internal: piece {part.piece} continues at element {start}, "
                                f"expected {done.get(part.piece, 0)}")
            done[part.piece] = start + part.box.numel
    for i, p in enumerate(pieces):
        if p.buffer_bytes and i in done and done[i] != p.box.numel:
            raise PlanError(f"internal: piece {i} was written only up to element {done[i]}")


# ----------------------------------------------------------------------------- running (I/O)


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """Where slices are read from. ``verify=False`` for plain safetensors files described by
    an in-memory manifest (no hashes), or when the caller asks. ``follow_links``: files
    under ``path`` may be reached through symbolic links (a Hugging Face folder: the hub
    cache's snapshots link into its blobs); never a shardfmt checkpoint's (spec section 2)."""

    storage: Storage
    path: str
    manifest: Manifest
    verify: bool = True
    follow_links: bool = False


class Sink(Protocol):
    """Where a destination file's bytes go, in order (a ``ShardStream`` or ``FileStream``)."""

    def write(self, data) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStats:
    """What a streaming run did."""

    windows: int
    bytes_written: int
    bytes_read: int
    read_requests: int
    seconds: float


class Progress:
    """A progress bar over bytes (tqdm: bytes, rate, ETA), or nothing."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (logs stay clean)
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             disable=None, dynamic_ncols=True, leave=True)

    def update(self, n: int) -> None:
        if self._bar is not None and n:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Buffers:
    """The memory of a streaming run, allocated once and reused by every window: the window
    slots and the bounce buffers (allocating per window lets the C allocator keep freed
    blocks: RSS creeps)."""

    def __init__(self, mem: MemoryPlan, *, need: int) -> None:
        self.mem = mem
        slot = min(mem.window, _aligned(max(need, 1)))
        self.slots = [torch.empty(slot, dtype=torch.uint8) for _ in range(mem.slots)]
        self.bounce = [torch.empty(mem.bounce, dtype=torch.uint8) for _ in range(mem.workers)]


def source_shards(manifest: Manifest, srcs) -> list[tuple[str, object]]:
    """Every (record name, shard) of the records ``srcs``: what a verified run reads from."""
    out = []
    for name in sorted(set(srcs)):
        out.extend((name, s) for s in manifest.tensor(name).shards)
    return out


def fill_window(source: Source, pieces: Sequence[Piece], window: Window, buf: torch.Tensor, buffers: Buffers,
                src_dtypes: Mapping[str, torch.dtype] | None = None) -> None:
    """Read every part of ``window`` from ``source`` into its place in ``buf`` (output dtype,
    row-major): one plan, run by the Executor with the run's fixed bounce buffers."""
    m = source.manifest
    targets = []
    for k, part in enumerate(window.parts):
        p = pieces[part.piece]
        region = buf[part.offset : part.offset + part.nbytes]
        dt = src_dtypes[p.src] if src_dtypes is not None else torch_dtype(m.tensor(p.src).dtype, what=p.src)
        targets.append(ReadTarget(src=TargetSlice(index=k, fqn=p.src, box=part.box), src_dtype=dt,
                                  dst=region.view(p.dtype).reshape(part.box.lengths), bounce=dt != p.dtype))
    opts = LoadOptions(verify=source.verify, max_gap=source.storage.max_gap, max_bounce_read=buffers.mem.bounce_read,
                       workers=buffers.mem.workers)
    plan = plan_reads(m, targets, opts)
    Executor(source.storage, source.path, targets, opts, bounce_buffers=buffers.bounce,
             follow_links=source.follow_links).run(plan)


def run_windows(source: Source, pieces: Sequence[Piece], windows: Sequence[Window], sinks: Mapping[int, Sink],
                buffers: Buffers, *, progress: Progress | None = None) -> StreamStats:
    """Fill each window from ``source`` and write its parts to ``sinks[piece.file]``, in order.

    With two slots, a reader thread fills window k+1 while this thread writes window k.
    """
    t0 = time.perf_counter()
    stats = source.storage.stats
    before = stats.snapshot()
    src_dtypes = {name: torch_dtype(source.manifest.tensor(name).dtype, what=name) for name in {p.src for p in pieces}}
    written = 0

    def emit(w: Window, buf: torch.Tensor) -> int:
        n = 0
        for part in w.parts:
            p = pieces[part.piece]
            region = buf[part.offset : part.offset + part.nbytes]
            sink = sinks[p.file]
            if p.strided is None:
                sink.write(byte_view(region))
                n += part.nbytes
            else:
                s = p.strided
                typed = region.view(p.dtype)  # as_strided's offset counts from the storage's start
                view = typed.as_strided(s.shape, s.stride, typed.storage_offset() + s.offset)
                for piece in byte_pieces(view):
                    sink.write(piece)
                    n += len(piece)
            if progress is not None:
                progress.update(part.nbytes if p.strided is None else p.out_bytes)
        return n

    slots = buffers.slots
    if len(slots) == 1 or len(windows) <= 1:
        for w in windows:
            fill_window(source, pieces, w, slots[0], buffers, src_dtypes)
            written += emit(w, slots[0])
    else:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-fill") as pool:
            fut = pool.submit(fill_window, source, pieces, windows[0], slots[0], buffers, src_dtypes)
            try:
                for k, w in enumerate(windows):
                    fut.result()
                    if k + 1 < len(windows):
                        fut = pool.submit(fill_window, source, pieces, windows[k + 1], slots[(k + 1) % 2], buffers,
                                              src_dtypes)
                    written += emit(w, slots[k % 2])
            except BaseException:
                _cancel(fut)
                raise
    after = stats.snapshot()
    return StreamStats(windows=len(windows), bytes_written=written,
                       bytes_read=after["bytes_read"] - before["bytes_read"],
                       read_requests=after["read_requests"] - before["read_requests"],
                       seconds=time.perf_counter() - t0)


def _cancel(fut) -> None:
    """Wait for an in-flight fill before its buffer is released (its error is secondary)."""
    try:
        fut.result()
    except BaseException:  # noqa: BLE001 - the first error is the one re-raised
        pass


def verify_headers(source: Source, pieces: Sequence[Piece]) -> None:
    """Check the header of every source file the pieces read from, once, before any data."""
    if source.verify:
        check_headers(source.storage, source.path, source.manifest,
                      source_shards(source.manifest, (p.src for p in pieces)))

