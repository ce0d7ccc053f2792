"""The training-loop API: whole training state in, whole training state out, on any topology.

``Checkpointer(root).save(step, state)`` writes ``root/step_XXXXXXXXX``: model and
optimizer state as ``shardfmt.get_state_dict`` makes it (optimizer state keyed by parameter
FQN, so it reshards like the weights; parameters without state save none),
every other entry's ``state_dict()`` (scheduler, GradScaler, ResumableSampler, user
objects), each rank's RNG states, and metadata for compatibility checks (``entries``). Retention
runs only after the new checkpoint is committed (``prune``).

``restore(state)`` (``restore``: the numbered protocol)::

    1) rank 0 checks the root (spec/ROOTS.md section 1: a checkpoint given as the root, or a root
       missing with its parent, is an error; a root missing under an existing parent is a first
       run), lists the committed checkpoints, newest first, and broadcasts its choice
    2) every rank loads its slices, verifying every byte it reads
    3) the ranks agree (all-gather): if any rank failed, rank 0 quarantines the checkpoint
       (``step_X.corrupt-<id>``), everyone warns naming the file and cause, and all fall
       back together to the next one
    4) only then is non-tensor state applied (optimizer, scheduler, sampler, RNG)

When checkpoints exist but none is valid, restore raises unless ``allow_fresh_start``. A
checkpoint of a newer format version (a newer release's) is never quarantined: when it is newer
than every checkpoint restore can read, restore raises FormatVersionError rather than resume an
older step; an older one is passed over and left as it is.

Tiering: with ``archive=<url>`` rank 0 copies a committed checkpoint there in the background
whenever ⌊step / archive_every⌋ exceeds that of the last one archived (``archiving``; the copy is
``archive.py``'s: streamed, verified by hashes there, then committed there). Failed copies are
retried with backoff and reported as warnings (and in ``archive_errors``); they never block or
fail training. When no checkpoint under ``root`` is valid (the disk died), ``restore`` falls back
to the archive. ``wait()`` blocks until every background save and archive copy has finished.

The knobs and their defaults live in ``options.CheckpointerOptions``; this class orchestrates.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from shardfmt.api import save
from shardfmt.commit.names import parse_step_dir, step_dir_name
from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import CheckpointNotFoundError, StateDictError, StorageError
from shardfmt.io.registry import get_storage
from shardfmt.io.store import io_stats
from shardfmt.loading.phases import PhaseClock
from shardfmt.saving.async_save import async_save, at_exit
from shardfmt.saving.options import SaveOptions
from shardfmt.training.archiving import Archiver
from shardfmt.training.drill import die, drill_archive, drill_root, kill_due
from shardfmt.training.entries import data_identity, for_save, materialize
from shardfmt.training.interval import (
    RESTORE_PHASES,
    Interval,
    RestoreCost,
    SaveCost,
    Stats,
    steps_for,
    suggest,
)
from shardfmt.training.local_tier import LocalTier
from shardfmt.training.midstep import GradWatch, mid_step_message, pending_grads
from shardfmt.training.options import CheckpointerOptions
from shardfmt.training.prune import prune
from shardfmt.training.ranks import Ranks
from shardfmt.training.restore import (
    FAILURES,
    Tier,
    check_root,
    choose,
    only_step,
    raise_root_error,
    restore_first_valid,
    roll_back_newer,
)
from shardfmt.training.roots import (
    CheckpointInfo,
    collect_garbage,
    list_steps,
    newest_committed,
    set_aside_in_place,
)
from shardfmt.training.saves import PendingSaves

__all__ = ["Checkpointer", "CheckpointerOptions"]

log = logging.getLogger("shardfmt")
MAX_KEPT = 100  # saves, restores and step times a Checkpointer keeps for its statistics


class Checkpointer:
    """Save and restore whole training states under ``root`` (a directory or fsspec URL).

    Knobs are given as ``options`` (a ``CheckpointerOptions``, where their defaults live) and/or
    as keywords that set its fields: ``keep_last``, ``keep_every``, ``config``,
    ``allow_fresh_start``, ``storage_options``, ``process_group``, ``timeout``, ``lease_seconds``,
    ``mesh``, ``incremental``, ``full_every``, ``every``, ``mtbf``, ``restart_cost``,
    ``data_fingerprint``, ``save_grads``, ``archive`` (a URL), ``archive_every``,
    ``archive_storage_options``, ``archive_attempts``, ``archive_backoff`` (``options.KEYWORDS``
    maps them to the fields).
    """

    def __init__(self, root: str, *, options: CheckpointerOptions | None = None, **keywords: Any) -> None:
        opts = (options or CheckpointerOptions()).with_keywords(**keywords)
        if opts.archive.url and drill_archive(opts.archive.url) != opts.archive.url:  # ``shardfmt drill``
            opts = dataclasses.replace(opts, archive=dataclasses.replace(opts.archive, url=drill_archive(opts.archive.url),
                                                                         storage_options=None))
        self.options = opts
        self.storage_options = opts.effective_storage_options
        self.storage, self.root = get_storage(drill_root(root), self.storage_options)  # ``shardfmt drill``
        self.lease_seconds = self.storage.lease_seconds
        self._ranks = Ranks(opts.process_group, opts.timeout)
        self._tier = Tier(name="root", storage=self.storage, root=self.root, storage_options=self.storage_options)
        self._archive_tier: Tier | None = None
        self._archiver: Archiver | None = None
        if opts.archive.url:
            self._archive_tier = _archive_tier(opts, self._tier)
            self._archiver = Archiver(self.storage, self._archive_tier.storage, self._archive_tier.root, opts.archive)
        self._local: LocalTier | None = None
        self._aside: set[int] | None = None  # with local=: steps an object store's root holds set aside in place
        if opts.local.url:
            self._local = LocalTier(opts.local, self.storage, self.root, self._ranks, opts.archive,
                                    storage_options=self.storage_options)
        self._root_checked = False  # the root rules (spec/ROOTS.md section 1) hold: checked at restore or the first save
        self._saves = PendingSaves()
        self._chain = _Chain()
        self._warned_mid_step = False
        self._grad_watch = GradWatch()  # optimizer steps: which gradients were applied (``midstep``)
        self._saves_asked = 0
        self._costs: list[SaveCost] = []
        self._restores: list[RestoreCost] = []
        self._step_times: list[float] = []  # seconds between maybe_save calls (every="auto")
        self._last_call: float | None = None
        self._next_due: int | None = None
        self.restored_step: int | None = None  # what the last restore resumed from (loggers rewind to it)
        self.restored_tier: str | None = None  # where its copy was: "local", "root" or "archive"
        self.restored_metadata: Any = None  # and the metadata its save was given (a micro-step counter, ...)
        ref = weakref.ref(self)
        at_exit(lambda: ref() is not None and ref()._wait_quietly())

    @property
    def archive_errors(self) -> list[str]:
        """Failed archive copies, one message each (they never fail training)."""
        return self._archiver.errors if self._archiver is not None else []

    @property
    def replication_errors(self) -> list[str]:
        """Failed copies of this node's parts to the root (``local=``; they never fail training)."""
        return self._local.errors if self._local is not None else []

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any], *, metadata: Any = None, async_: bool = False,
             policy: str = "wait", stage: str = "call"):
        """Save ``state`` as ``root/step_<step>``; apply retention once it is committed.

        Returns the checkpoint's path. With ``async_=True`` the call returns an ``AsyncSave``
        handle once the state is snapshotted into this Checkpointer's reused host buffers;
        writing, commit and retention run in the background (see ``shardfmt.saving.async_save``
        for ``policy`` and ``stage``). ``latest()`` names the new step only once committed;
        ``wait()`` blocks until every background save has finished.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateDictError(f"step must be an int >= 0, got {step!r}")
        self._saves.warn_failed()
        self._saves_asked += 1
        if kill_due(self._saves_asked, self._ranks.rank(), self._ranks.world()):  # ``shardfmt drill``'s crash:
            self._saves.wait()  # after the earlier saves committed (async ones too), before this one
            die(self._saves_asked, self._ranks.rank())
        self._warn_mid_step(state)
        sd, meta = for_save(state, config=self.options.config, user_metadata=metadata, ranks=self._ranks,
                            data_fingerprint=self.options.data_fingerprint, grads=self.options.save_grads)
        st = self.stats  # this run's saves before this one (this one's own end is not known yet)
        if st.saves:
            last = st.saves[-1]
            meta["save_costs"] = {"saves": len(st.saves), "blocked_s": st.blocked, "total_s": st.total,
                                  "last": {"step": last.step, "blocked_s": last.blocked, "total_s": last.total,
                                           "bytes": last.bytes}}
        path = self._step_dir(step) if self._local is None else self._local_step(step)
        url = self.storage.url(path) if self._local is None else path  # a part: on this node's own disk
        opts = self.options
        base = self._chain.base(path, opts)
        t0, io0 = time.perf_counter(), io_stats()["bytes_written"]
        common = dict(step=step, metadata=meta, storage_options=self.storage_options,
                      process_group=opts.process_group, timeout=opts.timeout, mesh=opts.mesh,
                      base=None if base is None else self.storage.url(base))
        replicate = False
        if self._local is not None:  # each node's part on its own disk; copied to the root behind the training
            self._saves.wait()  # an earlier async save commits (and queues its copy) before the ranks decide
            replicate = self._local.before_save(step)
            common["options"] = SaveOptions(node_part=self._local.part(), overwrite=True)
        if async_:
            held: list = []  # the handle, once async_save returns (the commit comes after)

            def committed(manifest) -> None:
                self._measured(step, held[0].blocked_seconds if held else 0.0, t0, io0)
                self._after_commit(manifest.step, replicate)
            handle = async_save(sd, url, stager=self._saves.stager(), policy=policy, stage=stage,
                                on_commit=committed, **common)
            held.append(handle)
            if not handle.skipped:
                self._chain.saved(path, base)
            self._saves.add(handle)
            return handle
        self._saves.wait()
        try:
            save(sd, url, **common)
        except BaseException:
            self._chain.reset()
            raise
        self._measured(step, None, t0, io0)
        self._chain.saved(path, base)
        self._after_commit(step, replicate)
        return path

    def _measured(self, step: int, blocked: float | None, t0: float, io0: int) -> None:
        """Keep (and log) what the save of ``step`` cost; ``blocked`` None: a sync save (all of it)."""
        total = time.perf_counter() - t0
        cost = SaveCost(step=step, blocked=total if blocked is None else blocked, total=total,
                        bytes=io_stats()["bytes_written"] - io0)
        self._costs = (self._costs + [cost])[-MAX_KEPT:]
        log.info("shardfmt: step %d saved: the loop waited %.3f s, %.3f s to the commit, %d bytes written here",
                 step, cost.blocked, cost.total, cost.bytes)

    @property
    def stats(self) -> Stats:
        """What this Checkpointer's saves (the last 100) and restores cost, as this rank measured them."""
        return Stats(saves=tuple(self._costs), restores=tuple(self._restores))

    def suggest_interval(self, mtbf: float | None = None, *, restart: float | None = None,
                         formula: str = "daly") -> Interval:
        """The interval between saves, in seconds of training, that loses the least time to
        checkpoints and failures (``interval``: Young's sqrt(2 C M), Daly's refinement by
        default): ``C`` the measured median seconds a save blocks the loop, ``M`` = ``mtbf``
        (default: the options'), ``R`` = ``restart`` (default: the options' ``restart_cost``,
        else the measured restore time), never under one save's total time."""
        st = self.stats
        if st.blocked is None:
            raise StateDictError("suggest_interval: no save measured yet (save once first)")
        mtbf = mtbf if mtbf is not None else self.options.mtbf
        if mtbf is None:
            raise StateDictError("suggest_interval: pass mtbf= (the mean seconds between failures)")
        if restart is None:
            restart = self.options.restart_cost if self.options.restart_cost is not None else (st.restore or 0.0)
        return suggest(cost=st.blocked, mtbf=mtbf, restart=restart, total=st.total, formula=formula)

    def maybe_save(self, step: int, state: Mapping[str, Any], **kwargs: Any):
        """Save when ``every`` says so (the options'): an int, every that many steps; "auto", at
        the interval ``suggest_interval`` gives, counted in steps at the measured step time
        (rank 0's, told to every rank at each save: every rank decides alike). Returns what
        ``save`` returns, or None when no save is due. Call it once per step, on every rank."""
        every = self.options.every
        if every is None:
            raise StateDictError("maybe_save needs Checkpointer(every=...) (an int of steps, or 'auto')")
        now = time.perf_counter()
        if self._last_call is not None:
            self._step_times = (self._step_times + [now - self._last_call])[-MAX_KEPT:]
        self._last_call = now
        due = step % every == 0 if every != "auto" else (self._next_due is None or step >= self._next_due)
        if not due:
            return None
        out = self.save(step, state, **kwargs)
        if every == "auto":
            n = None
            if self._ranks.rank() == 0 and self.stats.saves:
                n = steps_for(self.suggest_interval().seconds, self._step_times)
            self._next_due = step + int(self._ranks.broadcast(n) or 1)
        self._last_call = time.perf_counter()  # the save's own time is not a step's
        return out

    def _warn_mid_step(self, state: Mapping[str, Any]) -> None:
        """Warn once if a model holds pending (non-zero) gradients: they are not saved (``midstep``)."""
        self._grad_watch.watch(state)
        if self._warned_mid_step or self.options.save_grads:  # saved: nothing to lose
            return
        try:
            names = pending_grads(state, self._grad_watch)
        except Exception:  # noqa: BLE001 - a diagnostic: it never fails a save (or leaves one rank behind)
            return
        if names:
            self._warned_mid_step = True
            warnings.warn(mid_step_message(names), stacklevel=3)

    def _step_dir(self, step: int) -> str:
        """Return the path of ``step``'s checkpoint, with the root checked and made, and a
        quarantined checkpoint of that step out of the way."""
        path = self.storage.join(self.root, step_dir_name(step))
        if not self._root_checked:
            self._check_root()
        self.storage.makedirs(self.root)
        url = self.storage.url(path)
        strategy = commit_strategy(self.storage)
        if self._ranks.rank() == 0 and (strategy.marked_quarantined(path) or strategy.marked_rolled_back(path)):
            # object stores set aside in place (no rename): a new save of the step replaces it
            what = "quarantined" if strategy.marked_quarantined(path) else "rolled-back"
            warnings.warn(f"{url}: replacing the {what} checkpoint of step {step}", stacklevel=3)
            self.storage.remove_tree(path)
        return path

    def _local_step(self, step: int) -> str:
        """``step``'s part on this rank's node. Rank 0 applies the root rules once, and takes a
        checkpoint of ``step`` that an object store's root holds set aside in place out of the
        copy's way (the root is listed once, at the first save and after a restore: no request
        to the root in a save's path otherwise)."""
        if not self._root_checked:
            self._check_root()
        if self._ranks.rank() == 0:
            if self._aside is None:
                self._aside = set_aside_in_place(self.storage, self.root)
            if step in self._aside:
                try:
                    self._step_dir(step)
                except FAILURES as e:  # the other ranks are on their way into the save: warn; the copy reports it
                    warnings.warn(f"{self.storage.url(self.root)}: could not clear step {step}'s set-aside "
                                  f"checkpoint for its copy: {e}", stacklevel=3)
                self._aside.discard(step)
        return self._local.path(step)

    def _after_commit(self, step: int, replicate: bool = False) -> None:
        if self._local is not None:  # the root's upkeep follows rank 0's node's copy, behind the training
            self._local.after_save(step, replicate, then=self._keep_root if self._ranks.rank() == 0 else None)
            return
        if self._ranks.rank() == 0:
            self._keep_root(step)

    def _keep_root(self, step: int) -> None:
        """Rank 0, after ``step`` reached the root: archive, retention, garbage collection there."""
        try:
            if self._local is not None and not self.storage.exists(self.root):
                return  # an object store's root before the first copy there committed: nothing to keep or collect
            if self._archiver is not None:
                self._schedule_archive(step)
            prune(self.storage, self.root, self.options.retention,
                  busy=self._archiver.busy if self._archiver is not None else _never, lease_seconds=self.lease_seconds)
            self.collect_garbage()
        except FAILURES as e:  # the checkpoint is committed; a failed clean-up must not fail it
            warnings.warn(f"{self.root}: retention after step {step} failed: {e}", stacklevel=3)

    def _schedule_archive(self, step: int) -> None:
        """Queue the archive copy of ``step`` (with ``local=``: of the root's newest committed
        copy, the copies there being made behind the training)."""
        if self._local is None:
            self._archiver.schedule(step, self.storage.join(self.root, step_dir_name(step)))
            return
        newest = newest_committed(self.storage, self.root)
        if newest is not None:
            self._archiver.schedule(_step_of(newest), newest)

    def _check_root(self) -> str:
        """Apply the root rules (``restore.check_root``) and remember that they hold."""
        kind = check_root(self.storage, self.root, allow_fresh_start=self.options.allow_fresh_start,
                          rank=self._ranks.rank())
        self._root_checked = True
        return kind

    # ------------------------------------------------------------------ waiting and closing
    def wait(self) -> None:
        """Block until every background save and archive copy has finished.

        Raises the first background save's error; archive failures are in ``archive_errors``.
        """
        try:
            self._saves.wait()
        finally:
            if self._local is not None:
                self._local.wait()
            if self._archiver is not None:
                self._archiver.wait()

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - at interpreter exit: the error was raised or warned already
            pass

    def close(self) -> None:
        """Wait for background saves and archive copies, and drop the staging buffers."""
        try:
            self.wait()
        finally:
            self._saves.release()
            if self._local is not None:
                self._local.close()
            if self._archiver is not None:
                self._archiver.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ discovery
    def collect_garbage(self, *, now: float | None = None) -> list[str]:
        """Remove what dead saves left (their lease expired); never a live save's.

        That is staging dirs (``.tmp-``) on local disk, and on object stores uncommitted
        ``step_*`` prefixes and multipart uploads under root that were never completed.
        """
        return collect_garbage(self.storage, self.root, lease_seconds=self.lease_seconds, now=now)

    def list(self) -> list[CheckpointInfo]:
        """Every ``step_*`` under root, oldest first, with its status (quick checks only)."""
        return list_steps(self.storage, self.root)

    def latest(self) -> str | None:
        """The newest committed checkpoint (never an in-flight save)."""
        return newest_committed(self.storage, self.root)

    # ------------------------------------------------------------------ restore
    def restore(self, state: Mapping[str, Any], *, step: int | None = None,
                allow_mismatch: bool = False) -> int | None:
        """Restore the newest valid checkpoint into ``state``; return its step (None: none).

        ``step=N`` rolls back: restore exactly step N (from the root, else its archive copy; an
        error if there is none or it is unusable, never an older one), then set aside every
        later checkpoint, with a warning (renamed ``step_X.rolledback-<id>``; marked
        ``ROLLED_BACK`` in place on object stores): ``latest()``, ``list()``, retention, the
        archive and later restores never pick the abandoned future, and saving its steps again
        works (spec/ROOTS.md section 1)."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise StateDictError(f"step must be an int >= 0 or None, got {step!r}")
        t0 = time.perf_counter()
        if self._local is not None:
            self._saves.wait()  # an async save's commit queues its copy: before the ranks ask who copies
            self._local.wait_all()  # every rank, together: no rank sits in a collective while a leader copies
        self.wait()
        self._chain.reset()  # a restore starts a run: its first save is full
        self._grad_watch.watch(state)
        self._next_due, self._last_call = None, None  # every="auto": measured again from here
        materialize(state)
        ranks = self._ranks
        clock = PhaseClock()
        with clock("discover"):
            local = self._local.candidates() if self._local is not None else []  # every rank: what its node holds
            choice = None
            if ranks.rank() == 0:
                choice = choose(self._check_root, self._tier, self._archive_tier, local=local)
                if step is not None:
                    choice = only_step(choice, step, self._tier)
            choice = ranks.broadcast(choice)
        raise_root_error(choice)  # not a root, or one that cannot be listed (no access): not "no checkpoints"
        self._root_checked = True
        try:
            restored = restore_first_valid(state, choice, root=self._tier, archive=self._archive_tier,
                                           local=self._local_tier(), ranks=ranks,
                                           config=self.options.config,
                                           data=data_identity(state, self.options.data_fingerprint),
                                           allow_fresh_start=self.options.allow_fresh_start and step is None,
                                           allow_mismatch=allow_mismatch, grads=self.options.save_grads, clock=clock)
        except CheckpointNotFoundError as e:
            if step is None:
                raise
            raise CheckpointNotFoundError(f"cannot roll back to step {step}: no copy of it loads (nothing was set "
                                          f"aside): {e}") from None
        if step is not None:
            self._set_aside_after(step)
        got = restored.step if restored is not None else None
        if self._local is not None:
            self._local.forget_after(got)
            self._aside = None  # the restore may have set checkpoints of the root aside: listed again
        self.restored_step = got
        self.restored_tier = restored.tier if restored is not None else None
        self.restored_metadata = restored.metadata if restored is not None else None
        if got is not None:
            cost = RestoreCost(step=got, seconds=time.perf_counter() - t0,
                               phases={p: clock.seconds.get(p, 0.0) for p in RESTORE_PHASES})
            self._restores = (self._restores + [cost])[-MAX_KEPT:]
            log.info("shardfmt: restored step %d (the %s copy) in %.3f s (%s)", got, self.restored_tier, cost.seconds,
                     ", ".join(f"{p} {v:.3f} s" for p, v in cost.phases.items()))
        return got

    def _set_aside_after(self, step: int) -> None:
        """A rollback loaded ``step``: rank 0 sets every later checkpoint aside (the archive's first:
        a failure part-way leaves no root newer than what an archive would bring back); every rank
        learns the outcome, and all raise the same error if it failed."""
        ranks = self._ranks
        outcome = None
        if ranks.rank() == 0:
            tiers = ([self._archive_tier] if self._archive_tier is not None else []) + [self._tier]
            done: list[str] = []
            try:
                roll_back_newer(tiers, step, done)
                outcome = {"aside": done}
            except FAILURES as e:
                outcome = {"aside": done, "error": f"{type(e).__name__}: {e}"}
            if self._archiver is not None:
                self._archiver.forget()  # the abandoned steps' archive buckets are free again
        outcome = ranks.broadcast(outcome)
        aside = outcome["aside"]
        if "error" in outcome:
            raise StorageError(f"rolled back to step {step} (the state holds it), but setting the later checkpoints "
                               f"aside failed: {outcome['error']}; set aside so far: {aside or 'none'}. Retry "
                               f"restore(step={step}) before saving, or a later restore may pick them")
        if aside and ranks.rank() == 0:
            warnings.warn(f"rolled back to step {step}: set aside (not deleted) the {len(aside)} later "
                          f"checkpoint(s) {', '.join(aside[:4])}{' ...' if len(aside) > 4 else ''}", stacklevel=3)


    def _local_tier(self) -> Tier | None:
        if self._local is None:
            return None
        return Tier(name="local", storage=self._local.storage, root=self._local.root, storage_options=None,
                    reader=self._local.reader)


def _archive_tier(opts: CheckpointerOptions, root: Tier) -> Tier:
    """Return the archive's tier; refuse an archive that is the root itself."""
    policy = opts.archive
    storage, path = get_storage(policy.url, policy.storage_options)
    if storage.url(path).rstrip("/") == root.storage.url(root.root).rstrip("/"):
        raise ValueError(f"Checkpointer: archive= {policy.url!r} is the root itself: it would be no second copy")
    return Tier(name="archive", storage=storage, root=path, storage_options=policy.storage_options)


def _never(path: str) -> bool:
    return False


def _step_of(path: str) -> int:
    return parse_step_dir(path.rstrip("/").rpartition("/")[2]) or 0


class _Chain:
    """Which checkpoint an incremental save takes unchanged shards from: this Checkpointer's
    previous save (the same on every rank: every rank makes the same calls), unless it was
    full ``full_every - 1`` saves ago. The first save of a run (and after a restore) is full; so
    is the one after a failed save, and one whose step is not above the previous save's (a
    base is always an older step: retention relies on it). A base that turns out unusable
    makes a full save (``saving.base``)."""

    def __init__(self) -> None:
        self._last: str | None = None  # the previous save's path
        self._since_full = 0  # incremental saves since the last full one

    def base(self, path: str, opts: CheckpointerOptions) -> str | None:
        if not opts.incremental or self._last is None or self._since_full + 1 >= opts.full_every:
            return None
        if _step_of(self._last) >= _step_of(path):  # bases are older: retention relies on it
            return None
        return self._last

    def saved(self, path: str, base: str | None) -> None:
        self._last, self._since_full = path, 0 if base is None else self._since_full + 1

    def reset(self) -> None:
        self._last, self._since_full = None, 0
