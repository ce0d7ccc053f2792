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
2) on a background thread: the save protocol of ``shardfmt.saving.protocol`` on a gloo group
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
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from shardfmt.errors import CommitError, ShardfmtError, StateDictError
from shardfmt.format import jsonvalue
from shardfmt.format.manifest import Manifest
from shardfmt.format.parse import check_step
from shardfmt.saving.coordinator import LocalCoordinator, coordinator_for
from shardfmt.saving.describe import Prepared, prepare
from shardfmt.saving.messages import RankError
from shardfmt.saving.options import SaveOptions
from shardfmt.saving.protocol import run_save
from shardfmt.saving.stager import StagedCopy, Stager, caller_events

log = logging.getLogger("shardfmt")

POLICIES = ("wait", "skip")
STAGES = ("call", "background")


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

    def _run(self, save: Callable[[], Manifest], on_commit: Callable[[Manifest], None] | None, t0: float) -> None:
        """The background thread: run ``save``, keep its manifest or error; done once nothing copies."""
        try:
            manifest = save()
            if on_commit is not None:
                on_commit(manifest)
            self._manifest = manifest
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            if isinstance(e, (ShardfmtError, OSError)):
                self._error = e
            else:
                self._error = CommitError(f"{self.path}: async save failed: {type(e).__name__}: {e}")
                self._error.__cause__ = e
        finally:
            self._staged.wait()  # done only once nothing copies into the stager any more
            self.total_seconds = time.perf_counter() - t0
            self._done.set()


class DefaultStagers:
    """The stagers ``async_save`` uses when the caller gives none: one per process group, keyed
    by the group's ranks (None: the default group, or one process). Each keeps one copy of the
    rank's state in host memory, for the life of the default process group it was made under
    (a new ``init_process_group`` starts afresh; the old ones go once no save holds them), or
    until ``release()``."""

    def __init__(self) -> None:
        self._stagers: dict[tuple | None, Stager] = {}
        self._world = None
        self._lock = threading.Lock()

    def get(self, process_group=None) -> Stager:
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        key = None if process_group is None else tuple(dist.get_process_group_ranks(process_group))
        with self._lock:
            if world is not self._world:
                self._world, self._stagers = world, {}
            s = self._stagers.get(key)
            if s is None:
                s = self._stagers[key] = Stager()
            return s

    def release(self) -> None:
        """Free every default stager's buffers (a later save allocates them again)."""
        with self._lock:
            stagers = list(self._stagers.values())
        for s in stagers:
            s.release()


DEFAULT_STAGERS = DefaultStagers()
_LIVE: weakref.WeakSet[AsyncSave] = weakref.WeakSet()


def default_stager(process_group=None) -> Stager:
    """The stager that ``async_save`` uses when none is given (one per process group)."""
    return DEFAULT_STAGERS.get(process_group)


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


