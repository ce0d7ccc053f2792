"""How a memory budget is spent: window slots, bounce buffers and an object store's uploads (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from reshard._shardfmt import DEFAULT_WORKERS, FsspecStorage
from reshard.errors import BudgetError
from reshard.options import DEFAULT_BUDGET
from reshard.parse import human
from reshard.stream.records import ALIGN, aligned

MIN_BUDGET = 1 << 20
BOUNCE_READ = 4 << 20  # smallest cap on a read gathered through a bounce buffer (casts, strided pieces)
BOUNCE_SLACK = 16 << 20  # bounce buffers held outside the budget, at most


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
    if not (isinstance(storage, FsspecStorage) and storage.multipart):
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
    window = data // slots // ALIGN * ALIGN
    return MemoryPlan(budget=budget, window=window, slots=slots, workers=workers, bounce=per,
                      bounce_read=bounce_read)


PIPELINE_MIN_WINDOW = 64 << 20


def window_capacity(mem: MemoryPlan, total: int) -> int:
    """The window size for streaming ``total`` bytes: the budget's slot, but at most ~1/16 of
    the data (at least 64 MiB) so that the first fill and the last write, which nothing
    overlaps, stay short."""
    return min(mem.window, max(PIPELINE_MIN_WINDOW, aligned(-(-total // 16))))


__all__ = ["DEFAULT_BUDGET", "MIN_BUDGET", "MemoryPlan", "fit_uploads", "memory_plan", "window_capacity"]
