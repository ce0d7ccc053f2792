"""Running a stream: fill each window from the source, write its parts to the files, in order."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from reshard._shardfmt import (
    Executor,
    LoadOptions,
    Manifest,
    ReadTarget,
    Storage,
    TargetSlice,
    byte_pieces,
    byte_view,
    check_headers,
    plan_reads,
    torch_dtype,
)
from reshard.stream.memory import MemoryPlan
from reshard.stream.records import Piece, Window, aligned


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
        slot = min(mem.window, aligned(max(need, 1)))
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
    verify_source(source, (p.src for p in pieces))


def verify_source(source: Source, records) -> None:
    """Check the header of every source file the ``records`` (names) are read from, once."""
    if source.verify:
        check_headers(source.storage, source.path, source.manifest, source_shards(source.manifest, records))


__all__ = ["Buffers", "Progress", "Sink", "Source", "StreamStats", "fill_window", "run_windows", "verify_headers",
           "verify_source"]
