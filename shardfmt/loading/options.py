"""The knobs of a load, each with its one default: ``LoadOptions``.

``load`` takes them as keywords, the planner and the executor read them from here, and the
offline tools (``reshard``) build one for their own runs. Two defaults depend on where the
checkpoint is, so they stay ``None`` until ``for_storage`` sees the storage: the largest gap
worth reading through (a round trip costs more on an object store) and the workers (an
object store wants more requests in flight). The size of a read through a bounce buffer
depends on how much the rank loads (``bounce_read_size``) unless a caller fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from shardfmt.errors import StateDictError
from shardfmt.io.store import Storage

DEFAULT_MAX_GAP = 1 << 20  # local disk: reading 1 MiB of gap beats a second request
DEFAULT_MAX_READ = 64 << 20
DEFAULT_MAX_BOUNCE_READ = 8 << 20  # reads through a bounce buffer: bounds its memory (x workers)
DEFAULT_WORKERS = 4
MAX_OBJECT_STORE_WORKERS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """How to load: what to check, what to accept, how to read.

    ``strict``: a key the caller holds that the checkpoint lacks raises (else it is reported
    missing). ``verify``: hash every chunk read and check every file header. ``cast``: accept
    a target dtype other than the checkpoint's. ``per_rank``: on a different world size,
    ``"error"`` raises for ``PerRank`` values, ``"skip"`` keeps the caller's. ``max_gap``:
    bytes of gap read through to merge two reads (None: the storage's). ``max_read``: the
    largest read merging builds. ``max_bounce_read``: the largest read through a bounce
    buffer (None: sized from what the rank loads). ``workers``: reading threads.
    ``share_reads``: under torch.distributed, ranks that read the same byte ranges (data
    parallel replicas) read each range once and broadcast it (``loading.shared``; the load is
    then a collective of its process group); None: on object stores only, where every rank's
    read is a request the store serves again (on local disk the page cache shares them).
    ``value_stats``: sum the statistics of the values loaded, in the read pass, for the tensors
    the checkpoint records statistics of (``loading.tally``; ``LoadReport.value_stats``).
    """

    strict: bool = True
    verify: bool = True
    cast: bool = False
    per_rank: Literal["error", "skip"] = "error"
    max_gap: int | None = None
    max_read: int = DEFAULT_MAX_READ
    max_bounce_read: int | None = None
    workers: int = DEFAULT_WORKERS
    share_reads: bool | None = None
    value_stats: bool = False

    def __post_init__(self) -> None:
        if self.per_rank not in ("error", "skip"):
            raise StateDictError(f"per_rank must be 'error' or 'skip', got {self.per_rank!r}")

    @classmethod
    def merged(cls, options: LoadOptions | None = None, **given) -> LoadOptions:
        """``options`` (default: the defaults) with every knob given as a keyword that is not None."""
        base = options if options is not None else cls()
        changes = {k: v for k, v in given.items() if v is not None}
        return replace(base, **changes) if changes else base

    def for_storage(self, storage: Storage) -> LoadOptions:
        """These options with the storage's defaults filled in: its ``max_gap`` (larger where a
        request costs a round trip) and, on an object store, more workers (up to 16)."""
        max_gap = storage.max_gap if self.max_gap is None else self.max_gap
        workers = self.workers
        if storage.remote:
            workers = max(workers, min(storage.read_concurrency, MAX_OBJECT_STORE_WORKERS))
        share = storage.remote if self.share_reads is None else self.share_reads
        return replace(self, max_gap=max_gap, workers=workers, share_reads=share)

    def bounce_read_size(self, share: int, chunk: int, *, remote: bool) -> int:
        """The largest read through a bounce buffer when a rank loads ``share`` bytes (each
        worker keeps one buffer that large); ``max_bounce_read`` when given.

        Local disk: 8 MiB, less for a small share, so that the workers' buffers together stay
        under 1/16 of what the rank loads (the planner cuts verified reads at chunk boundaries,
        so smaller reads re-read nothing). Object stores: 16-64 MiB (1/32 of the share), since
        every read is a round trip."""
        if self.max_bounce_read is not None:
            return self.max_bounce_read
        if remote:
            lo = 2 * DEFAULT_MAX_BOUNCE_READ
            size = min(max(share // 32, lo), 4 * lo)
        else:
            size = min(DEFAULT_MAX_BOUNCE_READ, share // (16 * max(1, self.workers)))
        return max(chunk, size // chunk * chunk)
