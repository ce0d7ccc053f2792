"""Run a LoadPlan against storage: the reads of a load, and of the offline tools' runs.

Each physical read either lands straight in the targets' memory (every copy it feeds is
a contiguous run of source bytes going to a contiguous CPU region of a same-dtype target:
one ``preadv`` scatters file bytes into tensor memory, gaps into small scratch buffers)
or goes through one bounded buffer (``<= max_read`` plus chunk rounding) and is copied
with ``as_strided`` views — for strided, cast or non-CPU targets. With ``verify`` every
chunk a read touches is hashed and compared with the manifest before the read's buffer
is copied anywhere. Reads run on a small thread pool; files are opened once. As each read
starts, the storage is asked to fetch the next ``PREFETCH_WINDOW`` bytes of reads ahead
(``FileReader.prefetch``: ``POSIX_FADV_WILLNEED`` on local disk, nothing on object stores;
``loading.files``). Large reads go around the page cache or through it as ``loading.trial``
decides; what went through it is dropped when no other process reads it (``loading.pagecache``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardfmt.errors import IntegrityError, ManifestError, ShardfmtError
from shardfmt.format.hashing import ChunkGrid, ChunkHasher
from shardfmt.format.manifest import FileRecord
from shardfmt.format.tensor_bytes import byte_view, is_direct
from shardfmt.io import aligned, choice, modes
from shardfmt.io.aligned import DIRECT_ALIGN, address
from shardfmt.io.store import FileReader, Storage
from shardfmt.loading.files import ReadAhead, Readers
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.pagecache import Drops, release_read
from shardfmt.loading.planner import CopyItem, LoadPlan, PhysicalRead
from shardfmt.loading.shared import Share
from shardfmt.loading.tally import Tally
from shardfmt.loading.targets import ReadTarget
from shardfmt.loading.trial import ModeTrial

READ_PIECE = 8 << 20  # read and hash in pieces that stay in cache
IOV_BATCH = 1024  # buffers per scatter read (Linux IOV_MAX)
PREFETCH_WINDOW = 256 << 20  # bytes of upcoming reads the storage is asked to fetch ahead
SHARED_WINDOW = 256 << 20  # bytes a read group's owner reads ahead of the broadcasts
DIRECT_MIN_READ = 1 << 20  # reads at least this large may go around the page cache (``ReadTarget.sole``)
DIRECT_MIN_SHARE = 0.9  # ... from a file this process reads at least this share of (``_read_whole``)


def _pieces(segments: Sequence[memoryview]):
    """The segments cut into pieces of at most READ_PIECE bytes, in order: (segment, offset, piece)."""
    for i, seg in enumerate(segments):
        for off in range(0, len(seg), READ_PIECE):
            yield i, off, seg[off : off + READ_PIECE]


# Called as each part of a read's segments is in memory and hashed: (segment, first byte, end byte).
Landed = Callable[[int, int, int], None]


def _dst_view(dst: torch.Tensor, item: CopyItem) -> torch.Tensor:
    return dst[tuple(slice(o, o + n) for o, n in zip(item.dst_offsets, item.src_lengths))]


def _src_view(buf: torch.Tensor, offset: int, item: CopyItem, dtype: torch.dtype) -> torch.Tensor:
    isz = dtype.itemsize
    nbytes = item.src_end - item.src_start
    raw = buf[offset : offset + nbytes]
    if offset % isz:
        raw = raw.clone()  # misaligned for this dtype (a file from another writer): realign
    typed = raw.view(dtype) if nbytes else torch.empty(0, dtype=dtype)
    return typed.as_strided(item.src_lengths, item.src_strides) if item.numel else typed[:0].reshape(item.src_lengths)


def _is_run(item: CopyItem, isz: int) -> bool:
    return item.src_end - item.src_start == item.numel * isz


class Executor:
    """Fill each target's ``dst`` (shaped like its box) from a plan's reads.

    ``targets[i]`` is the ``ReadTarget`` of index ``i``: its memory, its stored dtype, and
    whether it is read through a bounce buffer (``bounce``: targets sharing memory are never
    read into directly even when they could be, since bytes landing there could change before
    they are hashed) or may be read around the page cache (``sole``: no other process on the
    machine reads its bytes, a DTensor sharded on every mesh dim or any target of a single
    process; large reads that land straight in it go around the cache where the storage can,
    ``O_DIRECT``, which saves the kernel's copy and its page allocations; bytes that other
    ranks may read too stay in the page cache, where they are read from the device once).
    ``options.workers`` threads read. ``bounce_buffers`` (uint8, one per worker) serve as the
    workers' bounce buffers instead of buffers allocated per run, so a caller running many
    plans (offline conversion under a memory budget) keeps one fixed set; each must hold the
    plan's largest bounced read. ``follow_links``: the files under ``root`` may be reached
    through symbolic links (a Hugging Face folder, never a shardfmt checkpoint: spec section 2).
    ``tally``: each copy's values are added to it as soon as they are in their target, on the
    thread that read them (``loading.tally``). The plan carries the file records and chunk
    grids its reads are checked against.
    """

    def __init__(self, storage: Storage, root: str, targets: Sequence[ReadTarget],
                 options: LoadOptions, *, bounce_buffers: Sequence[torch.Tensor] = (),
                 follow_links: bool = False, tally: Tally | None = None) -> None:
        self.storage = storage
        self.root = root
        self.targets = targets
        self.workers = options.workers
        self.follow_links = follow_links
        self.tally = tally
        self.cached: list[tuple[str, int, int]] = []  # (file, start, end) read through the page cache, kept
        self.trial = ModeTrial(modes.BUFFERED, tried=False)  # how the last run's large reads went (``loading.trial``)
        self._cached_lock = threading.Lock()
        self._drops: Drops | None = None
        self._given = tuple(bounce_buffers)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._local = threading.local()
        self._files: Mapping[str, FileRecord] = {}
        self._grids: Mapping[str, ChunkGrid] = {}

    def run(self, plan: LoadPlan) -> None:
        self.cached = []
        self._local = threading.local()
        self._free = queue.SimpleQueue()
        self._files, self._grids = plan.files, plan.grids
        for b in self._given:
            self._free.put(b)
        readers = Readers(self.storage, self.root, plan.files, follow_links=self.follow_links)
        drops = self._drops = Drops(readers)
        hinted: list[bool] = []
        ahead: ReadAhead | None = None
        try:
            forced = choice.forced()
            eligible = self._eligible(plan, readers, forced)
            self.trial = self._trial_for(plan, readers, eligible, forced)
            # each read around the page cache or not (None: as the trial says, when it starts)
            ways: list[bool | None] = [None if e and self.trial.tried else e and readers.get(r.file).direct
                                       for e, r in zip(eligible, plan.reads)]
            # the kernel is asked to fetch ahead what goes through the page cache for sure
            hinted = [w is False for w in ways]
            ahead = ReadAhead([r if h else None for h, r in zip(hinted, plan.reads)], readers, PREFETCH_WINDOW)
            # the first window is asked for before any read starts: a read that overtakes the hint
            # fetches its pages itself, at several times the CPU (``ReadAhead``)
            ahead.starting(0)
            # direct reads mostly wait on the device: more of them keep its queue full
            concurrency = self.storage.read_concurrency
            if not all(hinted):
                concurrency = max(concurrency, aligned.MIN_THREADS)
            workers = min(self.workers, len(plan.reads), concurrency)
            if workers <= 1:
                for k, r in enumerate(plan.reads):
                    ahead.starting(k)
                    self._one(r, readers, plan.verify, around=ways[k])
            else:
                self._run_pool(plan, readers, ahead, ways, workers)
        except BaseException:
            # a failed read's bytes, and those read ahead for reads that never ran, are cached too
            asked = 0 if ahead is None else ahead.asked
            drops.keep([r for r, h in zip(plan.reads[:asked], hinted) if h and self._sole(r)])
            drops.finish(quiet=True)  # never in place of the error
            raise
        else:
            drops.finish()
        finally:
            self._drops = None
            readers.close()

    def run_shared(self, plan: LoadPlan, share: Share) -> None:
        """Run ``plan`` with its read group (``loading.shared``): each read's owner reads and
        verifies it into a buffer, ahead of need on ``workers`` threads (at most
        ``SHARED_WINDOW`` bytes in flight); in plan order, the bytes go to every member
        (broadcast), and each copies them into its targets. An owner's failure is every
        member's, at the same read."""
        self._files, self._grids = plan.files, plan.grids
        self.cached = []
        self.trial = ModeTrial(modes.BUFFERED, tried=False, why="a read group's owner reads through the page cache")
        mine = [k for k, o in enumerate(share.owners) if o == share.me]
        readers = Readers(self.storage, self.root, plan.files, follow_links=self.follow_links)
        workers = max(1, min(self.workers, self.storage.read_concurrency, len(mine)))
        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardfmt-shared") as pool:
                fetched: dict[int, Future] = {}
                nxt, inflight = 0, 0
                for k, read in enumerate(plan.reads):
                    while nxt < len(mine) and (inflight < SHARED_WINDOW or not fetched):
                        j = mine[nxt]
                        fetched[j] = pool.submit(self._fetch, plan.reads[j], readers, plan.verify)
                        inflight += plan.reads[j].byte_range.length
                        nxt += 1
                    owner = share.owners[k]
                    error: BaseException | None = None
                    if owner == share.me:
                        buf, error = fetched.pop(k).result()
                        inflight -= read.byte_range.length
                    else:
                        buf = torch.empty(read.byte_range.length + 1, dtype=torch.uint8)
                    share.broadcast(buf, owner)
                    if int(buf[-1]) != 1:
                        raise share.send_error(owner, error)
                    self._scatter(read, buf[:-1])
        finally:
            readers.close()

    def _fetch(self, read: PhysicalRead, readers: Readers, verify: bool) -> tuple[torch.Tensor, BaseException | None]:
        """Read (and verify) ``read`` into a new buffer with a flag byte after it: 1 read, 0 failed."""
        buf = torch.zeros(read.byte_range.length + 1, dtype=torch.uint8)
        try:
            reader = readers.get(read.file)
            self._read(reader, read, [byte_view(buf[:-1])], verify)
        except (ShardfmtError, OSError) as e:
            return buf, e
        release_read(reader, read)  # its one reader in the job: the others get the bytes from here
        buf[-1] = 1
        return buf, None

    def _scatter(self, read: PhysicalRead, buf: torch.Tensor) -> None:
        """Copy a read's bytes (``buf``, from its first byte) into the targets it feeds, each
        copy tallied while it is in cache."""
        start = read.byte_range.start
        tally = self.tally
        for it in read.items:
            t = self.targets[it.target]
            dst = _dst_view(t.dst, it)
            dst.copy_(_src_view(buf, it.src_start - start, it, t.src_dtype))
            if tally is not None and tally.counts(it.target):
                tally.filled(t, it, dst)

    def _run_pool(self, plan: LoadPlan, readers: Readers, ahead: ReadAhead, ways: list[bool | None],
                  workers: int) -> None:
        """Run the reads on ``workers`` threads; raise the first read's error once all are done."""
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardfmt-read") as ex:
            futures = [ex.submit(self._one, r, readers, plan.verify, ahead, k, around=ways[k])
                       for k, r in enumerate(plan.reads)]
            errors = []
            for f in futures:
                try:
                    f.result()
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)
            if errors:
                raise errors[0]

    # -- one physical read
    def _direct_ok(self, read: PhysicalRead) -> bool:
        pos = read.byte_range.start
        for it in read.items:
            t = self.targets[it.target]
            dst, dtype = t.dst, t.src_dtype
            if t.bounce or dst.dtype != dtype or it.src_start < pos or not _is_run(it, dtype.itemsize):
                return False
            if not is_direct(_dst_view(dst, it)):
                return False
            pos = it.src_end
        return True

    def _around_cache(self, read: PhysicalRead) -> bool:
        """Whether ``read`` may go around the page cache: large, on local storage, landing
        straight in targets only this process reads, with few bytes of gap between them."""
        if self.storage.remote or read.byte_range.length < DIRECT_MIN_READ or not self._sole(read):
            return False
        return self._direct_ok(read)

    def _eligible(self, plan: LoadPlan, readers: Readers, forced: str | None) -> list[bool]:
        """Which reads may go around the page cache: large reads from files the process reads
        (nearly) whole (``_read_whole``, ``_around_cache``), on a reader that has direct reads
        (a local file's; an object store's has none); none where buffered is forced."""
        if forced == modes.BUFFERED:
            return [False] * len(plan.reads)
        whole = _read_whole(plan)
        return [r.file in whole and self._around_cache(r) and hasattr(readers.get(r.file), "can_direct")
                for r in plan.reads]

    def _trial_for(self, plan: LoadPlan, readers: Readers, eligible: list[bool], forced: str | None) -> ModeTrial:
        """How the eligible reads go (``loading.trial``): tried both ways where the load is large,
        its files are on one device that can read them direct, nothing is forced and the
        device's own measurement left doubt; else each its device's choice (the outcome names
        the first file's)."""
        files = sorted({r.file for r, e in zip(plan.reads, eligible) if e})
        if forced == modes.BUFFERED:
            return ModeTrial.for_load(modes.BUFFERED, 0, forced)
        if not files:
            return ModeTrial(modes.BUFFERED, tried=False, why="no read may go around the page cache")
        first = readers.get(files[0])
        start = modes.DIRECT if first.direct else modes.BUFFERED
        if len({getattr(readers.get(f), "device", None) for f in files}) > 1:
            return ModeTrial(start, tried=False, why="files on several devices: each read its device's choice")
        trial = ModeTrial.for_load(start, sum(eligible), forced)
        if not trial.tried:
            return trial
        known = getattr(first, "measured", lambda: None)()
        if known is not None and known.clear and known.mode == start:
            return ModeTrial(start, tried=False, why=f"the device's choice, measured clearly ({known.why}): not tried")
        if not all(readers.get(f).can_direct() for f in files):
            return ModeTrial(start, tried=False, why="a file cannot be read around the page cache: not tried")
        return trial

    def _one(self, read: PhysicalRead, readers: Readers, verify: bool,
             ahead: ReadAhead | None = None, k: int = 0, *, around: bool | None = False) -> None:
        """Do one physical read; ``around``: around the page cache or not, None: the way the
        load's trial says (timed for it where the read is one of the tried)."""
        if ahead is not None:
            ahead.starting(k)
        reader = readers.get(read.file)
        mode, timed = self.trial.next_mode() if around is None else ("", False)
        if around is None:
            around = mode == modes.DIRECT
            if timed and around:
                with aligned.POOL.buffer(_direct_block(read)):
                    pass  # its bounce buffer made now, not in the time the trial counts
        t0 = time.perf_counter()
        try:
            self._move(read, reader, verify, around=around)
        except BaseException:
            if timed:
                self.trial.failed(mode)
            if not around and self._drops is not None and self._sole(read):
                self._drops.keep([read])  # what it read is cached: dropped as the run ends
            raise
        seconds = time.perf_counter() - t0
        went_around = around and reader.can_direct()  # planned direct, read through the cache
        if not went_around:
            self._read_through_cache(reader, read)
        if timed:
            if around and not went_around:
                self.trial.refused()
            else:
                self.trial.timed(mode, read.byte_range.length, seconds)

    def _move(self, read: PhysicalRead, reader: FileReader, verify: bool, *, around: bool) -> None:
        """Read ``read`` into its targets; ``around``: around the page cache."""
        start, end = read.byte_range.start, read.byte_range.end
        if self._direct_ok(read):
            segments: list[memoryview] = []
            fills: list[CopyItem | None] = []  # the copy each segment is (None: a gap)
            pos = start
            for it in read.items:
                if it.src_start > pos:
                    segments.append(memoryview(bytearray(it.src_start - pos)))
                    fills.append(None)
                if it.src_end > it.src_start:
                    segments.append(byte_view(_dst_view(self.targets[it.target].dst, it)))
                    fills.append(it)
                pos = it.src_end
            if end > pos:
                segments.append(memoryview(bytearray(end - pos)))
                fills.append(None)
            self._read(reader, read, segments, verify, around=around, landed=self._tallied(fills))
        else:
            buf = self._bounce(end - start)
            self._read(reader, read, [byte_view(buf)], verify)
            self._scatter(read, buf)

    def _read_through_cache(self, reader: FileReader, read: PhysicalRead) -> None:
        """``read`` went through the page cache: drop its pages when the run ends if no other
        process reads them (a checkpoint does not take the training job's page cache;
        ``Drops``), else note them (``cached``: other ranks of the node may read them;
        ``release`` once all have)."""
        if self.storage.remote or not hasattr(reader, "release"):  # no page cache of this machine's
            return
        if self._sole(read):
            self._drops.add(read)
        else:
            with self._cached_lock:
                self.cached.append((read.file, read.byte_range.start, read.byte_range.end))

    def _sole(self, read: PhysicalRead) -> bool:
        """Whether no other process reads the bytes of ``read``: every target it feeds is this
        process's alone, and its copies take at least 7/8 of its bytes. A read that skips more
        (a column slice of row-major rows: strided copies, or half-rows at a chunk's edges)
        spans bytes the other ranks' slices hold, so they read the same range: through the page
        cache, kept for them, the device serves it once."""
        used = sum(it.numel * it.itemsize for it in read.items)
        return used * 8 >= read.byte_range.length * 7 and all(self.targets[it.target].sole for it in read.items)

    def _tallied(self, fills: Sequence[CopyItem | None]) -> Landed | None:
        """What adds each part of a direct read to the tally as it lands, while it is in cache:
        ``fills[i]`` is the copy segment ``i`` is, a contiguous run of its target's elements."""
        tally = self.tally
        if tally is None or not any(it is not None and tally.counts(it.target) for it in fills):
            return None
        runs = [None if it is None or not tally.counts(it.target)
                else _dst_view(self.targets[it.target].dst, it).reshape(-1) for it in fills]

        def landed(seg: int, lo: int, hi: int) -> None:
            run = runs[seg]
            if run is not None:
                it = fills[seg]
                isz = run.element_size()
                tally.landed(self.targets[it.target], it, run[lo // isz:hi // isz], lo // isz)
        return landed

    def _bounce(self, n: int) -> torch.Tensor:
        """Return this thread's bounce buffer, grown to ``n`` bytes: one per worker, reused for
        every read (allocating per read lets the C allocator keep the freed blocks: RSS creeps)."""
        buf = getattr(self._local, "buf", None)
        if buf is None and self._given:
            try:
                buf = self._local.buf = self._free.get_nowait()
            except queue.Empty:
                pass
        if buf is None or buf.numel() < n:
            if self._given:
                raise ShardfmtError(f"internal: a read of {n} bytes does not fit the "
                                    f"{self._given[0].numel()}-byte bounce buffers it was given")
            buf = self._local.buf = torch.empty(n, dtype=torch.uint8)
        return buf[:n]

    def _read(self, reader: FileReader, read: PhysicalRead, segments: list[memoryview], verify: bool, *,
              around: bool = False, landed: Landed | None = None) -> None:
        """Read the segments in cache-sized pieces, hashing each piece as soon as it lands, then
        telling ``landed`` (``around``: through ``_read_direct``)."""
        pos = read.byte_range.start
        hasher = self._hasher(read) if verify else None
        try:
            if around:
                _read_direct(reader, read, segments, hasher, landed)
                segments = []
            if self.storage.remote:  # a request is a round trip: one GET for the whole read
                reader.readinto(pos, segments)
                for i, off, piece in _pieces(segments):
                    if hasher is not None:
                        hasher.update(piece)
                    if landed is not None:
                        landed(i, off, off + len(piece))
                segments = []
            batch: list[tuple[int, int, memoryview]] = []  # read by one call: <= READ_PIECE bytes, IOV_BATCH buffers
            size = 0
            for piece in _pieces(segments):
                if batch and (size + len(piece[2]) > READ_PIECE or len(batch) == IOV_BATCH):
                    pos = self._read_batch(reader, pos, batch, size, hasher, landed)
                    batch, size = [], 0
                batch.append(piece)
                size += len(piece[2])
            if batch:
                self._read_batch(reader, pos, batch, size, hasher, landed)
        except ShardfmtError as e:  # same kind (truncation stays an IntegrityError), with the read named
            raise type(e)(f"{read.file}: reading bytes [{read.byte_range.start}, {read.byte_range.end}) "
                               f"failed: {e}") from None
        if hasher is not None:
            self._verify(read, hasher.finish())

    @staticmethod
    def _read_batch(reader: FileReader, pos: int, batch: list[tuple[int, int, memoryview]], size: int,
                    hasher: ChunkHasher | None, landed: Landed | None) -> int:
        """One scatter read of consecutive pieces, then hash them (and tell ``landed``) in order;
        return the next offset."""
        reader.readinto(pos, [piece for _, _, piece in batch])
        for i, off, piece in batch:
            if hasher is not None:
                hasher.update(piece)
            if landed is not None:
                landed(i, off, off + len(piece))
        return pos + size

    def _hasher(self, read: PhysicalRead) -> ChunkHasher:
        """A hasher cutting the read's bytes into the chunks of its file's grid."""
        start, end = read.byte_range.start, read.byte_range.end
        grid = self._grids[read.file]
        try:
            if grid.widen(start, end) != (start, end):
                raise IntegrityError(f"{read.file}: read of bytes [{start}, {end}) is not whole chunks; cannot verify")
            return grid.hasher(start)
        except ManifestError as e:
            raise IntegrityError(f"{read.file}: read of bytes [{start}, {end}) cannot be verified: {e}") from None

    def _verify(self, read: PhysicalRead, got: list[str]) -> None:
        start, end = read.byte_range.start, read.byte_range.end
        grid = self._grids[read.file]
        span = grid.span(start, end)
        want = self._files[read.file].chunks
        for k, digest in zip(span, got):
            if k >= len(want) or digest != want[k]:
                lo, hi = grid.bounds(k)
                raise IntegrityError(
                    f"{read.file}: chunk {k} (bytes [{lo}, {hi})) hashes to {digest}, "
                    f"manifest says {want[k] if k < len(want) else 'nothing'}"
                )
        if len(got) != len(span):
            raise IntegrityError(f"{read.file}: bytes [{start}, {end}) hashed as {len(got)} chunks, "
                                 f"the chunk grid has {len(span)} there")


def _direct_block(read: PhysicalRead) -> int:
    """The block (and bounce buffer) ``_read_direct`` moves ``read`` in: the read's size at most."""
    start = read.byte_range.start
    return aligned.bounce_size(64 * (read.byte_range.end - start + start % DIRECT_ALIGN), cap=aligned.MAX_BLOCK)


def _read_whole(plan: LoadPlan) -> frozenset[str]:
    """The files ``plan`` reads (nearly) all the data of: ``DIRECT_MIN_SHARE`` or more of the
    bytes of the shards it reads from them (an incremental base's file also holds shards later
    saves replaced: not counted).

    Only their reads go around the page cache. A file a process reads a part of is read by
    others too (a 2 -> 4 reshard: two ranks take alternate 16 MiB runs of each file): through
    the page cache, the kernel's read-ahead turns their interleaved runs into one sequential
    stream of the file, where direct reads seek between them. Measured on this project's VM
    (benchmarks/README.md, issue 22), 4 ranks loading a 2-rank save of 1 GiB: 0.863 s through
    the cache against 1.105 s direct (the floor: 0.842 s); settled (session 20), 0.953-0.971 s
    through the cache against 0.985-0.989 s direct, overlapping; a rank reading its whole file
    (same topology; 2 -> 1) was as fast or faster direct then. Since the hints cover their range,
    two ranks each reading its whole file were faster buffered in four io-mode runs in a row
    (sessions 25-26), while the probe, whose streams are threads of one process, chose direct:
    benchmarks/README.md, "Whole-file loads with two processes". Session 25 let files
    read in part go the device's way in three io-mode runs: their forced buffered 2 -> 4 loads
    overlapped forced direct twice and were ahead once (0.568 s [0.525-0.619] against 0.692 s
    [0.691-0.747]), so the rule stays."""
    read: dict[str, int] = {}
    for r in plan.reads:
        read[r.file] = read.get(r.file, 0) + r.byte_range.length
    live: dict[str, int] = {}
    for _, shard in {(fqn, shard.file, shard.byte_range): (fqn, shard) for fqn, shard in plan.shards}.values():
        live[shard.file] = live.get(shard.file, 0) + shard.byte_range[1] - shard.byte_range[0]
    return frozenset(name for name, n in read.items() if live.get(name, 0) > 0 and n >= DIRECT_MIN_SHARE * live[name])



def _read_direct(reader: FileReader, read: PhysicalRead, segments: list[memoryview],
                 hasher: ChunkHasher | None, landed: Landed | None = None) -> None:
    """Read ``read`` around the page cache (``FileReader.read_block``): aligned blocks land in a
    reused bounce buffer, are hashed there, then copied into the segments in order (and each
    part copied told to ``landed``)."""
    start, end = read.byte_range.start, read.byte_range.end
    lo = start - start % DIRECT_ALIGN
    size = _direct_block(read)
    seg, filled = 0, 0  # the segment being filled, and its bytes already filled
    with aligned.POOL.buffer(size) as bounce:
        for block in range(lo, end, size):
            n = min(block + size, end) - block
            reader.read_block(block, bounce.mv[:size], n)
            p = max(start - block, 0)
            if hasher is not None:
                hasher.update(bounce.mv[p:n])
            while p < n:
                dst = segments[seg]
                k = min(n - p, len(dst) - filled)
                aligned.copy(address(dst, filled), bounce.address + p, k)
                if landed is not None:
                    landed(seg, filled, filled + k)
                p += k
                filled += k
                if filled == len(dst):
                    seg, filled = seg + 1, 0
