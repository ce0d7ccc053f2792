"""Format v2's write plan (``saving.placing``), pure: which tensors are placed, who writes what.

Fed the ``RankState`` messages ``describe`` makes of DTensors, without processes."""

from __future__ import annotations

import torch

from shardfmt.format.manifest import Topology
from shardfmt.layout.dtensor import placement_record
from shardfmt.layout.geometry import Box
from shardfmt.layout.topology import Layout, Mesh, Replicate, Shard, StridedShard, held_boxes
from shardfmt.saving.messages import HeldTensor, RankState
from shardfmt.saving.placing import plan_placed
from shardfmt.saving.plan import my_items

MESH = Mesh.parse("dp=4,tp=2")
TOPOLOGY = Topology(world_size=8, mesh=MESH.dims)


def _states(tensors: dict[str, tuple[tuple[int, ...], Layout]], *, skew: int | None = None) -> list[RankState]:
    out = []
    for r in range(MESH.world_size):
        coords = MESH.coords(r)
        held = []
        for fqn, (shape, lay) in tensors.items():
            boxes = tuple(hb.box for hb in held_boxes(shape, lay, coords, dict(MESH.dims)))
            if skew == r:  # a rank that reports another placement than the others (its mesh permuted)
                lay = Layout(lay.mesh_dims, tuple(reversed(lay.placements)))
            held.append(HeldTensor(fqn=fqn, dtype="F32", shape=shape, placement=placement_record(lay), boxes=boxes))
        out.append(RankState(rank=r, tensors=tuple(held)))
    return out


def _written(states, plan) -> dict[tuple, int]:
    got = {}
    for s in states:
        pieces = {t.fqn: [(b, torch.empty(0)) for b in t.boxes] for t in s.tensors}
        for it in my_items(s, pieces, plan.writers, rank=s.rank):
            key = (it.fqn, it.box.offsets, it.box.lengths)
            assert key not in got, f"{key} written twice"
            got[key] = s.rank
    return got


def test_dtensor_layouts_are_placed_and_every_box_is_written_once():
    tensors = {"wq": ((64, 16), Layout(("dp", "tp"), (StridedShard(0, 2), Shard(0)))),
               "wo": ((16, 64), Layout(("dp", "tp"), (Shard(0), Shard(1)))),
               "norm": ((16,), Layout(("dp", "tp"), (Shard(0), Replicate())))}
    states = _states(tensors)
    plan = plan_placed(states, TOPOLOGY)
    assert set(plan.placed) == set(tensors)
    got = _written(states, plan)
    for fqn, (shape, _) in tensors.items():
        assert sum(torch.Size(k[2]).numel() for k in got if k[0] == fqn) == torch.Size(shape).numel()
    # the replicated norm: each of its 4 boxes written once, by one member of its tp pair
    assert sorted(r // 2 for k, r in got.items() if k[0] == "norm") == [0, 1, 2, 3]


def test_a_short_dim_leaves_empty_boxes_that_nobody_writes():
    """1024 ranks of FSDP over a 1024-row tensor split 8 ways first: most ranks hold no row. A
    v2 plan stores no empty box, and a rank holding one writes nothing for it (found at N=4096)."""
    tensors = {"wk": ((3, 8), Layout(("dp", "tp"), (StridedShard(0, 2), Shard(0))))}
    states = _states(tensors)
    assert any(b.is_empty() for s in states for t in s.tensors for b in t.boxes)
    plan = plan_placed(states, TOPOLOGY)
    assert "wk" in plan.placed
    got = _written(states, plan)
    assert all(torch.Size(k[2]).numel() for k in got)
    assert sum(torch.Size(k[2]).numel() for k in got) == 24


def test_a_rank_that_does_not_hold_what_its_placement_says_makes_the_tensor_listed():
    tensors = {"wo": ((16, 64), Layout(("dp", "tp"), (Shard(0), Shard(1))))}
    states = _states(tensors, skew=3)
    plan = plan_placed(states, TOPOLOGY)
    assert plan.placed == {}
    got = _written(states, plan)
    assert sum(torch.Size(k[2]).numel() for k in got) >= 16 * 64


def test_plain_tensors_without_a_placement_are_listed_and_written_once():
    states = [RankState(rank=r, tensors=(HeldTensor(fqn="step", dtype="F32", shape=(), boxes=(Box((), ()),)),))
              for r in range(8)]
    plan = plan_placed(states, TOPOLOGY)
    assert plan.placed == {}
    assert list(_written(states, plan).values()) == [0]
