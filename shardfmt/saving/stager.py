"""Host-memory staging for async saves: one reusable copy of a rank's state.

A ``Stager`` keeps one flat host allocation of exactly the state's size, carved into
views, across saves (first-touch page faults make fresh memory 10-25x slower to fill than
reused memory); for CUDA states it is pinned by registering it with CUDA and the copies run
non-blocking on a side stream. ``StagedCopy`` is one snapshot into it: ``run()`` copies,
``ready(i)`` waits for piece ``i``, so a writer can start on pieces already copied.
The stager's memory lives as long as the stager (``release()`` frees it sooner).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shardfmt.errors import StateDictError
from shardfmt.format.tensor_bytes import resolved

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
        self.inflight: Any = None  # the AsyncSave handle of the save using the buffers

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _allocate(self, tensors: list[torch.Tensor], pin: bool) -> None:
        self._drop()
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        arena = _own_pages(-(-max(total, 1) // _PAGE) * _PAGE)
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


def _own_pages(size: int) -> torch.Tensor:
    """``size`` bytes (whole pages) of fresh private memory as a tensor whose storage starts at them.

    PyTorch's ``is_pinned()`` asks CUDA about a tensor's *storage* start: an arena carved
    page-aligned out of a larger allocation was registered (and copied at pinned speed) yet
    read as unpinned (an H200, torch 2.11, 2026-12-04). The tensor holds the mapping, which is
    unmapped when the last view goes."""
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)


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
    ptr, size = arena.data_ptr(), arena.numel() * arena.element_size()  # bytes, whatever the dtype
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


def caller_events(tensors: list[torch.Tensor]) -> dict:
    """Device index -> a CUDA event on the calling thread's current stream of that device."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return {d.index: torch.cuda.current_stream(d).record_event() for d in devices}


__all__ = ["StagedCopy", "Stager"]
