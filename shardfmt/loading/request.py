"""A state dict sorted against a checkpoint's manifest, before a single data byte is read.

``request_load`` flattens the caller's dict and sorts each leaf: a tensor leaf becomes read
targets (``targets.TargetBuilder``), a non-tensor leaf its decoded stored value (set only
after every read has succeeded, by ``finish``, so a failed load never leaves half-applied
non-tensor state), and a leaf the checkpoint lacks is missing — unless the checkpoint holds
it in another shape (entries under its name, or one entry above it), which is an error
whatever ``strict`` says. ``IfSaved`` subtrees keep the leaves the checkpoint holds and are
never missing (``shardfmt.layout.state``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardfmt.errors import ManifestError, MissingKeyError, StateDictError
from shardfmt.format import jsonvalue
from shardfmt.format.manifest import Manifest, ValueRecord
from shardfmt.layout.state import (
    FlatShard,
    Leaf,
    PerRank,
    ShardedTensor,
    _is_dtensor,
    check_settable,
    flatten,
    per_rank_tensors,
    set_leaf,
    settle_if_saved,
)
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.targets import ReadTarget, TargetBuilder


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRequest:
    """What a load will read and set: ``targets`` for the tensors, ``values`` (leaf, stored
    value) for the rest; ``kept`` holds the ``IfSaved`` tensor leaves the checkpoint holds."""

    leaves: tuple[Leaf, ...]
    targets: tuple[ReadTarget, ...]
    values: tuple[tuple[Leaf, Any], ...]
    kept: Mapping[str, Any]
    loaded: tuple[str, ...]
    missing: tuple[str, ...]


def rank_and_world(rank: int | None, process_group, manifest: Manifest, source: str) -> tuple[int, int]:
    """This process's rank and its job's world size: torch.distributed's, or with ``rank=``
    alone, that rank of the job that saved the checkpoint."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        r = dist.get_rank(process_group)
        return (r if rank is None else rank), dist.get_world_size(process_group)
    if rank is None:
        return 0, 1
    world_size = manifest.topology.world_size
    if not 0 <= rank < world_size:
        raise StateDictError(f"{source}: rank={rank} is not a rank of the job that saved it "
                             f"(world size {world_size})")
    return rank, world_size


def _is_tensor_leaf(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor, FlatShard)) or _is_dtensor(v)


def request_load(state_dict: dict, manifest: Manifest, options: LoadOptions, *, rank: int, world_size: int,
                 source: str) -> LoadRequest:
    """Sort ``state_dict``'s leaves against ``manifest`` (``source`` names it in errors); raise
    before any read for a leaf that cannot be loaded, and for one missing when ``strict``."""
    m = manifest
    leaves = flatten(state_dict)
    builder = TargetBuilder(m, cast=options.cast, world_size=world_size, rank=rank)
    values: list[tuple[Leaf, Any]] = []
    absent: list[Leaf] = []
    kept: dict[str, Any] = {}
    loaded: list[str] = []
    for leaf in leaves:
        if _is_tensor_leaf(leaf.value):
            if leaf.fqn not in m.tensors:
                if leaf.fqn in m.values:
                    raise StateDictError(f"{leaf.fqn}: the checkpoint holds a value here, not a tensor")
                absent.append(leaf)
                continue
            if leaf.within is not None:
                kept[leaf.fqn] = leaf.value
            builder.add(leaf)
            loaded.append(leaf.fqn)
            continue
        rec = m.values.get(leaf.fqn)
        if rec is None:
            if leaf.fqn in m.tensors:
                raise StateDictError(f"{leaf.fqn}: the checkpoint holds a tensor here; pass a tensor to "
                                     f"load it into (got {type(leaf.value).__name__})")
            absent.append(leaf)
            continue
        if leaf.within is None:
            check_settable(leaf)  # before any read: a load fails whole or not at all
        value = _stored_value(leaf, rec, m, options, rank=rank, world_size=world_size, source=source)
        if value is not _SKIP:
            values.append((leaf, value))
            loaded.append(leaf.fqn)
    targets = builder.build()
    missing = _check_absent(absent, m, source, strict=options.strict)
    return LoadRequest(leaves=tuple(leaves), targets=tuple(targets), values=tuple(values), kept=kept,
                       loaded=tuple(loaded), missing=missing)


