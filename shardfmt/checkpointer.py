"""The training-loop API: whole training state in, whole training state out, on any topology.

``Checkpointer(root).save(step, state)`` writes ``root/step_XXXXXXXXX``: model and
optimizer state through ``torch.distributed.checkpoint.state_dict`` (optimizer state keyed
by parameter FQN, so it reshards like the weights; lazily created state is initialised),
every other entry's ``state_dict()`` (scheduler, GradScaler, ResumableSampler, user
objects), each rank's RNG states, and metadata for compatibility checks. Retention runs
only after the new checkpoint is committed.

``restore(state)``::

    1) rank 0 lists the committed checkpoints, newest first, and broadcasts its choice
    2) every rank loads its slices, verifying every byte it reads
    3) the ranks agree (all-gather): if any rank failed, rank 0 quarantines the checkpoint
       (``step_X.corrupt-<id>``), everyone warns naming the file and cause, and all fall
       back together to the next one
    4) only then is non-tensor state applied (optimizer, scheduler, sampler, RNG)

When checkpoints exist but none is valid, restore raises unless ``allow_fresh_start``.
"""

from __future__ import annotations

import datetime as _dt
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from . import hashing, rng
from .api import load, save
from .errors import (
    CheckpointNotFoundError,
    ShardfmtError,
    StateDictError,
)
from .reader import open_checkpoint
from .retention import (
    DEFAULT_LEASE_SECONDS,
    lease_expired,
    parse_step_dir,
    step_dir_name,
    to_delete,
)
from .state import PerRank
from .storage import get_storage

RNG_KEY = "_shardfmt_rng"
_FAILURES = (ShardfmtError, OSError)


