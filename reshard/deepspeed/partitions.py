"""DeepSpeed's own flat partitions as ``shardfmt.FlatShard`` targets (pure: no I/O).

``flat_targets`` answers "which buffers would DeepSpeed hold on dp rank ``r``, and where in them
does each parameter lie", as load targets over freshly allocated buffers: ``shardfmt.load(targets,
ckpt, strict=False)`` fills them with the rank's exact partitions, from a checkpoint of any layout
(an imported DeepSpeed checkpoint, or one saved from DTensors), for any world size.

- ZeRO-1/2 (``single_partition_of_fp32_groups[g]``): group ``g``'s parameters in ``param_shapes[g]``
  order, each followed by its ``param_alignment_paddings[g][i]`` gap, make the group buffer of
  ``N`` elements, padded to ``T = ceil(N / 2W) * 2W``; rank ``r`` holds ``[r * P, (r + 1) * P)``,
  ``P = T / W`` (``shardfmt.flat_group``). DeepSpeed saves the fp32 partition stripped of its
  tail padding (``P - group_paddings[r]`` elements), its Adam state unstripped (``P``).
- ZeRO-3 (``fp32_flat_groups[s]``): per sub-group ``s``, the rank's ``pn = ceil(n / W)``-element
  chunk of every parameter of ``param_shapes[s]``, concatenated in order (``FlatShard.chunk``).

``exp_avg`` / ``exp_avg_sq`` lie in the same layout as the fp32 partition, one buffer each.
Buffers are filled with ``SENTINEL_BITS`` (a NaN no arithmetic produces) so that what a load
leaves alone, the padding, stays visible; ``FlatBuffer.real`` lists the element ranges that hold
parameter elements (everything else is padding: alignment gaps, tail, chunk tails).

Trade-off: the sub-group split of ZeRO-3 (``sub_group_size``) depends on the world size;
``flat_targets`` takes the grouping it is given (``param_shapes``) and does not recompute it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reshard.deepspeed.layout import group_members, numel, zero3_partition, zero12_partition
from reshard.deepspeed.records import STATE_KEYS, ModelStates, RankOptim, Shapes
from reshard.errors import DeepSpeedImportError
from shardfmt import FlatShard, flat_group

SENTINEL_BITS = 0x7FC05EED  # a quiet NaN with a payload, as the bits of an fp32
MASTER = "fp32"  # FlatBuffer.key of the fp32 master partition


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatGroups:
    """How a DeepSpeed run lays its trainable parameters into flat groups (model + optim records)."""

    stage: int
    param_shapes: tuple[Shapes, ...]  # ZeRO-1/2: per param group; ZeRO-3: per sub-group
    alignment_paddings: tuple[tuple[int, ...], ...] | None = None  # ZeRO-1/2, per group, per param

    def members(self, g: int) -> list[tuple[str, tuple[int, ...], int]]:
        """ZeRO-1/2 group ``g``: ``(name, shape, offset in the group buffer)`` in flat order."""
        return self._walk(g)[0]

    def group_numel(self, g: int) -> int:
        """ZeRO-1/2: ``N``, the group buffer's elements before its tail padding."""
        return self._walk(g)[1]

    def _walk(self, g: int) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
        pads = None if self.alignment_paddings is None else self.alignment_paddings[g]
        return group_members(self.param_shapes[g], pads, f"group {g}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatBuffer:
    """One buffer of a rank: ``key`` (``MASTER`` or an Adam state key) of flat group ``group``;
    ``real`` the ``(start, stop)`` element ranges that hold parameter elements, in order."""

    key: str
    group: int
    tensor: torch.Tensor
    real: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatTargets:
    """``targets`` (checkpoint name -> ``FlatShard`` into one of ``buffers``) for ``shardfmt.load``."""

    targets: dict[str, FlatShard]
    buffers: tuple[FlatBuffer, ...]


def from_records(model: ModelStates, optim: RankOptim) -> FlatGroups:
    """The flat groups a checkpoint's model-states record (rank 0's) and any rank's optim record give."""
    if len(model.param_shapes) != len(optim.flats):
        raise DeepSpeedImportError(f"param_shapes has {len(model.param_shapes)} groups, the optimizer "
                                   f"{len(optim.flats)} fp32 partitions")
    return FlatGroups(stage=optim.stage, param_shapes=model.param_shapes,
                      alignment_paddings=optim.alignment_paddings if optim.stage in (1, 2) else None)


def sentinel(n: int) -> torch.Tensor:
    """``n`` fp32 elements holding ``SENTINEL_BITS``."""
    return torch.full((n,), SENTINEL_BITS, dtype=torch.int32).view(torch.float32)


def flat_targets(groups: FlatGroups, *, rank: int, world_size: int, model_prefix: str = "model.",
                 state_prefix: str = "optim.state.", state_keys: Sequence[str] = STATE_KEYS) -> FlatTargets:
    """Rank ``rank`` of ``world_size``'s DeepSpeed partitions as load targets: ``model_prefix + name``
    into the fp32 buffers, ``f"{state_prefix}{name}.{key}"`` into one buffer per state key (the
    names ``import_deepspeed`` writes)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DeepSpeedImportError(f"dp rank {rank} of a world of {world_size}")
    if groups.stage not in (1, 2, 3):
        raise DeepSpeedImportError(f"ZeRO stage {groups.stage} is not supported (stages 1, 2 and 3 are)")
    layout = _zero3 if groups.stage == 3 else _zero12
    targets: dict[str, FlatShard] = {}
    buffers: list[FlatBuffer] = []
    for g in range(len(groups.param_shapes)):
        for key in (MASTER, *state_keys):
            prefix, suffix = (model_prefix, "") if key == MASTER else (state_prefix, f".{key}")
            shards, buf, real = layout(groups, g, rank, world_size)
            targets |= {prefix + name + suffix: s for name, s in shards.items()}
            buffers.append(FlatBuffer(key=key, group=g, tensor=buf, real=real))
    return FlatTargets(targets=targets, buffers=tuple(buffers))


def _zero12(groups: FlatGroups, g: int, rank: int, world: int):
    """Group ``g``'s window ``[rank * P, (rank + 1) * P)``, its shards and real ranges."""
    members = groups.members(g)
    part = zero12_partition(groups.group_numel(g), world)
    lo, hi = rank * part, (rank + 1) * part
    real = []
    for _, shape, offset in members:
        a, b = max(lo, offset), min(hi, offset + math.prod(shape))
        if a < b:
            real.append((a - lo, b - lo))
    buf = sentinel(part)
    return flat_group(buf, members, start=lo), buf, tuple(real)


def _zero3(groups: FlatGroups, s: int, rank: int, world: int):
    """Sub-group ``s``: the rank's ``ceil(n / W)`` chunk of each parameter, concatenated."""
    buf = sentinel(sum(zero3_partition(numel(shape, name), world) for name, shape in groups.param_shapes[s]))
    shards, real, offset = {}, [], 0
    for name, shape in groups.param_shapes[s]:
        n = math.prod(shape)
        pn = zero3_partition(n, world)
        shards[name] = FlatShard.chunk(buf[offset:offset + pn], shape, coord=rank, count=world)
        held = max(0, min(pn, n - rank * pn))
        if held:
            real.append((offset, offset + held))
        offset += pn
    return shards, buf, tuple(real)


__all__ = ["MASTER", "SENTINEL_BITS", "FlatBuffer", "FlatGroups", "FlatTargets", "flat_targets", "from_records",
           "sentinel"]
