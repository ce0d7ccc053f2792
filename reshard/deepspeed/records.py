"""Check what the restricted unpickler built from DeepSpeed's files into frozen records.

``model_states`` reads a ``*_model_states.pt`` dict, ``rank_optim`` a ``*_optim_states.pt``
dict (ZeRO-1/2 ``DeepSpeedZeroOptimizer`` or ZeRO-3 ``DeepSpeedZeroOptimizer_Stage3``); each
field is checked for its type and a wrong one is refused naming the file and the key. Tensors
stay ``TensorRef`` (nothing is read here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reshard.deepspeed.ptfile import TensorRef
from reshard.errors import DeepSpeedImportError

Shapes = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) in flat order
STATE_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStates:
    """One model-states file: buffers, the flat groups' parameter shapes, frozen parameters, ties."""

    buffers: tuple[tuple[str, TensorRef], ...]
    module_names: tuple[str, ...]  # every name ``module`` holds (parameters in the model dtype, buffers)
    param_shapes: tuple[Shapes, ...]  # one per flat group (ZeRO-1/2: param group; ZeRO-3: sub-group)
    frozen_shapes: Shapes
    frozen_fragments: tuple[tuple[str, TensorRef], ...]
    shared: tuple[tuple[str, str], ...]  # (alias, owner)
    ds_version: str | None
    global_steps: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatState:
    """The optimizer state of one flat group on one rank: tensors in the flat layout, and ``step``."""

    tensors: tuple[tuple[str, TensorRef], ...]  # exp_avg, exp_avg_sq
    step: TensorRef | int | float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankOptim:
    """One rank's optim-states file: its fp32 partition and optimizer state of every flat group."""

    stage: int
    world_size: int  # max(partition_count)
    flats: tuple[TensorRef, ...]
    states: tuple[FlatState, ...]  # per flat group; () when the file holds none
    param_groups: tuple[dict[str, Any], ...]  # hyperparameters + "params": flat-group indices
    alignment_paddings: tuple[tuple[int, ...], ...] | None


def _get(d: dict, key: str, where: str, kinds, *, optional: bool = False) -> Any:
    if key not in d:
        if optional:
            return None
        raise DeepSpeedImportError(f"{where}: no {key!r} entry (not a DeepSpeed ZeRO checkpoint file, or one "
                                   "older than DeepSpeed 0.9.2)")
    v = d[key]
    if (v is None and optional) or isinstance(v, kinds):
        return v
    raise DeepSpeedImportError(f"{where}: {key!r} is a {type(v).__name__}, expected {kinds}")


def _shapes(obj: Any, where: str) -> Shapes:
    if not isinstance(obj, dict) or not all(type(k) is str and type(v) is tuple for k, v in obj.items()):
        raise DeepSpeedImportError(f"{where}: expected an OrderedDict of name -> torch.Size")
    return tuple(obj.items())


def _refs(obj: Any, where: str) -> tuple[tuple[str, TensorRef], ...]:
    if not isinstance(obj, dict) or not all(type(k) is str and isinstance(v, TensorRef) for k, v in obj.items()):
        raise DeepSpeedImportError(f"{where}: expected a dict of name -> tensor")
    return tuple(obj.items())


def model_states(d: Any, where: str) -> ModelStates:
    """Check a model-states dict (``buffer_names``, ``module``, ``param_shapes``, frozen, shared)."""
    if not isinstance(d, dict):
        raise DeepSpeedImportError(f"{where}: holds a {type(d).__name__}, not a DeepSpeed model-states dict")
    names = _get(d, "buffer_names", where, list)
    module = _get(d, "module", where, dict)
    buffers = tuple((k, v) for k, v in module.items() if k in names)
    if not all(isinstance(v, TensorRef) for _, v in buffers):
        raise DeepSpeedImportError(f"{where}: a buffer in 'module' is not a tensor")
    groups = _get(d, "param_shapes", where, list)
    frozen = _get(d, "frozen_param_shapes", where, dict, optional=True) or {}
    fragments = _get(d, "frozen_param_fragments", where, dict, optional=True) or {}
    shared = _get(d, "shared_params", where, dict)
    if not all(type(k) is str and type(v) is str for k, v in shared.items()):
        raise DeepSpeedImportError(f"{where}: 'shared_params' is not a dict of name -> name")
    version = d.get("ds_version")
    steps = d.get("global_steps")
    return ModelStates(
        buffers=buffers, module_names=tuple(module), param_shapes=tuple(_shapes(g, f"{where}: param_shapes[{i}]") for i, g in enumerate(groups)),
        frozen_shapes=_shapes(frozen, f"{where}: frozen_param_shapes"),
        frozen_fragments=_refs(fragments, f"{where}: frozen_param_fragments"), shared=tuple(shared.items()),
        ds_version=version if type(version) is str else None,
        global_steps=steps if type(steps) is int and steps >= 0 else None)


