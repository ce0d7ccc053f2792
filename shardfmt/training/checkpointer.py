"""The training-loop API: whole training state in, whole training state out, on any topology.

``Checkpointer(root).save(step, state)`` writes ``root/step_XXXXXXXXX``: model and
optimizer state as ``shardfmt.get_state_dict`` makes it (optimizer state keyed by parameter
FQN, so it reshards like the weights; parameters without state save none),
every other entry's ``state_dict()`` (scheduler, GradScaler, ResumableSampler, user
objects), each rank's RNG states, and metadata for compatibility checks. Retention runs
only after the new checkpoint is committed.

``restore(state)``::

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
whenever ⌊step / archive_every⌋ exceeds that of the last one archived (``archive.py``: streamed,
verified by hashes there, then committed there). Failed copies are retried with backoff and
reported as warnings (and in ``archive_errors``); they never block or fail training. When no
checkpoint under ``root`` is valid (the disk died), ``restore`` falls back to the archive.
``wait()`` blocks until every background save and archive copy has finished.
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import warnings
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import orjson
import torch

from shardfmt.api import load, save
from shardfmt.commit.names import parse_step_dir, quarantine_dir_name, step_dir_name
from shardfmt.commit.protocol import commit_strategy, is_committed
from shardfmt.errors import (
    CheckpointNotFoundError,
    FormatVersionError,
    ShardfmtError,
    StateDictError,
    StorageError,
)
from shardfmt.format import hashing, jsonvalue
from shardfmt.io.registry import get_storage
from shardfmt.layout.state import IfSaved, PerRank
from shardfmt.loading.reader import open_checkpoint
from shardfmt.saving.async_save import Stager, async_save, at_exit
from shardfmt.saving.distributed import all_gather_bytes, broadcast_bytes, control_group
from shardfmt.training import rng
from shardfmt.training.archive import copy_checkpoint, copy_with_retries
from shardfmt.training.retention import to_delete
from shardfmt.training.roots import (
    CheckpointInfo,
    checkpoint_status,
    collect_garbage,
    list_steps,
    newest_committed,
    probe_root,
    root_parent,
    step_paths,
)
from shardfmt.training.train_state import optimizer_state_dict, set_optimizer_state

RNG_KEY = "_shardfmt_rng"
_FAILURES = (ShardfmtError, OSError)
_ROOT_ERRORS = {"CheckpointNotFoundError": CheckpointNotFoundError, "StorageError": StorageError}
log = logging.getLogger("shardfmt")


class CompatibilityError(StateDictError):
    """The checkpoint was written for a different model or config."""


def _is_module(v) -> bool:
    return isinstance(v, torch.nn.Module)


def _is_optimizer(v) -> bool:
    return isinstance(v, torch.optim.Optimizer)


def _config_hash(config: Any) -> str | None:
    if config is None:
        return None

    return hashing.digest_bytes(orjson.dumps(jsonvalue.encode(config, where="config"), option=orjson.OPT_SORT_KEYS))


def _optimizer_signature(state: Mapping[str, Any], sd: Mapping[str, Any]) -> dict:
    """Each optimizer's class and its parameter groups (sets of parameter names, in a stable order)."""
    return {name: {"class": f"{type(obj).__module__}.{type(obj).__qualname__}",
                   "groups": sorted(sorted(str(p) for p in g.get("params", []))
                                    for g in sd[name].get("param_groups", []))}
            for name, obj in state.items() if _is_optimizer(obj)}


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for configs whose typed JSON differs (dict order, 1000 vs 1000.0); False where
    comparing fails (arrays)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. numpy's ambiguous truth value: not provably equal
        return False


