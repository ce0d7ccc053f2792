"""Async save: the caller blocks only for a snapshot; writing and committing run in the background.

::

    handle = shardfmt.async_save(state, "ckpt/step_100", step=100)   # returns after the snapshot
    optimizer.step()                                                  # cannot change what is written
    ...
    manifest = handle.wait()                                          # re-raises the save's error

1) on the caller's thread: the state is described (values are encoded to JSON here, so they
   are a snapshot too) and every tensor piece the rank holds is copied into a ``Stager``'s
   host buffers. The buffers are allocated on the first save and reused by every later one
   (first-touch page faults make fresh memory 10-25x slower to fill than reused memory),
   pinned when the state is on CUDA, where the copies run non-blocking on a side stream.
2) on a background thread: the save protocol of ``shardfmt.saving.distributed`` on a gloo group
   of its own (never the training's collectives), then the commit. Where the copy is DMA
   (CUDA states; ``Stager(overlap=...)`` decides) the thread starts while it runs: agreeing
   on the plan and staging the checkpoint need no data, and writing starts on the pieces
   already copied while later ones are in flight. CPU copies would share the cores and the
   GIL with it, so there it starts after the copy (``stage="background"``: at once). A save counts only once committed: until then ``Checkpointer.latest()`` is the
   previous one.

One save at a time per stager: staging memory is one copy of the rank's state. A save
asked for while the previous one is still writing either waits for it (``policy="wait"``,
the default) or is skipped and logged (``policy="skip"``; under a process group the ranks
agree, so either all skip or none does). ``stage="background"`` also moves the copy off the
caller's thread: call ``handle.wait_staged()`` before the state changes again (before the
next optimizer step), so the copy overlaps forward and backward.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import functools
import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardfmt.errors import CommitError, ShardfmtError, StateDictError
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.manifest import Manifest, check_step
from shardfmt.format.tensor_bytes import resolved
from shardfmt.saving.distributed import (
    Prepared,
    control_group,
    in_distributed_job,
    prepare,
    run_save,
)

log = logging.getLogger("shardfmt")

POLICIES = ("wait", "skip")
STAGES = ("call", "background")


_ALIGN = 512  # bytes: every staged piece starts at a multiple (element sizes, DMA-friendly)
_PAGE = mmap.PAGESIZE  # the registered range is whole pages of the arena's own: no overlap with another registration
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable, as torch.cuda._pin_memory_utils.pin_memory


class Stager:
    """Host-memory staging buffers for snapshots: one copy of a rank's state, reused across saves.

    All pieces live in one flat host allocation of exactly the state's size (plus alignment),
    carved into views; it is kept while the pieces' dtypes and shapes stay the same and
    replaced (the old one freed first) when they change. For CUDA states the allocation is
    pinned by registering it with CUDA (``cudaHostRegister``), which pins exactly its size;
    PyTorch's pinned allocator would round every buffer up to a power of two (up to 2x the
    memory). Where registering is not possible, each piece is pinned on its own instead.

    ``overlap``: whether a save's writer may start on pieces already copied while later ones
    are still copying. None (default): only for CUDA states, whose copies are DMA; CPU copies
    would compete with the writer for the same cores and lengthen the time the caller blocks.
    """

    def __init__(self, *, pin_memory: bool | None = None, overlap: bool | None = None) -> None:
        self._pin = pin_memory
        self.overlap = overlap
        self._buffers: list[torch.Tensor] = []
        self._layout: list[tuple] = []
        self._finalizer = None
        self._streams: dict[int, torch.cuda.Stream] = {}  # device index -> side stream; shared with unpin
        self._lock = threading.Lock()
        self.inflight: AsyncSave | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _allocate(self, tensors: list[torch.Tensor], pin: bool) -> None:
        self._drop()
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        size = -(-max(total, 1) // _PAGE) * _PAGE
        raw = torch.empty(size + _PAGE, dtype=torch.uint8)
        lead = -raw.data_ptr() % _PAGE
        arena = raw[lead:lead + size]
        if pin:
            device = next((t.device for t in tensors if t.device.type == "cuda"), None)
            unpin = _register_pinned(arena, device, self._streams)
            if unpin is None:  # cannot register: pin piece by piece (PyTorch's allocator)
                self._buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
                self._layout = [_sig(t, pin) for t in tensors]
                return
            self._finalizer = weakref.finalize(self, unpin)
            self._finalizer.atexit = False  # as DCP's stager: the OS unpins at exit; no cudart call at shutdown
        self._buffers = [arena[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                         for o, t in zip(offsets, tensors)]
        self._layout = [_sig(t, pin) for t in tensors]

    def _drop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unregisters (once) while the arena is still alive
            self._finalizer = None
        self._buffers = []
        self._layout = []

    def copy(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Copy ``tensors`` into the staging buffers; return them and a wait-for-copies function.

        CPU sources are copied before this returns. CUDA sources are copied non-blocking on a
        side stream that first waits for the current stream (so it sees every queued write);
        the returned function blocks until those copies have landed.
        """
        staged = self.begin(tensors)
        staged.run()
        return staged.buffers, staged.wait

    def begin(self, tensors: list[torch.Tensor], *, after=None) -> StagedCopy:
        """Allocate (or reuse) the buffers for ``tensors``; the copy starts with ``run()``.

        The returned copy's ``ready(i)`` waits for buffer ``i`` alone, so a writer can start
        on the first pieces while later ones are still being copied. CUDA copies wait for
        ``after`` (a CUDA event recorded where the snapshot was asked for), else for the
        current stream of the thread calling ``run()``.
        """
        with self._lock:
            tensors = [resolved(t) for t in tensors]
            cuda = [t for t in tensors if t.device.type == "cuda"]
            pin = bool(cuda) if self._pin is None else self._pin
            if [_sig(t, pin) for t in tensors] != self._layout:
                self._allocate(tensors, pin)
            streams = {}
            for t in cuda:  # one side stream per device: a copy runs on its source device's current stream
                i = t.device.index
                if i not in self._streams:
                    self._streams[i] = torch.cuda.Stream(device=t.device)
                streams[i] = self._streams[i]
            overlap = bool(streams) if self.overlap is None else self.overlap
            return StagedCopy(tensors, list(self._buffers), streams, self._lock, overlap=overlap, after=after)

    def release(self) -> None:
        """Drop every buffer (the next save allocates them again)."""
        with self._lock:
            self._drop()


