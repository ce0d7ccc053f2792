"""What a load read through the page cache leaves it: nothing that no other process reads.

A checkpoint does not take the training job's page cache. A load drops the byte ranges it
read through the cache that no other process reads (``Drops``: together, in batches, and
all once more when the run ends); ranges other ranks of the node read too are dropped once
every one has (``release``, with the ranges ``LoadReport.cached`` names).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from shardfmt.errors import ShardfmtError
from shardfmt.format import refs
from shardfmt.io.store import FileReader, Storage
from shardfmt.loading.files import Readers
from shardfmt.loading.planner import PhysicalRead

DROP_BATCH = 512 << 20  # bytes read through the page cache that a load drops together, at most (``Drops``)


class Drops:
    """The byte ranges a run read through the page cache that no other process reads, dropped
    from it together: once ``DROP_BATCH`` bytes wait, and when the run ends (its reads done, or
    failed: then every such range it asked the storage to fetch, read or not) all of them again,
    each file's ranges merged where they touch. (A large folio that straddles two batches is
    dropped only by a range that covers it whole: the last pass's.)

    Not one read at a time: pages a load reads in runs that alternate with another process's
    (a 2 -> 4 reshard: two ranks take alternate 16 MiB runs of one file) land in small folios,
    and dropping them while the other process is still filling the same file's cache costs
    kernel time on both. Measured on this project's VM (``benchmarks/reshard_drops.py``,
    benchmarks/README.md, issue 22), 4 ranks loading a 2-rank save of 1 GiB: 1.053 s dropping
    each read as it finished, 0.857 s dropping at the end, the floor 0.848 s."""

    def __init__(self, readers: Readers) -> None:
        self._readers = readers
        self._all: dict[str, list[tuple[int, int]]] = {}  # every range noted
        self._batch: dict[str, list[tuple[int, int]]] = {}  # those noted since the last drop
        self._bytes = 0  # of the batch
        self._lock = threading.Lock()

    def add(self, read: PhysicalRead) -> None:
        """Note ``read``'s range; drop the batch once it is ``DROP_BATCH`` bytes."""
        if self.keep([read]) >= DROP_BATCH:
            with self._lock:
                batch, self._batch, self._bytes = self._batch, {}, 0
            self._drop(batch)

    def keep(self, reads: Sequence[PhysicalRead]) -> int:
        """Note the reads' ranges (no drop); return the batch's bytes."""
        with self._lock:
            for r in reads:
                span = (r.byte_range.start, r.byte_range.end)
                self._all.setdefault(r.file, []).append(span)
                self._batch.setdefault(r.file, []).append(span)
                self._bytes += r.byte_range.length
            return self._bytes

    def finish(self, *, quiet: bool = False) -> None:
        """Drop every range noted, dropped before or not. ``quiet``: a failure is ignored (a
        run that failed reports its own error)."""
        with self._lock:
            every, self._all, self._batch, self._bytes = self._all, {}, {}, 0
        try:
            self._drop(every)
        except Exception:
            if not quiet:
                raise

    def _drop(self, ranges: Mapping[str, list[tuple[int, int]]]) -> None:
        """Through the files' open readers (advisory: a file this run never opened holds nothing
        it read)."""
        for name, spans in sorted(ranges.items()):
            drop = getattr(self._readers.opened(name), "release", None)
            if drop is not None:
                for start, end in merged(spans):
                    drop(start, end - start)


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` ([start, end) byte ranges) sorted, those that overlap or touch made one."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        elif end > start:
            out.append([start, end])
    return [(s, e) for s, e in out]


def release_read(reader: FileReader, read: PhysicalRead) -> None:
    drop = getattr(reader, "release", None)  # local files' readers: their bytes are in this machine's page cache
    if drop is not None and read.byte_range.length > 0:
        drop(read.byte_range.start, read.byte_range.length)


def release(storage: Storage, root: str, ranges: Sequence[tuple[str, int, int]]) -> None:
    """Drop from the page cache the byte ranges (file, start, end) a load of the checkpoint at
    ``root`` read through it (``Executor.cached``, ``LoadReport.cached``), once every process
    that reads them has: advisory, a file that cannot be opened is skipped."""
    if storage.remote:
        return
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, start, end in ranges:
        by_file.setdefault(name, []).append((start, end))
    for name, spans in by_file.items():
        full, where = refs.location(storage.join, root, name)
        try:
            reader = storage.open_reader(full, within=where)
        except (ShardfmtError, OSError):
            continue
        try:
            drop = getattr(reader, "release", None)
            for start, end in spans:
                if drop is not None and end > start:  # (a length of 0 would mean "to the end")
                    drop(start, end - start)
        finally:
            reader.close()


__all__ = ["DROP_BATCH", "Drops", "merged", "release", "release_read"]
