"""A training state's entries into one state dict for ``save``, and a loaded one back into them.

An entry is a model (``torch.nn.Module``: its ``get_model_state_dict``), an optimizer (its state
keyed by parameter FQN, as ``train_state`` makes it, so it reshards like the weights) or any
object with ``state_dict()``/``load_state_dict()`` (scheduler, GradScaler, ResumableSampler, user
objects). Each rank's RNG states ride along under ``RNG_KEY`` (per rank). The metadata saved
with them (config, model signatures, optimizer classes, entry names, world size) is what restore
checks compatibility against (``compat``) and reports mismatches from.

Non-tensor state is applied only after every rank loaded its slices (``apply``), so a checkpoint
given up on the way leaves optimizers, schedulers, samplers and RNG as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from shardfmt.errors import StateDictError
from shardfmt.format import jsonvalue
from shardfmt.format.manifest import Manifest
from shardfmt.layout.state import IfSaved, PerRank
from shardfmt.training import rng
from shardfmt.training.compat import config_hash
from shardfmt.training.grads import GRADS_KEY, apply_grads, grad_slots, holds_grads, set_grads
from shardfmt.training.ranks import Ranks, job_warning
from shardfmt.training.train_state import optimizer_state_dict, set_optimizer_state

RNG_KEY = "_shardfmt_rng"


def is_module(v) -> bool:
    return isinstance(v, torch.nn.Module)


def is_optimizer(v) -> bool:
    return isinstance(v, torch.optim.Optimizer)


def is_per_rank_state(v) -> bool:
    """Entries whose state differs per rank and cannot be resharded: data loaders (torch's, and
    torchdata's ``StatefulDataLoader``, a subclass) and iterable datasets with a state: each rank's
    is saved as its own (``PerRank``), restored on the same world size only (``apply``)."""
    return isinstance(v, (torch.utils.data.DataLoader, torch.utils.data.IterableDataset))


def _owner(opt, models: Mapping[str, torch.nn.Module], name: str) -> torch.nn.Module:
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in models.values():
        if params & {id(p) for p in m.parameters()}:
            return m
    raise StateDictError(f"optimizer {name!r}: none of the state's models owns its parameters")


def state_dicts(state: Mapping[str, Any]) -> tuple[dict, dict, set[str]]:
    """Return (saveable dict, signature, names of optimizers that never stepped) for ``state``'s entries."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    models = {k: v for k, v in state.items() if is_module(v)}
    out: dict[str, Any] = {}
    fresh_optims: set[str] = set()
    for name, obj in state.items():
        if name.startswith("_shardfmt"):
            raise StateDictError(f"state entry {name!r}: names starting with _shardfmt are reserved")
        if is_module(obj):
            out[name] = get_model_state_dict(obj)
        elif is_optimizer(obj):
            out[name] = optimizer_state_dict(_owner(obj, models, name), obj)  # made-up state: IfSaved
            if any(isinstance(v, IfSaved) for v in out[name]["state"].values()):
                fresh_optims.add(name)
        elif is_per_rank_state(obj) and hasattr(obj, "state_dict"):
            out[name] = PerRank(obj.state_dict())  # each rank's own: its tensors too (a generator's state)
        elif hasattr(obj, "state_dict"):
            out[name] = obj.state_dict()
        else:
            raise StateDictError(f"state entry {name!r} ({type(obj).__name__}) has no state_dict()")
    signature = {name: {k: [str(v.dtype), list(v.shape)] for k, v in sd.items() if isinstance(v, torch.Tensor)}
                 for name, sd in out.items() if is_module(state[name])}
    return out, signature, fresh_optims


def optimizer_signature(state: Mapping[str, Any], sd: Mapping[str, Any]) -> dict:
    """Each optimizer's class and its parameter groups (sets of parameter names, in a stable order)."""
    return {name: {"class": f"{type(obj).__module__}.{type(obj).__qualname__}",
                   "groups": sorted(sorted(str(p) for p in g.get("params", []))
                                    for g in sd[name].get("param_groups", []))}
            for name, obj in state.items() if is_optimizer(obj)}


def data_identity(state: Mapping[str, Any], fingerprint: Any = None) -> dict:
    """What the state's data is, as restore compares it: per data entry (a data loader, a
    ``ResumableSampler``, an iterable dataset) its dataset's length and its own ``version`` or
    ``fingerprint`` attribute if it has one; and ``fingerprint`` (the caller's: e.g. a digest of
    the data's file list), under ``""``."""
    out: dict[str, Any] = {}
    for name, obj in state.items():
        if not (is_per_rank_state(obj) or hasattr(obj, "dataset_len")):
            continue
        data = getattr(obj, "dataset", obj)
        length = getattr(obj, "dataset_len", None)
        if length is None:
            try:
                length = len(data)
            except TypeError:  # an iterable dataset without a length
                length = None
        version = getattr(data, "version", getattr(data, "fingerprint", None))
        if is_per_rank_state(obj):  # each rank's own data: the saved identity is rank 0's, so no length
            length = None
        out[name] = {"length": length, "version": version if isinstance(version, (str, int)) else None}
    if fingerprint is not None:
        out[""] = {"fingerprint": fingerprint}
    return out


def for_save(state: Mapping[str, Any], *, config: Any, user_metadata: Any, ranks: Ranks,
             data_fingerprint: Any = None, grads: bool = False) -> tuple[dict, dict]:
    """Return (the state dict to save, its metadata): every entry, this rank's RNG states, and
    what restore checks (``grads``: and the models' set gradients, ``training.grads``). Raises
    StateDictError when the ranks' sampler cursors differ."""
    sd, signature, fresh_optims = state_dicts(state)
    if grads and (held := set_grads(state)):
        sd[GRADS_KEY] = held
    samplers = [v for v in state.values() if hasattr(v, "advance") and hasattr(v, "consumed")]
    if samplers and ranks.distributed():
        seen = ranks.all_gather([int(s.consumed) for s in samplers])
        if any(x != seen[0] for x in seen):
            raise StateDictError(f"sampler cursors differ across ranks at save: {seen[:8]} "
                                 "(advance(n) must be called with the same n on every rank)")
    sd[RNG_KEY] = PerRank(rng.capture())
    meta = {"user": user_metadata, "unstepped": sorted(fresh_optims),
            "config": config, "config_hash": config_hash(config),
            "signature": signature, "optimizers": optimizer_signature(state, sd),
            "entries": sorted(state), "world_size": ranks.world(), "data": data_identity(state, data_fingerprint)}
    return sd, meta


def for_restore(state: Mapping[str, Any]) -> tuple[dict, dict, set[str]]:
    """Return ``state_dicts(state)`` with a slot for this rank's saved RNG states (None if none)."""
    sd, signature, fresh_optims = state_dicts(state)
    sd[RNG_KEY] = PerRank(None)
    return sd, signature, fresh_optims


def with_grad_slots(sd: dict, state: Mapping[str, Any], manifest: Manifest) -> None:
    """Add to a restore's ``sd`` a slot for each model parameter's gradient ``manifest``'s
    checkpoint holds (``training.grads``)."""
    sd[GRADS_KEY] = grad_slots(state, manifest.tensors)


def materialize(state: Mapping[str, Any]) -> None:
    """Give a model built on the meta device real (CPU) storage to load into."""
    for obj in state.values():
        if is_module(obj) and any(t.is_meta for t in list(obj.parameters()) + list(obj.buffers())):
            obj.to_empty(device="cpu")


def apply(state: Mapping[str, Any], sd: Mapping[str, Any], report, manifest: Manifest, *,
          fresh_optims: set[str], dirty: bool = False, world: int, rank: int, grads: bool = False) -> Any:
    """Load the loaded ``sd`` into ``state``'s entries and the RNG; warn about entries on one side
    only; return the metadata the checkpoint's save was given.

    ``dirty``: a checkpoint given up before wrote into the state (entries missing here may hold
    its data). ``report``: ``load``'s report (its unexpected keys). ``grads``: set the models'
    gradients to the loaded ones (``for_restore(grads=True)``).
    """
    meta = jsonvalue.decode(manifest.metadata, where="metadata") or {}
    meta = meta if isinstance(meta, dict) else {}
    saved_entries = set(meta.get("entries", []))
    same_world = manifest.topology.world_size == world
    _load_entries(state, sd, manifest.step, fresh_optims=fresh_optims, unstepped=meta.get("unstepped", []), rank=rank,
                  same_world=same_world, saved_world=manifest.topology.world_size)
    if grads:
        apply_grads(state, sd.get(GRADS_KEY, {}))
    elif holds_grads(report.unexpected):
        job_warning(rank=rank, message=f"step {manifest.step} was saved with the gradients of a step not yet applied "
                      "(save_grads=True); restored without them (Checkpointer(save_grads=True) restores them), "
                      "the resumed run redoes that step from its first micro-step", stacklevel=4)
    rng_state = sd[RNG_KEY].value
    if rng_state is not None:
        rng.restore(rng_state)
    elif manifest.topology.world_size != world:
        job_warning(rank=rank, message=f"RNG states were saved by {manifest.topology.world_size} ranks; this job has "
                      f"{world}: RNG streams start fresh", stacklevel=4)
    _warn_unmatched(state, saved_entries, report, dirty=dirty, rank=rank)
    return meta.get("user")


def _load_entries(state: Mapping[str, Any], sd: Mapping[str, Any], step: int, *, fresh_optims: set[str], rank: int,
                  unstepped: list, same_world: bool = True, saved_world: int = 1) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    models = {k: v for k, v in state.items() if is_module(v)}
    for name, obj in state.items():
        if is_module(obj):
            set_model_state_dict(obj, sd[name])
        elif is_optimizer(obj):
            set_optimizer_state(_owner(obj, models, name), obj, sd[name])
            if name in fresh_optims and name in unstepped:
                obj.state.clear()  # saved before its first step by a version that wrote made-up state
        elif is_per_rank_state(obj) and not same_world:
            job_warning(
                rank=rank, message=f"state entry {name!r} ({type(obj).__name__}): its state was saved by each of {saved_world} ranks and "
                "cannot be resharded to this job's world size: it starts from its initial state, so samples may "
                "repeat or be skipped this epoch. For a data cursor that reshards, sample with "
                "shardfmt.ResumableSampler; or restore this entry yourself from the step restore returns",
                stacklevel=6)
        else:
            value = sd[name].value if isinstance(sd[name], PerRank) else sd[name]
            try:
                obj.load_state_dict(value)
            except Exception as e:  # noqa: BLE001 - the user object's own error, named and typed
                done = list(state)[: list(state).index(name)]
                raise StateDictError(
                    f"restoring step {step}: "
                    f"{name!r}.load_state_dict failed: {type(e).__name__}: {e} (already restored: "
                    f"{', '.join(done) or 'nothing'}; the state is partly restored)") from e


def _warn_unmatched(state: Mapping[str, Any], saved_entries: set[str], report, *, dirty: bool, rank: int) -> None:
    """Entries on one side only: the same on every rank, said once (rank 0); what differs by rank
    (a state a failed attempt wrote into; keys this rank did not request) by each rank."""
    not_restored = sorted(saved_entries - set(state))
    if not_restored:
        job_warning(rank=rank, message=f"saved but not restored: {', '.join(not_restored)}", stacklevel=5)
    not_saved = sorted(set(state) - saved_entries) if saved_entries else []
    if not_saved and dirty:
        warnings.warn(f"not in the checkpoint: {', '.join(not_saved)}; a failed attempt to load a newer "
                      "checkpoint wrote into the state, so they may hold its data: re-initialize them",
                      stacklevel=5)
    elif not_saved:
        job_warning(rank=rank, message=f"not in the checkpoint, left as they are: {', '.join(not_saved)}",
                    stacklevel=5)
    unread = [k for k in report.unexpected if k.split(".", 1)[0] in state and not k.startswith(RNG_KEY)]
    if unread:
        warnings.warn(f"{len(unread)} saved entries were not requested, e.g. {', '.join(unread[:5])}",
                      stacklevel=5)