def async_save(
    state_dict: dict,
    path: str,
    *,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool | None = None,
    storage_options: dict | None = None,
    chunk_size: int | None = None,
    sync: bool | None = None,
    process_group=None,
    timeout: _dt.timedelta | None = None,
    mesh: Mapping[str, int] | None = None,
    check_replicas: bool | None = None,
    write_workers: int | None = None,
    part_size: int | None = None,
    format_version: int | None = None,
    base: str | None = None,
    stager: Stager | None = None,
    policy: str = "wait",
    stage: str = "call",
    on_commit: Callable[[Manifest], None] | None = None,
    options: SaveOptions | None = None,
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
    opts = SaveOptions.merged(options, overwrite=overwrite, storage_options=storage_options, chunk_size=chunk_size,
                              sync=sync, timeout=timeout, mesh=mesh, check_replicas=check_replicas,
                              write_workers=write_workers, part_size=part_size,
                              format_version=format_version, base=base)
    if metadata is not None:  # part of the snapshot: a change after the call must not reach the manifest
        metadata = jsonvalue.decode(jsonvalue.encode(metadata, where="metadata"), where="metadata")
    stager = stager or default_stager(process_group)
    skipped = _wait_for_previous(stager, path, policy=policy, process_group=process_group, timeout=opts.timeout)
    if skipped is not None:
        skipped.blocked_seconds = time.perf_counter() - t0
        return skipped
    coord = coordinator_for(process_group, opts.timeout, dedicated=True)  # never the training's collectives
    prepared = prepare(state_dict, coord.rank)
    if isinstance(coord, LocalCoordinator) and isinstance(prepared.state, RankError):
        raise prepared.state.error  # one process: a bad state fails the call itself
    handle = AsyncSave(path)
    stager.inflight = handle
    _LIVE.add(handle)
    snap = _Snapshot(handle, stager, prepared, t0)
    # The plan's collectives and the staging need no data: they run while the copy does.
    save = functools.partial(run_save, prepared, path, coord=coord, options=opts, step=step, metadata=metadata,
                             snapshot=snap.staged)
    _start(handle, snap, stage, save=save, on_commit=on_commit, t0=t0)
    handle.blocked_seconds = time.perf_counter() - t0
    return handle


def _wait_for_previous(stager: Stager, path: str, *, policy: str, process_group, timeout) -> AsyncSave | None:
    """Wait for the stager's save in flight, or (``policy="skip"``: the ranks agree) skip this one:
    return the skipped save's handle then."""
    prev = stager.inflight
    busy = prev is not None and not prev.done()
    if policy == "skip":
        coord = coordinator_for(process_group, timeout)
        flag = torch.tensor([1 if busy else 0], dtype=torch.int64)
        busy = bool(coord.all_reduce_max(flag, "agreeing on whether to skip the save").item())
        if busy:
            log.warning("shardfmt: skipping the save to %s: the previous save (%s) is still writing", path,
                        prev.path if prev is not None else "on another rank")
            return AsyncSave(path, skipped=True)
    if prev is not None:
        try:
            prev.wait()
        except BaseException as e:  # noqa: BLE001 - that save's handle reports it; this one goes on
            log.warning("shardfmt: the previous async save to %s failed: %s", prev.path, e)
    return None


class _Snapshot:
    """The copy of one save's tensors into a stager, and the writer's view of it.

    CUDA: the snapshot sees every write queued on the caller's stream before the call, even
    when a background thread (whose current stream is the default one) does the copy."""

    def __init__(self, handle: AsyncSave, stager: Stager, prepared: Prepared, t0: float) -> None:
        self._handle = handle
        self._stager = stager
        self._prepared = prepared
        self._t0 = t0
        self._sources = prepared.tensors()  # conj/neg already resolved by describe, on the caller's stream
        self._asked = caller_events(self._sources)
        self._snap: Prepared | None = None
        self._begun = threading.Event()  # the buffers are known: the writer may start on staged pieces

    def run(self, on_begun: Callable[[], None] | None = None) -> None:
        """Copy into the stager; a failure is kept for the save, which then fails on every rank.

        ``on_begun`` runs once the buffers exist, when the writer may overlap the copy."""
        copy = None
        try:
            copy = self._stager.begin(self._sources, after=self._asked)
            self._snap = self._prepared.with_tensors(copy.buffers, ready=[functools.partial(copy.ready, i)
                                                                          for i in range(len(copy.buffers))])
            if copy.overlap:
                self._begun.set()
                if on_begun is not None:
                    on_begun()
            copy.run()
            copy.wait()
        except BaseException as e:  # noqa: BLE001 - e.g. out of (pinned) memory; re-raised below if not an Exception
            self._handle._stage_error = StateDictError(f"{self._handle.path}: snapshot into host memory failed: "
                                                       f"{type(e).__name__}: {e}")
            if copy is not None:
                copy.fail(e)  # a writer already waiting on a piece must not wait forever
            if not isinstance(e, Exception):
                raise
        finally:
            self._handle.staged_seconds = time.perf_counter() - self._t0
            self._begun.set()
            self._handle._staged.set()

    def staged(self) -> Prepared:
        """The snapshot's buffers, as soon as they exist: each piece's ``ready`` waits for its copy."""
        self._begun.wait()
        if self._snap is None:
            self._handle._staged.wait()
            raise self._handle._stage_error
        return self._snap


def _start(handle: AsyncSave, snap: _Snapshot, stage: str, *, save: Callable[[], Manifest],
           on_commit: Callable[[Manifest], None] | None, t0: float) -> None:
    """Start the copy and the writer thread: ``stage="call"`` copies here (the writer starts during
    the copy only when it is DMA: CPU copies on the caller's thread would share the cores and the
    GIL with it and block the caller longer); ``"background"`` copies on a thread of its own."""
    # Not daemons: the interpreter waits for an in-flight save before it exits.
    handle._thread = threading.Thread(target=handle._run, args=(save, on_commit, t0), name="shardfmt-async-save",
                                      daemon=False)
    if stage == "background":
        handle._thread.start()
        threading.Thread(target=snap.run, name="shardfmt-async-stage", daemon=False).start()
        return
    try:
        snap.run(on_begun=handle._thread.start)
    except BaseException:  # e.g. KeyboardInterrupt during the copy
        if handle._thread.ident is None:  # no writer: this save is over (exit must not wait for it)
            handle._error = handle._stage_error
            handle.total_seconds = time.perf_counter() - t0
            handle._done.set()
        raise
    if handle._thread.ident is None:  # not started during the copy
        handle._thread.start()


__all__ = ["async_save", "AsyncSave", "DefaultStagers", "Stager", "StagedCopy", "default_stager"]