class StagedCopy:
    """One snapshot into a stager's buffers: ``run()`` copies, ``ready(i)`` / ``wait()`` wait.

    CPU pieces are copied one after another on the thread calling ``run()``; CUDA pieces are
    queued non-blocking on the stager's side stream (after everything already queued on the
    current stream), each followed by an event. A failure makes every later ``ready`` raise.
    """

    def __init__(self, sources: list[torch.Tensor], buffers: list[torch.Tensor], streams: dict, lock, *,
                 overlap: bool = False, after: dict | None = None) -> None:
        self.buffers = buffers
        self.overlap = overlap  # whether writing may start before the whole copy is done
        self._sources = sources
        self._streams = streams or {}  # device index -> side stream
        self._after = after or {}  # device index -> event recorded where the snapshot was asked for
        self._lock = lock
        self._issued = [threading.Event() for _ in sources]
        self._copied = [False] * len(sources)  # CPU piece i copied / CUDA piece i queued
        self._events: list = [None] * len(sources)
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            with self._lock:  # one copy into these buffers at a time
                for d, s in self._streams.items():
                    ev = self._after.get(d)
                    if ev is not None:
                        s.wait_event(ev)
                    else:
                        s.wait_stream(torch.cuda.current_stream(s.device))
                for i, (t, buf) in enumerate(zip(self._sources, self.buffers)):
                    if t.device.type == "cuda":
                        s = self._streams[t.device.index]
                        with torch.cuda.stream(s):  # also makes s's device current (Copy.cu uses its current stream)
                            buf.copy_(t, non_blocking=True)
                        t.record_stream(s)  # the caller may free t: keep it until the copy ran
                        self._events[i] = s.record_event()
                    else:
                        buf.copy_(t)
                    self._copied[i] = True
                    self._issued[i].set()
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            for ev in self._issued:
                ev.set()

    def ready(self, i: int) -> None:
        """Block until buffer ``i`` holds its copy; raise StateDictError if it never will."""
        self._issued[i].wait()
        if not self._copied[i]:
            raise StateDictError(f"snapshot into host memory failed before piece {i}: "
                                 f"{type(self._error).__name__}: {self._error}") from self._error
        if self._events[i] is not None:
            try:
                with torch.cuda.device(self._sources[i].device):  # a fresh writer thread's device is 0
                    self._events[i].synchronize()
            except Exception as e:  # noqa: BLE001 - a device error: the project's error, on every rank
                raise StateDictError(f"snapshot into host memory failed at piece {i}: "
                                     f"{type(e).__name__}: {e}") from e

    def wait(self) -> None:
        for i in range(len(self.buffers)):
            self.ready(i)

    def fail(self, error: BaseException) -> None:
        """Give up before or during ``run()``: every piece not yet copied fails its ``ready``."""
        if self._error is None:
            self._error = error
        for ev in self._issued:
            ev.set()


