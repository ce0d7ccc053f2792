"""Restore: choose the checkpoint, load it on every rank, fall back together, quarantine the bad one.

The Checkpointer calls, in this order::

    1) rank 0: ``choose(probe, root, archive)`` checks the root (``check_root``: spec/ROOTS.md
       section 1), quarantines the committed-then-torn checkpoints it lists and returns the
       candidates, newest step first across the root and the archive; the Checkpointer
       broadcasts that choice, and every rank raises ``root_error`` from it if the root is unusable
    2) every rank: ``restore_first_valid`` loads its slices of the first candidate, verifying every
       byte it reads
    3) the ranks agree (all-gather): a failure that is not the checkpoint's (a storage error, the
       caller's state not fitting, a newer format version) raises on every rank and quarantines
       nothing; otherwise rank 0 quarantines the root's copy, every rank warns naming the file and
       cause, and all fall back together to the next candidate
    4) only then is non-tensor state applied (``entries.apply``: optimizer, scheduler, sampler, RNG)

Trade-off: a newer format version is never quarantined nor passed over when it is the newest
checkpoint: resuming an older step would throw away progress, so restore raises instead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from shardfmt.api import load, release_cached, skip_load
from shardfmt.commit.names import quarantine_dir_name, rolled_back_dir_name
from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import (
    CheckpointNotFoundError,
    CompatibilityError,
    FormatVersionError,
    IntegrityError,
    ShardfmtError,
    StateDictError,
    StorageError,
)
from shardfmt.io.store import Storage
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.phases import PhaseClock
from shardfmt.loading.reader import open_checkpoint
from shardfmt.training.compat import check_compat
from shardfmt.training.entries import apply, for_restore, optimizer_signature, with_grad_slots
from shardfmt.training.ranks import Ranks, job_warning
from shardfmt.training.roots import (
    CheckpointInfo,
    checkpoint_status,
    list_steps,
    probe_root,
    root_parent,
    step_paths,
)
from shardfmt.training.sanity import check_values

FAILURES = (ShardfmtError, OSError)
_TIER_ORDER = {"local": 0, "root": 1, "archive": 2}
_ROOT_ERRORS = {"CheckpointNotFoundError": CheckpointNotFoundError, "StorageError": StorageError}
log = logging.getLogger("shardfmt")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tier:
    """A place checkpoints are restored from: ``name`` is "local", "root" or "archive";
    ``reader(path)``, where given, is the storage a checkpoint at ``path`` is read through (the
    node-local tier's: ``local_tier.LocalTier.reader``)."""

    name: str
    storage: Storage
    root: str
    storage_options: dict | None
    reader: Callable[[str], Storage] | None = None


def check_root(storage: Storage, root: str, *, allow_fresh_start: bool, rank: int) -> str:
    """Apply the root rules of spec/ROOTS.md section 1 (at restore, or at the first save if there was
    none); return what the root is (``roots.probe_root``)."""
    kind = probe_root(storage, root)
    if kind == "orphan":
        url, parent = storage.url(root), root_parent(storage, root)
        msg = (f"{url}: the Checkpointer root does not exist, nor does "
               f"{'its bucket' if storage.remote else 'its parent'} {parent} (a misspelled path?)")
        if not allow_fresh_start:
            raise CheckpointNotFoundError(f"{msg}: create {parent}, or pass allow_fresh_start=True to "
                                          "start from scratch there")
        if rank == 0:
            warnings.warn(f"{msg}; starting from scratch there (allow_fresh_start=True)", stacklevel=5)
    return kind


def quarantine(storage: Storage, path: str, reason: str) -> None:
    """Set the checkpoint at ``path`` aside (renamed ``step_X.corrupt-<id>``, or marked in place on
    object stores) so that no restore tries it again; warn if that fails."""
    dest = quarantine_dir_name(path, uuid.uuid4().hex[:8])
    try:
        commit_strategy(storage).quarantine(path, dest, reason)
    except ShardfmtError as e:
        warnings.warn(f"could not quarantine {path}: {e}", stacklevel=5)


def choose(probe: Callable[[], str], root: Tier, archive: Tier | None, *, local: list[list] = ()) -> dict:
    """Rank 0's choice: checkpoints to try, newest step first across the node-local tier (``local``:
    the candidates every rank's node holds), the root and the archive (in that order within a
    step), each ``[step, tier, path, unsupported]``: ``unsupported``
    names the format versions of a checkpoint this reader cannot read (restore stops there). Or
    ``{"error", "type"}`` when the root is unusable. ``probe`` checks the root (``check_root``)."""
    try:
        kind = probe()
    except CheckpointNotFoundError as e:
        return {"error": str(e), "type": "CheckpointNotFoundError"}
    except FAILURES as e:  # the store cannot say (refused, unreachable): not a first run
        return {"error": str(e) if isinstance(e, ShardfmtError) else f"{root.storage.url(root.root)}: {e}",
                "type": "StorageError"}
    if kind == "new":
        log.info("%s: no Checkpointer root there yet (its %s exists): a first run", root.storage.url(root.root),
                 "bucket" if root.storage.remote else "parent")
    out, seen_any = [list(c) for c in local], bool(local)
    for tier in ([root] if kind == "root" else []) + ([archive] if archive is not None else []):
        try:
            infos = list_steps(tier.storage, tier.root)
        except FAILURES as e:
            # the root cannot be listed: without an archive, restore fails; with one, only a
            # missing root (the disk died) falls back to it; a failed listing would pick an
            # archived step older than what the root holds
            if tier.name == "root" and (archive is None or not isinstance(e, CheckpointNotFoundError)):
                return {"error": f"{tier.storage.url(tier.root)}: cannot list checkpoints: {e}", "type": "StorageError"}
            warnings.warn(f"{tier.storage.url(tier.root)}: cannot list checkpoints: {e}", stacklevel=3)
            continue
        seen_any = seen_any or bool(infos)
        if tier.name == "root":
            _quarantine_torn(tier.storage, infos)
        out += [[i.step, tier.name, i.path, i.reason if i.status == "unsupported" else None]
                for i in reversed(infos) if i.status in ("committed", "unsupported")]
    out.sort(key=lambda c: (-c[0], _TIER_ORDER[c[1]]))  # newest step first (an archived newer step beats
    return {"candidates": out, "any": seen_any}         # an older one of the root); the fastest copy first


def only_step(choice: dict, step: int, root: Tier) -> dict:
    """``choice`` narrowed to the copies of ``step`` (a rollback: ``restore(step=N)``); an error
    naming the steps there are when there is none. Never a fresh start: ``any`` stays true."""
    if "error" in choice:
        return choice
    mine = [c for c in choice["candidates"] if c[0] == step]
    if not mine:
        steps = sorted({c[0] for c in choice["candidates"]})
        have = ", ".join(map(str, steps[-8:])) + (f" ({len(steps)} in all)" if len(steps) > 8 else "") if steps \
            else "none"
        return {"error": f"{root.storage.url(root.root)}: no committed checkpoint of step {step} to roll back to "
                         f"(committed steps: {have})", "type": "CheckpointNotFoundError"}
    return {"candidates": mine, "any": True}


def roll_back_newer(tiers: list[Tier], step: int, done: list[str]) -> list[str]:
    """Rank 0, after a rollback to ``step`` loaded: set aside every checkpoint of a later step in
    each tier, in order (renamed ``step_X.rolledback-<id>``, or marked ``ROLLED_BACK`` in place
    on object stores), so that no lister picks the abandoned future; append each one's URL to
    ``done`` as it goes (what was set aside when a failure stops it) and return it."""
    tag = uuid.uuid4().hex[:8]
    for tier in tiers:
        strategy = commit_strategy(tier.storage)
        for s, path in step_paths(tier.storage, tier.root):
            if s <= step or checkpoint_status(tier.storage, path, markers_only=True)[0] != "committed":
                continue
            dest = rolled_back_dir_name(path, tag)
            strategy.roll_back(path, dest, f"set aside by a rollback to step {step}")
            done.append(tier.storage.url(path if strategy.in_place else dest))
    return done


def _quarantine_torn(storage: Storage, infos: list[CheckpointInfo]) -> None:
    for i in infos:
        if i.status == "corrupt":  # committed, then torn (a file missing or truncated, a bad manifest)
            warnings.warn(f"checkpoint {storage.url(i.path)} is unusable, quarantined: {i.reason}", stacklevel=4)
            quarantine(storage, i.path, i.reason)


def raise_root_error(choice: dict) -> None:
    """Raise the error of a ``choose`` result that says the root is unusable (not "no checkpoints")."""
    if "error" in choice:
        raise _ROOT_ERRORS[choice["type"]](choice["error"])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Attempt:
    """One rank's outcome of loading one candidate: ``error`` is what it tells the other ranks."""

    error: dict | None
    partial: bool = False  # the failed load wrote part of its data into the state
    sd: dict | None = None
    fresh_optims: set[str] = dataclasses.field(default_factory=set)
    manifest: Any = None
    report: Any = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """What a restore resumed from: the checkpoint's step, the metadata its save was given, and
    the tier its copy was on ("local", "root" or "archive")."""

    step: int
    metadata: Any = None
    tier: str = "root"


def restore_first_valid(state: Mapping[str, Any], choice: dict, *, root: Tier, archive: Tier | None,
                        ranks: Ranks, local: Tier | None = None, config: Any, allow_fresh_start: bool, allow_mismatch: bool,
                        data: Mapping[str, Any] | None = None, grads: bool = False,
                        clock: PhaseClock | None = None) -> Restored | None:
    """Restore the first candidate of ``choice`` every rank loads (``grads``: the models'
    gradients too, ``training.grads``); return what it resumed from (None: nothing). ``clock``
    gets the seconds of the phases ``open``, ``plan``, ``read``, ``verify`` and ``apply``
    (``interval.RestoreCost``).

    Steps 2) to 4) of the module docstring; every rank calls it with the same ``choice``.
    """
    clock = clock if clock is not None else PhaseClock()
    dirty = False  # this rank's state holds data of a checkpoint that was then given up
    for step, tier_name, path, unsupported in choice["candidates"]:
        tier = {"root": root, "archive": archive, "local": local}[tier_name]
        if tier_name == "local":
            path = tier.storage.join(tier.root, path)  # the step's part on this rank's own node
        url = tier.storage.url(path)
        if unsupported:  # a newer release's, newer than every checkpoint before it could be restored
            raise FormatVersionError(_newer_than_restorable(url, step, unsupported))
        attempt = _load(state, tier, path, ranks=ranks, config=config, allow_mismatch=allow_mismatch, data=data,
                        grads=grads, clock=clock)
        dirty = dirty or attempt.partial
        with clock("verify"):
            failing = [(r, e) for r, e in enumerate(ranks.all_gather(attempt.error)) if e]
        if failing:
            _raise_unless_the_checkpoints_fault(url, failing)
            dirty = dirty or attempt.error is None  # loaded here in full, failed on another rank
            _give_up(tier, path, failing, ranks)
            continue
        if not allow_mismatch:  # every rank, once all have loaded
            with clock("verify"):
                _check_values(url, attempt, ranks)
        with clock("read"):  # every rank has read what it shares with the others: out of the page cache
            release_cached(attempt.report.source, attempt.report.cached, storage_options=tier.storage_options)
        if tier.name == "archive":
            job_warning(rank=ranks.rank(), message=f"{root.storage.url(root.root)}: no usable copy of step {step} there; restored it from "
                          f"the archive {url}", stacklevel=3)
        with clock("apply"):
            user = apply(state, attempt.sd, attempt.report, attempt.manifest, fresh_optims=attempt.fresh_optims,
                         dirty=dirty, world=ranks.world(), rank=ranks.rank(), grads=grads)
        return Restored(step=step, metadata=user, tier=tier.name)
    if choice["any"] and any(ranks.all_gather(dirty)):
        raise CheckpointNotFoundError(
            f"{root.storage.url(root.root)}: checkpoints exist but none is valid, and the failed attempts "
            "wrote part of their data into the state given to restore: it is not a fresh start either. "
            "Build the model and optimizer again (the unusable checkpoints under the root are "
            "quarantined: a restarted job starts fresh)")
    if choice["any"] and not allow_fresh_start:
        raise CheckpointNotFoundError(f"{root.storage.url(root.root)}: checkpoints exist but none is valid "
                                      "(pass allow_fresh_start=True to train from scratch)")
    return None


def _check_values(url: str, attempt: _Attempt, ranks: Ranks) -> None:
    """Fail the restore, on every rank, when the loaded values do not match the statistics saved
    with them (``training.sanity``)."""
    check = check_values(attempt.report.value_stats, attempt.manifest, ranks)
    if check.bad:
        raise IntegrityError(f"restoring {url}: the loaded values do not match the statistics saved with them "
                             f"(a wrong cast or a wrong target; nothing was quarantined; allow_mismatch=True "
                             f"skips this check): " + "; ".join(check.bad[:3]))
    if check.checked or check.unchecked:
        log.info("%s: the loaded values of %d tensor(s) match their saved statistics; %d not checked%s", url,
                 len(check.checked), len(check.unchecked),
                 f" (e.g. {', '.join(check.unchecked[:3])}: not loaded, or loaded as slices whose copies the "
                 "ranks cannot tell apart)" if check.unchecked else "")


def _load(state: Mapping[str, Any], tier: Tier, path: str, *, ranks: Ranks, config: Any,
          allow_mismatch: bool, clock: PhaseClock, data: Mapping[str, Any] | None = None,
          grads: bool = False) -> _Attempt:
    """Load this rank's slices of the checkpoint at ``path`` into fresh state dicts of ``state``."""
    with clock("open"):
        sd, signature, fresh_optims = for_restore(state)
    storage = tier.storage
    try:
        try:
            with clock("open"):
                storage = tier.reader(path) if tier.reader is not None else tier.storage
                manifest = open_checkpoint(path, storage=storage, whole=False).manifest  # the root: no rank reads them all
                check_compat(path, manifest, config=config, signature=signature,
                             optimizers=optimizer_signature(state, sd), allow_mismatch=allow_mismatch, data=data)
                if grads:
                    with_grad_slots(sd, state, manifest)
        except BaseException:  # the other ranks may be loading: join them, as a failed rank
            skip_load(storage.url(path), process_group=ranks.process_group, storage_options=tier.storage_options,
                      storage=storage if tier.reader is not None else None)
            raise
        t0 = time.perf_counter()
        try:
            report = load(sd, storage.url(path), strict=False, per_rank="skip", process_group=ranks.process_group,
                          storage_options=tier.storage_options, options=LoadOptions(value_stats=not allow_mismatch),
                          storage=storage if tier.reader is not None else None)
        except BaseException:
            clock.add("read", time.perf_counter() - t0)  # a failed load: its time, all counted as reading
            raise
        for name, seconds in report.phases.items():
            clock.add(name, seconds)
    except CompatibilityError:
        raise
    except FAILURES as e:
        # A storage failure (network, throttling, permission) says nothing about the
        # checkpoint: nothing is quarantined and restore fails, to be retried.
        transient = isinstance(e, StorageError) or (isinstance(e, OSError) and not isinstance(e, ShardfmtError))
        # The caller's state does not fit the checkpoint (a shape, a dtype, a tuple, a config
        # that cannot be encoded): the checkpoint is not at fault and is not quarantined.
        caller = isinstance(e, StateDictError)
        err = {"error": f"{type(e).__name__}: {e}", "transient": transient, "caller": caller,
               "version": isinstance(e, FormatVersionError)}  # rewritten by a newer release since listed
        return _Attempt(error=err, partial=getattr(e, "partial_load", False))
    except Exception as e:  # noqa: BLE001 - not the checkpoint's fault either: told to every rank, raised on all
        err = {"error": f"{type(e).__name__}: {e}", "transient": False, "caller": False, "version": False,
               "internal": True}
        return _Attempt(error=err, partial=True)
    return _Attempt(error=None, sd=sd, fresh_optims=fresh_optims, manifest=manifest, report=report)


def _raise_unless_the_checkpoints_fault(url: str, failing: list[tuple[int, dict]]) -> None:
    """Raise, on every rank, when a rank's failure is not the checkpoint's fault (nothing is
    quarantined). A node's own disk failing under a node-local copy is not a storage failure
    to retry (``io.nodepart.NodeDiskError``): a restart would meet the same disk."""
    def why() -> str:
        return "; ".join(f"rank {r}: {e['error']}" for r, e in failing[:4])

    if any(e.get("internal") for _, e in failing):
        raise ShardfmtError(f"restoring {url} failed on an unexpected error (nothing was quarantined): " + why())
    if any(e["version"] for _, e in failing):
        raise FormatVersionError(f"restoring {url} (nothing was quarantined): " + why())
    if any(e.get("caller") for _, e in failing):
        raise StateDictError(f"restoring {url}: the state given to restore does not fit the "
                             "checkpoint (nothing was quarantined): " + why())
    if any(e["transient"] for _, e in failing):
        raise StorageError(f"restoring {url} failed on storage access (nothing was "
                           "quarantined; retry): " + why())


def _give_up(tier: Tier, path: str, failing: list[tuple[int, dict]], ranks: Ranks) -> None:
    """Warn (the root: once for the job); rank 0 quarantines the root's copy before any rank moves on."""
    why = "; ".join(f"rank {r}: {e['error']}" for r, e in failing[:4])
    if tier.name == "local":  # each node names its own disk: every rank says it
        warnings.warn(f"the node-local copy {tier.storage.url(path)} cannot be restored here, trying the next copy "
                      f"(nothing was quarantined): {why}", stacklevel=4)
    else:
        job_warning(rank=ranks.rank(), message=f"checkpoint {tier.storage.url(path)} is unusable, falling back to the previous one: "
                      f"{why}", stacklevel=4)
    if ranks.rank() == 0 and tier.name == "root":
        quarantine(tier.storage, path, why)
    if ranks.distributed():
        ranks.all_gather(None)  # the quarantine is done before anyone moves on


def _newer_than_restorable(url: str, step: int, versions: str) -> str:
    """The error when the newest checkpoint restore meets is one of a format version it cannot read."""
    where = url.rstrip("/").rsplit("/", 1)[0]
    return (f"{url} (step {step}): {versions}. Every checkpoint this release can restore is older: resuming "
            "one would throw away the progress since; upgrade shardfmt to resume from it, or move it out of "
            f"{where} to resume from the newest older checkpoint (nothing was changed)")