def _flat_state(s: Any, where: str) -> FlatState:
    if not isinstance(s, dict):
        raise DeepSpeedImportError(f"{where}: optimizer state is a {type(s).__name__}, not a dict")
    missing = [k for k in STATE_KEYS if not isinstance(s.get(k), TensorRef)]
    if missing:
        raise DeepSpeedImportError(f"{where}: optimizer state has no tensor {missing[0]!r} (only Adam-style "
                                   f"state is imported; keys: {sorted(map(str, s))})")
    step = s.get("step")
    if step is not None and not isinstance(step, (TensorRef, int, float)):
        raise DeepSpeedImportError(f"{where}: optimizer state 'step' is a {type(step).__name__}")
    return FlatState(tensors=tuple((k, s[k]) for k in STATE_KEYS), step=step)


def _param_groups(groups: Any, n_flat: int, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise DeepSpeedImportError(f"{where}: 'param_groups' is not a list of dicts")
    seen: list[int] = []
    for g in groups:
        ps = g.get("params")
        if not isinstance(ps, list) or not all(type(p) is int for p in ps):
            raise DeepSpeedImportError(f"{where}: a param group's 'params' is not a list of indices")
        seen += ps
    if sorted(seen) != list(range(n_flat)):
        raise DeepSpeedImportError(f"{where}: param_groups name flat groups {sorted(seen)}, the file holds {n_flat}")
    return tuple(groups)


def rank_optim(d: Any, where: str) -> RankOptim:
    """Check an optim-states dict of ZeRO stage 1, 2 or 3."""
    osd = _get(d, "optimizer_state_dict", where, dict) if isinstance(d, dict) else None
    if osd is None:
        raise DeepSpeedImportError(f"{where}: not a DeepSpeed optim-states dict")
    if "zero_stage" not in osd:
        raise DeepSpeedImportError(f"{where}: no 'zero_stage': not a ZeRO checkpoint (BF16_Optimizer and ZeRO-0 "
                                   "checkpoints are not supported, as by zero_to_fp32)")
    stage = _get(osd, "zero_stage", where, int)
    counts = _get(osd, "partition_count", where, (int, list))
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or not all(type(c) is int and c >= 1 for c in counts):
        raise DeepSpeedImportError(f"{where}: 'partition_count' {counts!r} is not a list of positive ints")
    if stage in (1, 2):
        flats = _get(osd, "single_partition_of_fp32_groups", where, list)
        base = _get(osd, "base_optimizer_state", where, (dict, list))
        if isinstance(base, list):  # elastic_checkpoint: per group, padding stripped, no param_groups
            states, groups = tuple(_flat_state(s, f"{where}: base_optimizer_state[{i}]") for i, s in enumerate(base)), ()
        else:
            states, groups = _torch_state(base, len(flats), f"{where}: base_optimizer_state")
        paddings = osd.get("param_alignment_paddings")
    elif stage == 3:
        flats = _get(osd, "fp32_flat_groups", where, list)
        states, groups = _torch_state(_get(osd, "optimizer_state_dict", where, dict), len(flats),
                                      f"{where}: optimizer_state_dict")
        paddings = None
    else:
        raise DeepSpeedImportError(f"{where}: ZeRO stage {stage} is not supported (stages 1, 2 and 3 are)")
    if not all(isinstance(f, TensorRef) and f.is_flat() for f in flats):
        raise DeepSpeedImportError(f"{where}: an fp32 partition is not a flat tensor")
    if len(states) not in (0, len(flats)):
        raise DeepSpeedImportError(f"{where}: optimizer state for {len(states)} flat groups, fp32 partitions "
                                   f"for {len(flats)}")
    if paddings is not None and (not isinstance(paddings, list) or not all(
            isinstance(p, list) and all(type(x) is int and x >= 0 for x in p) for p in paddings)):
        raise DeepSpeedImportError(f"{where}: 'param_alignment_paddings' is not a list of lists of ints")
    return RankOptim(stage=stage, world_size=max(counts), flats=tuple(flats), states=states, param_groups=groups,
                     alignment_paddings=None if paddings is None else tuple(tuple(p) for p in paddings))


def _torch_state(sd: dict, n_flat: int, where: str) -> tuple[tuple[FlatState, ...], tuple[dict[str, Any], ...]]:
    state = _get(sd, "state", where, dict)
    groups = _param_groups(_get(sd, "param_groups", where, list), n_flat, where)
    if not state:
        return (), groups
    if sorted(state) != list(range(n_flat)):
        raise DeepSpeedImportError(f"{where}: optimizer state for flat groups {sorted(state)}, expected "
                                   f"{list(range(n_flat))}")
    return tuple(_flat_state(state[i], f"{where}: state[{i}]") for i in range(n_flat)), groups


__all__ = ["STATE_KEYS", "FlatState", "ModelStates", "RankOptim", "Shapes", "model_states", "rank_optim"]