def _sig(t: torch.Tensor, pin: bool) -> tuple:
    return (t.dtype, tuple(t.shape), pin)


def _cudart_isolated(device, fn, *args) -> int:
    """``fn(*args)`` (a cudart call) on a short-lived thread with ``device`` current; its result, or -1.

    A failed runtime call leaves a "last error" in its host thread, which PyTorch's next
    kernel-launch check there (``C10_CUDA_KERNEL_LAUNCH_CHECK`` = ``cudaGetLastError``)
    would raise in unrelated user code; torch's binding does not clear it. On a thread of
    its own it dies with the thread, whichever libcudart instance torch uses. Setting the
    device also keeps the call off cuda:0's context (a new thread's current device).
    """
    out = [-1]

    def call() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            out[0] = int(fn(*args))
        except Exception:  # noqa: BLE001 - reported as a failure
            pass

    th = threading.Thread(target=call, name="shardfmt-cudart", daemon=True)
    try:
        th.start()
    except RuntimeError:  # interpreter shutting down (3.12+): no new threads
        call()
        return out[0]
    th.join()
    return out[0]


def _register_pinned(arena: torch.Tensor, device, streams: dict) -> Callable[[], None] | None:
    """Page-lock ``arena`` with cudaHostRegister; return the function that undoes it, or None.

    ``unpin`` first waits for ``streams`` (the stager's side streams, filled in later): no
    DMA may still target the pages when they are unregistered."""
    try:
        cudart = torch.cuda.cudart()
    except Exception:  # noqa: BLE001 - no CUDA runtime binding here: the caller pins another way
        return None
    ptr, size = arena.data_ptr(), arena.numel()
    if _cudart_isolated(device, cudart.cudaHostRegister, ptr, size, _HOST_REGISTER_PORTABLE) != 0:
        return None

    def unpin(arena=arena) -> None:  # holds the arena: it is freed only after the unregister
        for s in list(streams.values()):
            try:
                s.synchronize()
            except Exception:  # noqa: BLE001 - a broken context: unregister anyway
                pass
        _cudart_isolated(device, cudart.cudaHostUnregister, ptr)

    return unpin