def finish(request: LoadRequest) -> tuple[str, ...]:
    """Once every read succeeded: set the non-tensor leaves, put each ``IfSaved`` subtree in
    place, and return the names loaded (less those dropped from an ``IfSaved`` list that is
    not whole)."""
    kept = dict(request.kept)
    for leaf, value in request.values:
        if leaf.within is None:
            set_leaf(leaf, value)
        else:
            kept[leaf.fqn] = value
    dropped = settle_if_saved(list(request.leaves), kept)  # read, but in an IfSaved list that is not whole
    return tuple(f for f in request.loaded if f not in dropped) if dropped else request.loaded


_SKIP = object()


def _stored_value(leaf: Leaf, rec: ValueRecord, m: Manifest, options: LoadOptions, *, rank: int,
                  world_size: int, source: str) -> Any:
    """The value to set ``leaf`` to (``_SKIP``: keep the caller's, ``per_rank="skip"``)."""
    v = leaf.value
    if not isinstance(v, PerRank) and rec.per_rank is None:
        return jsonvalue.decode_stored(rec.value, where=leaf.fqn, source=source)
    fqn, saved_world = leaf.fqn, m.topology.world_size
    if rec.per_rank is None:
        raise StateDictError(f"{fqn}: the checkpoint holds one replicated value, the caller expects PerRank")
    if world_size != saved_world and options.per_rank == "skip":
        return _SKIP
    if world_size != saved_world:
        raise StateDictError(f"{fqn}: per-rank value was saved by {saved_world} rank(s) "
                             f"(ranks {sorted(rec.per_rank)[:8]}), this job has {world_size} "
                             f"and this is rank {rank}; pass per_rank='skip' to keep the current values")
    if rank not in rec.per_rank:  # the same job's rank: the checkpoint lacks its value (spec section 4.6)
        raise ManifestError(f"{source}: {fqn}: a per-rank value, but the checkpoint holds none for rank {rank} "
                            f"(of the {saved_world} ranks that saved it)")
    got = jsonvalue.decode_stored(rec.per_rank[rank], where=fqn, source=source)
    if isinstance(v, PerRank):
        return PerRank(per_rank_tensors(got, v.value))  # tensors come back where the caller holds tensors
    return got


def _check_absent(absent: list[Leaf], m: Manifest, source: str, *, strict: bool) -> tuple[str, ...]:
    """Return the missing names (raise ``MissingKeyError`` for any when ``strict``). First raise
    ``StateDictError`` for a leaf the checkpoint holds in another shape: entries under its name,
    or one entry above it. Present data is never reported as missing."""
    if absent:
        names = sorted([*m.tensors, *m.values])  # once per load: manifests can hold millions of names
        for leaf in absent:
            _check_shape_of_absent(leaf, names, m, source)
    missing = tuple(leaf.fqn for leaf in absent if leaf.within is None)
    if missing and strict:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise MissingKeyError(f"{source}: not in the checkpoint: {shown} (pass strict=False to skip)")
    return missing


def _check_shape_of_absent(leaf: Leaf, names: list[str], m: Manifest, source: str) -> None:
    lo = bisect_left(names, leaf.fqn + ".")
    hi = bisect_left(names, leaf.fqn + "/", lo)  # "/" sorts right after ".": [lo, hi) is under it
    if hi > lo:
        shown = ", ".join(names[lo:min(hi, lo + 3)]) + (", ..." if hi - lo > 3 else "")
        raise StateDictError(
            f"{source}: {leaf.fqn}: the checkpoint holds {hi - lo} entries under this name ({shown}); "
            f"the state given to load holds one {_kind(leaf.value)} here{_fresh_optimizer_hint(leaf.value)}")
    parts = leaf.fqn.split(".")
    for above in (".".join(parts[:i]) for i in range(1, len(parts))):
        if above in m.tensors or above in m.values:
            raise StateDictError(
                f"{source}: {leaf.fqn}: the checkpoint holds {above} as one "
                f"{'tensor' if above in m.tensors else 'value'}, not the entries under it that the state "
                f"given to load holds; load it as one value (e.g. {{{above!r}: None}})")


def _kind(v: Any) -> str:
    return "tensor" if _is_tensor_leaf(v) else f"value ({type(v).__name__} without tensors)"


def _fresh_optimizer_hint(v: Any) -> str:
    if not isinstance(v, dict) or (v and "param_groups" not in v):
        return ""
    return (". An optimizer that has not stepped yet has no state to load into: build the state with "
            "shardfmt.get_state_dict(model, optimizer), load into it, then apply it with "
            "shardfmt.set_state_dict(model, optimizer, state)")
