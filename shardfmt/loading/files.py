"""The data files one run reads: each opened once and checked against the manifest
(``Readers``), and the reads ahead of the one starting hinted to the storage (``ReadAhead``).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence

from shardfmt.errors import CheckpointNotFoundError, IntegrityError, ShardfmtError
from shardfmt.format import refs
from shardfmt.format.manifest import FileRecord
from shardfmt.io.store import FileReader, Storage
from shardfmt.loading.planner import PhysicalRead


class Readers:
    """Open each file once, check its size against the manifest, share the handle.

    Names resolve under ``root`` through no symbolic link unless ``follow_links`` (spec
    section 2; ``Executor``)."""

    def __init__(self, storage: Storage, root: str, files: Mapping[str, FileRecord], *,
                 follow_links: bool = False) -> None:
        self._storage = storage
        self._root = root
        self._files = files
        self._within = None if follow_links else root
        self._open: dict[str, FileReader] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> FileReader:
        with self._lock:
            r = self._open.get(name)
            if r is None:
                want = self._files[name].size
                # Object stores: trust the manifest's size (a HEAD per file saved); a short
                # file then fails its ranged read, a changed one its chunk hashes.
                full, where = refs.location(self._storage.join, self._root, name)
                try:
                    r = self._storage.open_reader(full, size=want if self._storage.remote else None,
                                                  within=None if self._within is None else where)
                except CheckpointNotFoundError:
                    raise IntegrityError(refs.missing_file(name)) from None
                if r.size != want:
                    r.close()
                    raise IntegrityError(f"{name}: file is {r.size} bytes, manifest says {want}")
                self._open[name] = r
            return r

    def opened(self, name: str) -> FileReader | None:
        """The reader of ``name`` if it is open, else None (never opens one)."""
        with self._lock:
            return self._open.get(name)

    def prefetch(self, reads: Sequence[PhysicalRead], *, gap: int = 1 << 20) -> None:
        """Hint the reads to the storage, nearby ones in a file as one range. Advisory: a file
        that cannot be opened is left for its read to report, named."""
        ranges: list[list] = []  # [file, start, end]
        for r in reads:
            s, e = r.byte_range.start, r.byte_range.end
            if ranges and r.file == ranges[-1][0] and ranges[-1][2] <= s <= ranges[-1][2] + gap:
                ranges[-1][2] = max(ranges[-1][2], e)
            else:
                ranges.append([r.file, s, e])
        for name, s, e in ranges:
            try:
                hint = getattr(self.get(name), "prefetch", None)
            except (ShardfmtError, OSError):
                continue
            if hint is not None:
                hint(s, e - s)

    def close(self) -> None:
        for r in self._open.values():
            try:
                r.close()
            except OSError:
                pass
        self._open.clear()


class ReadAhead:
    """Keep the storage fetching up to ``window`` bytes of the reads after the one starting.

    On local disk this is ``POSIX_FADV_WILLNEED``: the kernel queues those reads at once, so
    the disk works at full depth while the workers copy and hash, and ranks that read the
    same bytes (a row -> column reshard) find them in the page cache. A bounded window, not
    the whole plan: read-ahead beyond what memory holds would be evicted before it is used.
    The executor asks for the first window before any read starts; after that each start
    adds what its window newly covers, so the hint stays a window ahead of the reads.
    """

    def __init__(self, reads: Sequence[PhysicalRead], readers: Readers, window: int) -> None:
        self._reads = reads  # the reads to hint (None: a read that goes around the page cache)
        self._readers = readers
        self._window = window
        self._cum = [0]  # bytes of reads[:i]
        for r in reads:
            self._cum.append(self._cum[-1] + (r.byte_range.length if r is not None else 0))
        self._next = 0  # reads before this one have been asked for
        self._lock = threading.Lock()

    @property
    def asked(self) -> int:
        """How many reads, from the first, the storage has been asked to fetch."""
        return self._next

    def starting(self, k: int) -> None:
        """Read ``k`` starts: ask for every read up to ``window`` bytes from it not yet asked for."""
        n = len(self._reads)
        j = min(n, bisect.bisect_left(self._cum, self._cum[k] + self._window, lo=k + 1))
        with self._lock:
            lo = max(k, self._next)
            if j <= lo:
                return
            self._next = j
        self._readers.prefetch([r for r in self._reads[lo:j] if r is not None])


__all__ = ["ReadAhead", "Readers"]