def _caller_events(tensors: list[torch.Tensor]) -> dict:
    """Device index -> a CUDA event on the calling thread's current stream of that device."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return {d.index: torch.cuda.current_stream(d).record_event() for d in devices}




class AsyncSave:
    """The handle of one async save: ``wait()``, ``done()``, ``wait_staged()``."""

    def __init__(self, path: str, *, skipped: bool = False) -> None:
        self.path = path
        self.skipped = skipped
        self.blocked_seconds = 0.0      # how long the call kept the caller
        self.staged_seconds: float | None = None   # from the call until the snapshot was complete
        self.total_seconds: float | None = None    # from the call until the commit (or the failure)
        self._staged = threading.Event()
        self._done = threading.Event()
        self._manifest: Manifest | None = None
        self._error: BaseException | None = None
        self._stage_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if skipped:
            self._staged.set()
            self._done.set()

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot is complete: after this the state may change freely.

        Raises when the snapshot itself failed (the save then fails on every rank).
        """
        if not self._staged.wait(timeout):
            raise TimeoutError(f"{self.path}: snapshot not complete after {timeout} s")
        if self._stage_error is not None:
            raise self._stage_error

    def wait(self, timeout: float | None = None) -> Manifest | None:
        """Block until committed; return the manifest (None when skipped), or raise the save's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.path}: async save still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._manifest

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "failed" if self._error else "committed" if self.done() else "running"
        return f"AsyncSave({self.path!r}, {state})"


_LIVE: weakref.WeakSet[AsyncSave] = weakref.WeakSet()
_DEFAULT_STAGERS: dict[int, Stager] = {}


def default_stager(process_group=None) -> Stager:
    """The process-wide stager that ``async_save`` uses when none is given (one per group)."""
    key = id(process_group)
    s = _DEFAULT_STAGERS.get(key)
    if s is None:
        s = _DEFAULT_STAGERS[key] = Stager()
    return s


def _wait_all_at_exit() -> None:
    for h in list(_LIVE):
        try:
            h.wait()
        except BaseException as e:  # noqa: BLE001 - exiting: report, do not mask the exit
            log.error("shardfmt: async save to %s failed: %s", h.path, e)


def at_exit(fn: Callable[[], Any]) -> None:
    """Run ``fn`` when the main thread ends, before ``concurrent.futures`` stops taking work: a
    save still writing at that point needs its thread pools (``atexit`` runs too late for them)."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # already shutting down
        pass
    atexit.register(fn)


at_exit(_wait_all_at_exit)


def _any_rank(flag: bool, process_group, timeout) -> bool:
    """True on every rank when ``flag`` is true on any rank (a tiny all-reduce on the caller's thread)."""
    import torch.distributed as dist

    g = control_group(process_group, timeout)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on a dead or frozen peer
        raise CommitError(f"agreeing on whether to skip the save failed (a rank died, froze or timed out): {e}") \
            from None
    return bool(t.item())