class CompatibilityError(StateDictError):
    """The checkpoint was written for a different model or config."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    step: int
    path: str
    status: str  # committed | incomplete | corrupt


def _is_module(v) -> bool:
    return isinstance(v, torch.nn.Module)


def _is_optimizer(v) -> bool:
    return isinstance(v, torch.optim.Optimizer)


def _config_hash(config: Any) -> str | None:
    if config is None:
        return None
    from . import jsonvalue

    return hashing.digest_bytes(orjson.dumps(jsonvalue.encode(config, where="config"), option=orjson.OPT_SORT_KEYS))


class Checkpointer:
    """Save and restore whole training states under ``root`` (a directory or fsspec URL)."""

    def __init__(self, root: str, *, keep_last: int = 3, keep_every: int | None = None,
                 config: Any = None, allow_fresh_start: bool = False, storage_options: dict | None = None,
                 process_group=None, timeout: _dt.timedelta | None = None,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, mesh: Mapping[str, int] | None = None) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.storage, self.root = get_storage(root, storage_options)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.config = config
        self.allow_fresh_start = allow_fresh_start
        self.storage_options = storage_options
        self.process_group = process_group
        self.timeout = timeout
        self.lease_seconds = lease_seconds
        self.mesh = mesh
        self._stager = None  # async saves' staging buffers, created on the first one
        self._pending: list = []

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
        from .distributed import broadcast_bytes, control_group

        g = control_group(self.process_group, self.timeout)
        return orjson.loads(broadcast_bytes(orjson.dumps(obj) if self._rank() == 0 else None, 0, g))

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._dist():
            return [obj]
        from .distributed import all_gather_bytes, control_group

        g = control_group(self.process_group, self.timeout)
        return [orjson.loads(b) for b in all_gather_bytes(orjson.dumps(obj), g)]

    # ------------------------------------------------------------------ state <-> dicts
    def _state_dicts(self, state: Mapping[str, Any]) -> tuple[dict, dict]:
        """Return (saveable dict, signature) for ``state``'s entries."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        models = {k: v for k, v in state.items() if _is_module(v)}
        out: dict[str, Any] = {}
        for name, obj in state.items():
            if name.startswith("_shardfmt"):
                raise StateDictError(f"state entry {name!r}: names starting with _shardfmt are reserved")
            if _is_module(obj):
                out[name] = get_model_state_dict(obj)
            elif _is_optimizer(obj):
                model = _owner(obj, models, name)
                out[name] = get_optimizer_state_dict(model, obj)
            elif hasattr(obj, "state_dict"):
                out[name] = obj.state_dict()
            else:
                raise StateDictError(f"state entry {name!r} ({type(obj).__name__}) has no state_dict()")
        return out, {name: {k: [str(v.dtype), list(v.shape)] for k, v in sd.items() if isinstance(v, torch.Tensor)}
                     for name, sd in out.items() if _is_module(state[name])}

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any], *, metadata: Any = None, async_: bool = False,
             policy: str = "wait", stage: str = "call"):
        """Save ``state`` as ``root/step_<step>``; apply retention once it is committed.

        Returns the checkpoint's path. With ``async_=True`` the call returns an ``AsyncSave``
        handle once the state is snapshotted into this Checkpointer's reused host buffers;
        writing, commit and retention run in the background (see ``shardfmt.async_save``
        for ``policy`` and ``stage``). ``latest()`` names the new step only once committed;
        ``wait()`` blocks until every background save has finished.
        """
        sd, signature = self._state_dicts(state)
        samplers = [v for v in state.values() if hasattr(v, "advance") and hasattr(v, "consumed")]
        if samplers and self._dist():
            seen = self._all_gather([int(s.consumed) for s in samplers])
            if any(x != seen[0] for x in seen):
                raise StateDictError(f"sampler cursors differ across ranks at save: {seen[:8]} "
                                     "(advance(n) must be called with the same n on every rank)")
        sd[RNG_KEY] = PerRank(rng.capture())
        meta = {"user": metadata, "config": self.config, "config_hash": _config_hash(self.config),
                "signature": signature, "entries": sorted(state), "world_size": self._world()}
        path = self.storage.join(self.root, step_dir_name(step))
        self.storage.makedirs(self.root)
        url = path if "://" not in self.root else self.root.rstrip("/") + "/" + step_dir_name(step)
        common = dict(step=step, metadata=meta, storage_options=self.storage_options,
                      process_group=self.process_group, timeout=self.timeout, mesh=self.mesh)
        if async_:
            from .async_save import Stager, async_save

            if self._stager is None:
                self._stager = Stager()
            handle = async_save(sd, url, stager=self._stager, policy=policy, stage=stage,
                                on_commit=self._after_async_commit, **common)
            self._pending = [h for h in self._pending if not h.done()] + [handle]
            return handle
        self.wait()
        save(sd, url, **common)
        if self._rank() == 0:
            self._apply_retention()
        return path

    def _after_async_commit(self, manifest) -> None:
        if self._rank() != 0:
            return
        try:
            self._apply_retention()
        except _FAILURES as e:  # the checkpoint is committed; a failed clean-up must not fail it
            warnings.warn(f"{self.root}: retention after step {manifest.step} failed: {e}", stacklevel=2)

    def wait(self) -> None:
        """Block until every background save has finished; raise the first one's error."""
        pending, self._pending = self._pending, []
        errors = []
        for h in pending:
            try:
                h.wait()
            except _FAILURES as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for background saves and drop the staging buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _apply_retention(self) -> None:
        committed = [i for i in self.list() if i.status == "committed"]
        for step in to_delete([i.step for i in committed], keep_last=self.keep_last, keep_every=self.keep_every):
            info = next(i for i in committed if i.step == step)
            self.storage.remove_tree(info.path)
        self.collect_garbage()

    def collect_garbage(self, *, now: float | None = None) -> list[str]:
        """Remove staging dirs of dead saves (lease expired); never a live save's."""
        import time

        now = time.time() if now is None else now
        removed = []
        for name in self._names():
            if ".tmp-" not in name:
                continue
            path = self.storage.join(self.root, name)
            try:
                if lease_expired(self.storage.mtime(path), now, self.lease_seconds):
                    self.storage.remove_tree(path)
                    removed.append(path)
            except ShardfmtError:
                continue
        return removed

    # ------------------------------------------------------------------ discovery
    def _names(self) -> list[str]:
        if not self.storage.exists(self.root):
            return []
        return self.storage.listdir(self.root)

    def list(self) -> list[CheckpointInfo]:
        """Every ``step_*`` under root, oldest first, with its status (quick checks only)."""
        from .cli import checkpoint_status

        out = []
        for name in self._names():
            step = parse_step_dir(name)
            if step is None:
                continue
            path = self.storage.join(self.root, name)
            status, _, _, _ = checkpoint_status(self.storage, path)
            out.append(CheckpointInfo(step=step, path=path, status=status))
        return sorted(out, key=lambda i: i.step)

    def latest(self) -> str | None:
        """The newest committed checkpoint (never an in-flight save)."""
        committed = [i for i in self.list() if i.status == "committed"]
        return committed[-1].path if committed else None

    def _quarantine(self, path: str, reason: str) -> None:
        import uuid

        dest = f"{path}.corrupt-{uuid.uuid4().hex[:8]}"
        try:
            if self.storage.atomic_rename:
                self.storage.rename(path, dest)
            else:
                self.storage.write_bytes(self.storage.join(path, "QUARANTINED"), reason.encode())
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
        infos = self.list() if rank == 0 else []
        choice = self._broadcast({"candidates": [[i.step, i.path] for i in reversed(infos) if i.status == "committed"],
                                  "any": bool(infos)})
        for step, path in choice["candidates"]:
            sd, signature = self._state_dicts(state)
            sd[RNG_KEY] = PerRank(None)
            err = None
            try:
                manifest = open_checkpoint(path, storage=self.storage).manifest
                self._check_compat(path, manifest, signature, state, allow_mismatch)
                report = load(sd, path, strict=False, per_rank="skip", process_group=self.process_group)
            except CompatibilityError:
                raise
            except _FAILURES as e:
                err = f"{type(e).__name__}: {e}"
            errors = self._all_gather(err)
            bad = [(r, e) for r, e in enumerate(errors) if e]
            if bad:
                why = "; ".join(f"rank {r}: {e}" for r, e in bad[:4])
                warnings.warn(f"checkpoint {path} is unusable, falling back to the previous one: {why}",
                              stacklevel=2)
                if rank == 0:
                    self._quarantine(path, why)
                if self._dist():
                    self._all_gather(None)  # the quarantine is done before anyone moves on
                continue
            self._apply(state, sd, report, manifest)
            return step
        if choice["any"] and not self.allow_fresh_start:
            raise CheckpointNotFoundError(f"{self.root}: checkpoints exist but none is valid "
                                          "(pass allow_fresh_start=True to train from scratch)")
        return None

    def _check_compat(self, path, manifest, signature, state, allow_mismatch) -> None:
        from . import jsonvalue

        meta = jsonvalue.decode(manifest.metadata, where="metadata") or {}
        if allow_mismatch or not isinstance(meta, dict):
            return
        want = meta.get("config_hash")
        have = _config_hash(self.config)
        if want is not None and have is not None and want != have:
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

    def _apply(self, state, sd, report, manifest) -> None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from . import jsonvalue

        models = {k: v for k, v in state.items() if _is_module(v)}
        for name, obj in state.items():
            if _is_module(obj):
                set_model_state_dict(obj, sd[name])
            elif _is_optimizer(obj):
                set_optimizer_state_dict(_owner(obj, models, name), obj, sd[name])
            else:
                obj.load_state_dict(sd[name])
        rng_state = sd[RNG_KEY].value
        if rng_state is not None:
            rng.restore(rng_state)
        elif manifest.topology.world_size != self._world():
            warnings.warn(f"RNG states were saved by {manifest.topology.world_size} ranks; this job has "
                          f"{self._world()}: RNG streams start fresh", stacklevel=3)
        meta = jsonvalue.decode(manifest.metadata, where="metadata") or {}
        saved_entries = set(meta.get("entries", [])) if isinstance(meta, dict) else set()
        not_restored = sorted(saved_entries - set(state))
        if not_restored:
            warnings.warn(f"saved but not restored: {', '.join(not_restored)}", stacklevel=3)
        unread = [k for k in report.unexpected if k.split(".", 1)[0] in state and not k.startswith(RNG_KEY)]
        if unread:
            warnings.warn(f"{len(unread)} saved entries were not requested, e.g. {', '.join(unread[:5])}",
                          stacklevel=3)


def _owner(opt, models: Mapping[str, torch.nn.Module], name: str) -> torch.nn.Module:
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in models.values():
        if params & {id(p) for p in m.parameters()}:
            return m
    raise StateDictError(f"optimizer {name!r}: none of the state's models owns its parameters")