class Checkpointer:
    """Save and restore whole training states under ``root`` (a directory or fsspec URL)."""

    def __init__(self, root: str, *, keep_last: int = 3, keep_every: int | None = None,
                 config: Any = None, allow_fresh_start: bool = False, storage_options: dict | None = None,
                 process_group=None, timeout: _dt.timedelta | None = None,
                 lease_seconds: float | None = None, mesh: Mapping[str, int] | None = None,
                 archive: str | None = None, archive_every: int = 1,
                 archive_storage_options: dict | None = None, archive_attempts: int = 4,
                 archive_backoff: float = 2.0) -> None:
        for name, v, none_ok in (("keep_last", keep_last, False), ("keep_every", keep_every, True),
                                 ("archive_every", archive_every, False), ("archive_attempts", archive_attempts, False)):
            if not (v is None and none_ok) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Checkpointer: {name} must be an int >= 1{' or None' if none_ok else ''}, got {v!r}")
        if lease_seconds is not None:  # the saves' heartbeat and the collector agree on it
            storage_options = dict(storage_options or {}, lease_seconds=lease_seconds)
        self.storage, self.root = get_storage(root, storage_options)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.config = config
        self.allow_fresh_start = allow_fresh_start
        self.storage_options = storage_options
        self.process_group = process_group
        self.timeout = timeout
        self.lease_seconds = self.storage.lease_seconds
        self.mesh = mesh
        self._root_checked = False  # the root rules (spec/ROOTS.md section 1) hold: checked at restore or the first save
        self._stager = None  # async saves' staging buffers, created on the first one
        self._pending: list = []  # background saves not yet waited for (failed ones until wait() raises)
        self._warned: weakref.WeakSet = weakref.WeakSet()  # failed saves already warned about
        self.archive_storage, self.archive_root = (get_storage(archive, archive_storage_options)
                                                   if archive else (None, None))
        if isinstance(archive_backoff, bool) or not isinstance(archive_backoff, (int, float)) \
                or not 0 <= archive_backoff < float("inf"):
            raise ValueError(f"Checkpointer: archive_backoff must be a finite number >= 0, got {archive_backoff!r}")
        if archive and self.archive_storage.url(self.archive_root).rstrip("/") == self.storage.url(self.root).rstrip("/"):
            raise ValueError(f"Checkpointer: archive= {archive!r} is the root itself: it would be no second copy")
        self.archive_every = archive_every
        self.archive_storage_options = archive_storage_options
        self.archive_attempts = archive_attempts
        self.archive_backoff = archive_backoff
        self.archive_errors: list[str] = []
        self._archive_pool: ThreadPoolExecutor | None = None
        self._archive_jobs: list[Future] = []
        self._archiving: set[str] = set()  # local paths being copied: retention leaves them alone
        self._archive_lock = threading.Lock()
        self._last_archived_bucket: int | None = None
        ref = weakref.ref(self)
        at_exit(lambda: ref() is not None and ref()._wait_quietly())

    # ------------------------------------------------------------------ distributed helpers
    def _dist(self) -> bool:
        d = torch.distributed
        return d.is_available() and d.is_initialized() and d.get_world_size(self.process_group) > 1

    def _rank(self) -> int:
        return torch.distributed.get_rank(self.process_group) if self._dist() else 0

    def _world(self) -> int:
        return torch.distributed.get_world_size(self.process_group) if self._dist() else 1

    def _broadcast(self, obj: Any) -> Any:
        if not self._dist():
            return obj

        g = control_group(self.process_group, self.timeout)
        return orjson.loads(broadcast_bytes(orjson.dumps(obj) if self._rank() == 0 else None, 0, g))

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._dist():
            return [obj]

        g = control_group(self.process_group, self.timeout)
        return [orjson.loads(b) for b in all_gather_bytes(orjson.dumps(obj), g)]

    # ------------------------------------------------------------------ state <-> dicts
    def _state_dicts(self, state: Mapping[str, Any]) -> tuple[dict, dict, set[str]]:
        """Return (saveable dict, signature, names of optimizers that never stepped) for ``state``'s entries."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        models = {k: v for k, v in state.items() if _is_module(v)}
        out: dict[str, Any] = {}
        fresh_optims: set[str] = set()
        for name, obj in state.items():
            if name.startswith("_shardfmt"):
                raise StateDictError(f"state entry {name!r}: names starting with _shardfmt are reserved")
            if _is_module(obj):
                out[name] = get_model_state_dict(obj)
            elif _is_optimizer(obj):
                out[name] = optimizer_state_dict(_owner(obj, models, name), obj)  # made-up state: IfSaved
                if any(isinstance(v, IfSaved) for v in out[name]["state"].values()):
                    fresh_optims.add(name)
            elif hasattr(obj, "state_dict"):
                out[name] = obj.state_dict()
            else:
                raise StateDictError(f"state entry {name!r} ({type(obj).__name__}) has no state_dict()")
        signature = {name: {k: [str(v.dtype), list(v.shape)] for k, v in sd.items() if isinstance(v, torch.Tensor)}
                     for name, sd in out.items() if _is_module(state[name])}
        return out, signature, fresh_optims

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
        for h in self._pending:
            if h.done() and h.exception() is not None and h not in self._warned:
                self._warned.add(h)
                warnings.warn(f"the background save to {h.path} failed (wait() raises it): {h.exception()}",
                              stacklevel=2)
        sd, signature, fresh_optims = self._state_dicts(state)
        samplers = [v for v in state.values() if hasattr(v, "advance") and hasattr(v, "consumed")]
        if samplers and self._dist():
            seen = self._all_gather([int(s.consumed) for s in samplers])
            if any(x != seen[0] for x in seen):
                raise StateDictError(f"sampler cursors differ across ranks at save: {seen[:8]} "
                                     "(advance(n) must be called with the same n on every rank)")
        sd[RNG_KEY] = PerRank(rng.capture())
        meta = {"user": metadata, "unstepped": sorted(fresh_optims),
                "config": self.config, "config_hash": _config_hash(self.config),
                "signature": signature, "optimizers": _optimizer_signature(state, sd),
                "entries": sorted(state), "world_size": self._world()}
        path = self.storage.join(self.root, step_dir_name(step))
        if not self._root_checked:
            self._check_root()
        self.storage.makedirs(self.root)
        url = self.storage.url(path)
        if self._rank() == 0 and commit_strategy(self.storage).marked_quarantined(path):
            # object stores quarantine in place (no rename): a new save of the step replaces it
            warnings.warn(f"{url}: replacing the quarantined checkpoint of step {step}", stacklevel=2)
            self.storage.remove_tree(path)
        common = dict(step=step, metadata=meta, storage_options=self.storage_options,
                      process_group=self.process_group, timeout=self.timeout, mesh=self.mesh)
        if async_:
            if self._stager is None:
                self._stager = Stager()
            handle = async_save(sd, url, stager=self._stager, policy=policy, stage=stage,
                                on_commit=self._after_async_commit, **common)
            # a failed save is kept until wait() raises it
            self._pending = [h for h in self._pending if not h.done() or h.exception() is not None] + [handle]
            return handle
        self._wait_saves()
        save(sd, url, **common)
        self._after_commit(step)
        return path

    def _after_async_commit(self, manifest) -> None:
        self._after_commit(manifest.step)

    def _after_commit(self, step: int) -> None:
        if self._rank() != 0:
            return
        try:
            self._maybe_archive(step, self.storage.join(self.root, step_dir_name(step)))
            self._apply_retention()
        except _FAILURES as e:  # the checkpoint is committed; a failed clean-up must not fail it
            warnings.warn(f"{self.root}: retention after step {step} failed: {e}", stacklevel=3)

    # ------------------------------------------------------------------ archive tier
    def _archived_steps(self) -> list[int]:
        st, root = self.archive_storage, self.archive_root
        if not st.exists(root):
            return []
        return sorted(s for name in st.listdir(root) if (s := parse_step_dir(name)) is not None
                      and is_committed(st, st.join(root, name)))

    def _maybe_archive(self, step: int, path: str) -> None:
        """Queue a background copy of ``step`` when its ⌊step / archive_every⌋ is new."""
        if self.archive_storage is None:
            return
        with self._archive_lock:
            if self._last_archived_bucket is None:
                try:
                    done = self._archived_steps()
                except _FAILURES as e:
                    done = []
                    warnings.warn(f"{self.archive_root}: cannot list the archive: {e}", stacklevel=3)
                self._last_archived_bucket = max((s // self.archive_every for s in done), default=-1)
            bucket = step // self.archive_every
            if bucket <= self._last_archived_bucket:
                return
            self._last_archived_bucket = bucket
            self._archiving.add(path)
            if self._archive_pool is None:
                self._archive_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfmt-archive")
            self._archive_jobs.append(self._archive_pool.submit(self._archive_one, step, path))

    def _archive_one(self, step: int, path: str) -> None:
        dst = self.archive_storage.join(self.archive_root, step_dir_name(step))
        where = self.archive_storage.url(dst)

        def retry(i: int, e: BaseException) -> None:
            warnings.warn(f"archiving step {step} to {where} failed (attempt {i} of {self.archive_attempts}, "
                          f"retrying): {e}", stacklevel=2)

        try:  # a copy killed part-way (its lease expired) would block copying that checkpoint again;
            if not commit_strategy(self.archive_storage).in_place:  # in place: prepare() clears dst's dead leftover
                collect_garbage(self.archive_storage, self.archive_root)
        except _FAILURES as e:
            warnings.warn(f"{self.archive_storage.url(self.archive_root)}: collecting leftovers failed: {e}",
                          stacklevel=2)
        try:
            copy_with_retries(lambda: copy_checkpoint(self.storage, path, self.archive_storage, dst),
                              attempts=self.archive_attempts, backoff=self.archive_backoff, on_retry=retry)
        except Exception as e:  # noqa: BLE001 - never into training: reported instead
            msg = f"archiving step {step} to {where} failed: {type(e).__name__}: {e}"
            self.archive_errors.append(msg)
            warnings.warn(msg, stacklevel=2)
            with self._archive_lock:  # the bucket has no copy: the next save (re-listing the archive) tries again
                self._last_archived_bucket = None
        finally:
            with self._archive_lock:
                self._archiving.discard(path)

    def _wait_saves(self) -> None:
        pending, self._pending = self._pending, []
        errors = []
        for h in pending:
            try:
                h.wait()
            except _FAILURES as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def wait(self) -> None:
        """Block until every background save and archive copy has finished.

        Raises the first background save's error; archive failures are in ``archive_errors``.
        """
        try:
            self._wait_saves()
        finally:
            jobs, self._archive_jobs = self._archive_jobs, []
            for f in jobs:
                f.result()

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
            if self._stager is not None:
                self._stager.release()
            if self._archive_pool is not None:
                self._archive_pool.shutdown(wait=True)
                self._archive_pool = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _apply_retention(self) -> None:
        # The newest keep_last committed checkpoints are checked in full (a torn one does not
        # count); older ones by their markers alone, so a pass costs the same with 10 or 10,000
        # checkpoints kept (keep_every).
        committed: dict[int, str] = {}
        full: dict[int, str] = {}  # step -> its status, checked in full
        for step, path in reversed(step_paths(self.storage, self.root)):
            if len(committed) < self.keep_last:
                status = full[step] = checkpoint_status(self.storage, path)[0]
            else:
                status = checkpoint_status(self.storage, path, markers_only=True)[0]
            if status == "committed":
                committed[step] = path

        def status_of(s: int) -> str:
            if s not in full:
                full[s] = checkpoint_status(self.storage, committed[s])[0]
            return full[s]

        while True:
            # Checked in full (once) before they stay or go: the copy that stays for a bucket being
            # pruned must be readable, and a checkpoint of a format version this reader cannot read
            # (a newer release's) is neither counted nor removed (spec/ROOTS.md section 1).
            doomed = to_delete(list(committed), keep_last=self.keep_last, keep_every=self.keep_every)
            pruned = {s // self.keep_every for s in doomed} if self.keep_every else set()
            stays = [s for s in committed if s not in doomed and s // self.keep_every in pruned] if pruned else []
            drop = ([s for s in stays if status_of(s) != "committed"]  # torn: neither kept as the
                    + [s for s in doomed if status_of(s) == "unsupported"])  # bucket's copy nor removed
            if not drop:
                break
            for s in drop:
                del committed[s]
        for step in doomed:
            with self._archive_lock:
                if committed[step] in self._archiving:
                    continue  # being copied to the archive: removed by a later retention pass
            self.storage.remove_tree(committed[step])
        self.collect_garbage()

    def collect_garbage(self, *, now: float | None = None) -> list[str]:
        """Remove what dead saves left (their lease expired); never a live save's.

        That is staging dirs (``.tmp-``) on local disk, and on object stores uncommitted
        ``step_*`` prefixes and multipart uploads under root that were never completed.
        """
        return collect_garbage(self.storage, self.root, lease_seconds=self.lease_seconds, now=now)

    # ------------------------------------------------------------------ discovery
    def list(self) -> list[CheckpointInfo]:
        """Every ``step_*`` under root, oldest first, with its status (quick checks only)."""
        return list_steps(self.storage, self.root)

    def latest(self) -> str | None:
        """The newest committed checkpoint (never an in-flight save)."""
        return newest_committed(self.storage, self.root)

    def _quarantine(self, path: str, reason: str) -> None:
        import uuid

        dest = quarantine_dir_name(path, uuid.uuid4().hex[:8])
        try:
            commit_strategy(self.storage).quarantine(path, dest, reason)
        except ShardfmtError as e:
            warnings.warn(f"could not quarantine {path}: {e}", stacklevel=3)

    # ------------------------------------------------------------------ restore
    def restore(self, state: Mapping[str, Any], *, allow_mismatch: bool = False) -> int | None:
        """Restore the newest valid checkpoint into ``state``; return its step (None: none)."""
        self.wait()
        for obj in state.values():
            if _is_module(obj) and any(t.is_meta for t in list(obj.parameters()) + list(obj.buffers())):
                obj.to_empty(device="cpu")  # a model built on the meta device gets real storage to load into
        rank = self._rank()
        choice = self._broadcast(self._candidates() if rank == 0 else None)
        if "error" in choice:  # not a root, or one that cannot be listed (no access): not "no checkpoints"
            raise _ROOT_ERRORS[choice["type"]](choice["error"])
        self._root_checked = True
        dirty = False  # this rank's state holds data of a checkpoint that was then given up
        for step, tier, path, unsupported in choice["candidates"]:
            storage, opts = ((self.storage, self.storage_options) if tier == "root"
                             else (self.archive_storage, self.archive_storage_options))
            if unsupported:  # a newer release's, newer than every checkpoint before it could be restored
                raise FormatVersionError(_newer_than_restorable(storage.url(path), step, unsupported))
            sd, signature, fresh_optims = self._state_dicts(state)
            sd[RNG_KEY] = PerRank(None)
            err = None
            try:
                manifest = open_checkpoint(path, storage=storage).manifest
                self._check_compat(path, manifest, signature, _optimizer_signature(state, sd), allow_mismatch)
                report = load(sd, storage.url(path), strict=False, per_rank="skip",
                              process_group=self.process_group, storage_options=opts)
            except CompatibilityError:
                raise
            except _FAILURES as e:
                # A storage failure (network, throttling, permission) says nothing about the
                # checkpoint: nothing is quarantined and restore fails, to be retried.
                transient = isinstance(e, StorageError) or (isinstance(e, OSError) and not isinstance(e, ShardfmtError))
                # The caller's state does not fit the checkpoint (a shape, a dtype, a tuple, a config
                # that cannot be encoded): the checkpoint is not at fault and is not quarantined.
                caller = isinstance(e, StateDictError)
                err = {"error": f"{type(e).__name__}: {e}", "transient": transient, "caller": caller,
                       "version": isinstance(e, FormatVersionError)}  # rewritten by a newer release since listed
                dirty = dirty or getattr(e, "partial_load", False)
            errors = self._all_gather(err)
            failing = [(r, e) for r, e in enumerate(errors) if e]
            if any(e["version"] for _, e in failing):
                raise FormatVersionError(f"restoring {storage.url(path)} (nothing was quarantined): "
                                         + "; ".join(f"rank {r}: {e['error']}" for r, e in failing[:4]))
            if any(e.get("caller") for _, e in failing):
                raise StateDictError(f"restoring {storage.url(path)}: the state given to restore does not fit the "
                                     "checkpoint (nothing was quarantined): "
                                     + "; ".join(f"rank {r}: {e['error']}" for r, e in failing[:4]))
            if any(e["transient"] for _, e in failing):
                raise StorageError(f"restoring {storage.url(path)} failed on storage access (nothing was "
                                   "quarantined; retry): " + "; ".join(f"rank {r}: {e['error']}" for r, e in failing[:4]))
            bad = [(r, e["error"]) for r, e in failing]
            if bad:
                dirty = dirty or err is None  # loaded here in full, failed on another rank
                why = "; ".join(f"rank {r}: {e}" for r, e in bad[:4])
                warnings.warn(f"checkpoint {storage.url(path)} is unusable, falling back to the previous one: "
                              f"{why}", stacklevel=2)
                if rank == 0 and tier == "root":
                    self._quarantine(path, why)
                if self._dist():
                    self._all_gather(None)  # the quarantine is done before anyone moves on
                continue
            if tier == "archive":
                warnings.warn(f"{self.storage.url(self.root)}: no valid checkpoint; restored step {step} from the "
                              f"archive {storage.url(path)}", stacklevel=2)
            self._apply(state, sd, report, manifest, fresh_optims=fresh_optims, dirty=dirty)
            return step
        if choice["any"] and any(self._all_gather(dirty)):
            raise CheckpointNotFoundError(
                f"{self.storage.url(self.root)}: checkpoints exist but none is valid, and the failed attempts "
                "wrote part of their data into the state given to restore: it is not a fresh start either. "
                "Build the model and optimizer again (the unusable checkpoints under the root are "
                "quarantined: a restarted job starts fresh)")
        if choice["any"] and not self.allow_fresh_start:
            raise CheckpointNotFoundError(f"{self.storage.url(self.root)}: checkpoints exist but none is valid "
                                          "(pass allow_fresh_start=True to train from scratch)")
        return None

    def _check_root(self) -> str:
        """Apply the root rules of spec/ROOTS.md section 1 (at restore, or at the first save if there was
        none); return what the root is (``roots.probe_root``)."""
        kind = probe_root(self.storage, self.root)
        if kind == "orphan":
            url, parent = self.storage.url(self.root), root_parent(self.storage, self.root)
            msg = (f"{url}: the Checkpointer root does not exist, nor does "
                   f"{'its bucket' if self.storage.remote else 'its parent'} {parent} (a misspelled path?)")
            if not self.allow_fresh_start:
                raise CheckpointNotFoundError(f"{msg}: create {parent}, or pass allow_fresh_start=True to "
                                              "start from scratch there")
            if self._rank() == 0:
                warnings.warn(f"{msg}; starting from scratch there (allow_fresh_start=True)", stacklevel=3)
        self._root_checked = True
        return kind

    def _candidates(self) -> dict:
        """Checkpoints to try, newest step first across the root and the archive (the root's copy
        first within a step), each ``[step, tier, path, unsupported]``: ``unsupported`` names the
        format versions of a checkpoint this reader cannot read (restore stops there). Or
        ``{"error", "type"}`` when the root is unusable."""
        try:
            kind = self._check_root()
        except CheckpointNotFoundError as e:
            return {"error": str(e), "type": "CheckpointNotFoundError"}
        except _FAILURES as e:  # the store cannot say (refused, unreachable): not a first run
            return {"error": str(e) if isinstance(e, ShardfmtError) else f"{self.storage.url(self.root)}: {e}",
                    "type": "StorageError"}
        if kind == "new":
            log.info("%s: no Checkpointer root there yet (its %s exists): a first run", self.storage.url(self.root),
                     "bucket" if self.storage.remote else "parent")
        out, seen_any = [], False
        tiers = [("root", self.storage, self.root)] if kind == "root" else []
        if self.archive_storage is not None:
            tiers.append(("archive", self.archive_storage, self.archive_root))
        for tier, storage, root in tiers:
            try:
                infos = list_steps(storage, root)
            except _FAILURES as e:
                # the root cannot be listed: without an archive, restore fails; with one, only a
                # missing root (the disk died) falls back to it; a failed listing would pick an
                # archived step older than what the root holds
                if tier == "root" and (self.archive_storage is None or not isinstance(e, CheckpointNotFoundError)):
                    return {"error": f"{storage.url(root)}: cannot list checkpoints: {e}", "type": "StorageError"}
                warnings.warn(f"{storage.url(root)}: cannot list checkpoints: {e}", stacklevel=3)
                continue
            seen_any = seen_any or bool(infos)
            if tier == "root":
                for i in infos:
                    if i.status == "corrupt":  # committed, then torn (a file missing or truncated, a bad manifest)
                        warnings.warn(f"checkpoint {storage.url(i.path)} is unusable, quarantined: {i.reason}",
                                      stacklevel=3)
                        self._quarantine(i.path, i.reason)
            out += [[i.step, tier, i.path, i.reason if i.status == "unsupported" else None]
                    for i in reversed(infos) if i.status in ("committed", "unsupported")]
        out.sort(key=lambda c: (-c[0], c[1] != "root"))  # newest step first (an archived newer step beats
        return {"candidates": out, "any": seen_any}      # an older local one); the root's copy first

    def _check_compat(self, path, manifest, signature, optimizers, allow_mismatch) -> None:
        meta = jsonvalue.decode_stored(manifest.metadata, where="metadata", source=path) or {}
        if allow_mismatch or not isinstance(meta, dict):
            return
        want = meta.get("config_hash")
        have = _config_hash(self.config)
        if want is not None and have is not None and want != have and not _equal(meta.get("config"), self.config):
            raise CompatibilityError(f"{path}: saved with a different config (hash {want} != {have}); "
                                     f"saved config: {str(meta.get('config'))[:300]}; pass allow_mismatch=True")
        saved = meta.get("signature") or {}
        for name, sig in signature.items():
            old = saved.get(name)
            if old is None:
                continue
            missing = sorted(set(old) - set(sig))
            extra = sorted(set(sig) - set(old))
            changed = sorted(k for k in set(old) & set(sig) if list(old[k]) != list(sig[k]))
            if missing or extra or changed:
                detail = [f"not in the model: {missing[:5]}" if missing else "",
                          f"not in the checkpoint: {extra[:5]}" if extra else "",
                          "shape/dtype differ: " + ", ".join(f"{k} {old[k]} -> {sig[k]}" for k in changed[:5])
                          if changed else ""]
                raise CompatibilityError(f"{path}: model {name!r} differs from the checkpoint: "
                                         + "; ".join(d for d in detail if d) + " (pass allow_mismatch=True)")
        for name, now in optimizers.items():  # a class or grouping change would load, then fail or train
            old = (meta.get("optimizers") or {}).get(name)  # differently (a group's weight decay dropped)
            if old is None:
                continue
            if old["class"] != now["class"]:
                raise CompatibilityError(f"{path}: optimizer {name!r} is a {now['class']}, the checkpoint holds a "
                                         f"{old['class']} (pass allow_mismatch=True to load what matches)")
            if old["groups"] != now["groups"]:
                raise CompatibilityError(
                    f"{path}: optimizer {name!r} groups its parameters differently from the checkpoint: "
                    f"{len(old['groups'])} group(s) saved, {len(now['groups'])} now; first saved groups: "
                    f"{[g[:3] for g in old['groups'][:3]]} (pass allow_mismatch=True)")

    def _apply(self, state, sd, report, manifest, *, fresh_optims: set[str], dirty: bool = False) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        meta = jsonvalue.decode(manifest.metadata, where="metadata") or {}
        meta = meta if isinstance(meta, dict) else {}
        saved_entries = set(meta.get("entries", []))
        models = {k: v for k, v in state.items() if _is_module(v)}
        for name, obj in state.items():
            if _is_module(obj):
                set_model_state_dict(obj, sd[name])
            elif _is_optimizer(obj):
                set_optimizer_state(_owner(obj, models, name), obj, sd[name])
                if name in fresh_optims and name in meta.get("unstepped", []):
                    obj.state.clear()  # saved before its first step by a version that wrote made-up state
            else:
                try:
                    obj.load_state_dict(sd[name])
                except Exception as e:  # noqa: BLE001 - the user object's own error, named and typed
                    done = list(state)[: list(state).index(name)]
                    raise StateDictError(
                        f"restoring step {manifest.step}: "
                        f"{name!r}.load_state_dict failed: {type(e).__name__}: {e} (already restored: "
                        f"{', '.join(done) or 'nothing'}; the state is partly restored)") from e
        rng_state = sd[RNG_KEY].value
        if rng_state is not None:
            rng.restore(rng_state)
        elif manifest.topology.world_size != self._world():
            warnings.warn(f"RNG states were saved by {manifest.topology.world_size} ranks; this job has "
                          f"{self._world()}: RNG streams start fresh", stacklevel=3)
        not_restored = sorted(saved_entries - set(state))
        if not_restored:
            warnings.warn(f"saved but not restored: {', '.join(not_restored)}", stacklevel=3)
        not_saved = sorted(set(state) - saved_entries) if saved_entries else []
        if not_saved and dirty:
            warnings.warn(f"not in the checkpoint: {', '.join(not_saved)}; a failed attempt to load a newer "
                          "checkpoint wrote into the state, so they may hold its data: re-initialize them",
                          stacklevel=3)
        elif not_saved:
            warnings.warn(f"not in the checkpoint, left as they are: {', '.join(not_saved)}", stacklevel=3)
        unread = [k for k in report.unexpected if k.split(".", 1)[0] in state and not k.startswith(RNG_KEY)]
        if unread:
            warnings.warn(f"{len(unread)} saved entries were not requested, e.g. {', '.join(unread[:5])}",
                          stacklevel=3)


def _newer_than_restorable(url: str, step: int, versions: str) -> str:
    """The error when the newest checkpoint restore meets is one of a format version it cannot read."""
    where = url.rstrip("/").rsplit("/", 1)[0]
    return (f"{url} (step {step}): {versions}. Every checkpoint this release can restore is older: resuming "
            "one would throw away the progress since; upgrade shardfmt to resume from it, or move it out of "
            f"{where} to resume from the newest older checkpoint (nothing was changed)")


def _owner(opt, models: Mapping[str, torch.nn.Module], name: str) -> torch.nn.Module:
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in models.values():
        if params & {id(p) for p in m.parameters()}:
            return m
    raise StateDictError(f"optimizer {name!r}: none of the state's models owns its parameters")