def async_save(
    state_dict: dict,
    path: str,
    *,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    chunk_size: int = hashing.DEFAULT_CHUNK_SIZE,
    sync: bool = True,
    process_group=None,
    timeout: _dt.timedelta | None = None,
    mesh: Mapping[str, int] | None = None,
    check_replicas: bool = False,
    write_workers: int | None = None,
    part_size: int | None = None,
    stager: Stager | None = None,
    policy: str = "wait",
    stage: str = "call",
    on_commit: Callable[[Manifest], None] | None = None,
    _save_id: str | None = None,
    _on_step=None,
) -> AsyncSave:
    """Snapshot ``state_dict`` into host memory and save it in the background; see the module docstring.

    Takes ``shardfmt.save``'s arguments, plus: ``stager`` (whose buffers to reuse; by default
    one per process group), ``policy`` ("wait" or "skip") for a save asked for while the
    previous one is still writing, ``stage`` ("call": the call copies; "background": the
    background thread copies and ``wait_staged()`` says when it is done) and ``on_commit``,
    called on the background thread with the manifest once committed (before ``wait()``
    returns). Errors in the background are re-raised by ``wait()``.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    check_step(step)
    t0 = time.perf_counter()
    if metadata is not None:  # part of the snapshot: a change after the call must not reach the manifest
        metadata = jsonvalue.decode(jsonvalue.encode(metadata, where="metadata"), where="metadata")
    stager = stager or default_stager(process_group)
    distributed = in_distributed_job(process_group)
    prev = stager.inflight
    busy = prev is not None and not prev.done()
    if policy == "skip":
        if distributed:
            busy = _any_rank(busy, process_group, timeout)
        if busy:
            log.warning("shardfmt: skipping the save to %s: the previous save (%s) is still writing", path,
                        prev.path if prev is not None else "on another rank")
            h = AsyncSave(path, skipped=True)
            h.blocked_seconds = time.perf_counter() - t0
            return h
    if prev is not None:
        try:
            prev.wait()
        except BaseException as e:  # noqa: BLE001 - that save's handle reports it; this one goes on
            log.warning("shardfmt: the previous async save to %s failed: %s", prev.path, e)

    if distributed:
        import torch.distributed as dist

        group = control_group(process_group, timeout, dedicated=True)
        rank = dist.get_rank(group)
    else:
        group, rank = None, 0
    prepared = prepare(state_dict, rank)
    if group is None and prepared.error is not None:
        raise prepared.error  # one process: a bad state fails the call itself
    handle = AsyncSave(path)
    stager.inflight = handle
    _LIVE.add(handle)

    # CUDA: the snapshot sees every write queued on the caller's stream before this call, even
    # when a background thread (whose current stream is the default one) does the copy.
    sources = prepared.tensors()  # conj/neg already resolved by describe, on the caller's stream; then:
    asked = _caller_events(sources)
    snap: Prepared | None = None
    begun = threading.Event()  # the buffers are known: the writer may start on staged pieces

    def snapshot(on_begun: Callable[[], None] | None = None) -> None:
        """Copy into the stager; a failure is kept for the save, which then fails on every rank.

        ``on_begun`` runs once the buffers exist, when the writer may overlap the copy."""
        nonlocal snap
        copy = None
        try:
            copy = stager.begin(sources, after=asked)
            snap = prepared.with_tensors(copy.buffers, ready=[functools.partial(copy.ready, i)
                                                              for i in range(len(copy.buffers))])
            if copy.overlap:
                begun.set()
                if on_begun is not None:
                    on_begun()
            copy.run()
            copy.wait()
        except BaseException as e:  # noqa: BLE001 - e.g. out of (pinned) memory; re-raised below if not an Exception
            handle._stage_error = StateDictError(f"{path}: snapshot into host memory failed: "
                                                 f"{type(e).__name__}: {e}")
            if copy is not None:
                copy.fail(e)  # a writer already waiting on a piece must not wait forever
            if not isinstance(e, Exception):
                raise
        finally:
            handle.staged_seconds = time.perf_counter() - t0
            begun.set()
            handle._staged.set()

    def staged() -> Prepared:
        """The snapshot's buffers, as soon as they exist: each piece's ``ready`` waits for its copy."""
        begun.wait()
        if snap is None:
            handle._staged.wait()
            raise handle._stage_error
        return snap

    kwargs = dict(step=step, metadata=metadata, overwrite=overwrite, storage_options=storage_options,
                  chunk_size=chunk_size, sync=sync, mesh=mesh, check_replicas=check_replicas,
                  write_workers=write_workers, _save_id=_save_id, _on_step=_on_step)
    if part_size is not None:
        kwargs["part_size"] = part_size

    def work() -> None:
        try:
            # The plan's collectives and the staging need no data: they run while the copy does.
            manifest = run_save(prepared, path, group=group, _snapshot=staged, **kwargs)
            if on_commit is not None:
                on_commit(manifest)
            handle._manifest = manifest
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            if isinstance(e, (ShardfmtError, OSError)):
                handle._error = e
            else:
                handle._error = CommitError(f"{path}: async save failed: {type(e).__name__}: {e}")
                handle._error.__cause__ = e
        finally:
            handle._staged.wait()  # done only once nothing copies into the stager any more
            handle.total_seconds = time.perf_counter() - t0
            handle._done.set()

    # Not daemons: the interpreter waits for an in-flight save before it exits.
    handle._thread = threading.Thread(target=work, name="shardfmt-async-save", daemon=False)
    if stage == "call":
        # The writer starts during the copy only when the copy is DMA (CUDA): CPU copies on the
        # caller's thread would share the cores and the GIL with it and block the caller longer.
        try:
            snapshot(on_begun=handle._thread.start)
        except BaseException:  # e.g. KeyboardInterrupt during the copy
            if handle._thread.ident is None:  # no writer: this save is over (exit must not wait for it)
                handle._error = handle._stage_error
                handle.total_seconds = time.perf_counter() - t0
                handle._done.set()
            raise
        if handle._thread.ident is None:  # not started during the copy
            handle._thread.start()
    else:
        handle._thread.start()
        threading.Thread(target=snapshot, name="shardfmt-async-stage", daemon=False).start()
    handle.blocked_seconds = time.perf_counter() - t0
    return handle


__all__ = ["async_save", "AsyncSave", "Stager", "StagedCopy", "default_stager"]
