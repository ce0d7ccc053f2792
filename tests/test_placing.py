"""Format v2's write plan (``saving.placing``), pure: which tensors are placed, who writes what.

Fed the ``RankState`` messages ``describe`` makes of DTensors, without processes."""

from __future__ import annotations

import pytest
import torch

from shardfmt.errors import StateDictError
from shardfmt.format.manifest import Placement, Topology
from shardfmt.layout.dtensor import placement_record
from shardfmt.layout.geometry import Box
from shardfmt.layout.topology import Layout, Mesh, Replicate, Shard, StridedShard, held_boxes
from shardfmt.saving.claims import claims_digest, first_of_groups, split_claims
from shardfmt.saving.messages import HeldTensor, RankState
from shardfmt.saving.placing import plan_placed, rank_writes
from shardfmt.saving.plan import my_items
from shardfmt.saving.protocol import summary_of

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
        for it in my_items(s, pieces, rank_writes(plan.placed, plan.listed, s, TOPOLOGY), rank=s.rank):
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


def test_a_plain_tensor_every_rank_holds_whole_is_placed_as_a_replica_and_written_once():
    states = [RankState(rank=r, tensors=(HeldTensor(fqn="step", dtype="F32", shape=(), boxes=(Box((), ()),)),))
              for r in range(8)]
    plan = plan_placed(states, TOPOLOGY)
    assert plan.placed["step"].placement == Placement()
    assert plan.listed == {}
    assert list(_written(states, plan).values()) == [plan.placed["step"].writer % 8]


def test_a_plain_tensor_some_ranks_hold_is_listed_and_written_once():
    states = [RankState(rank=r, tensors=(HeldTensor(fqn="step", dtype="F32", shape=(), boxes=(Box((), ()),)),)
                        if r in (2, 5) else ()) for r in range(8)]
    plan = plan_placed(states, TOPOLOGY)
    assert plan.placed == {}
    assert plan.records["step"].placement is None  # the root lists it without a placement, as the rank held it
    assert list(_written(states, plan).values()) == [2]


PP_MESH = Mesh.parse("pp=2,dp=2,tp=2")
PP_TOPOLOGY = Topology(world_size=8, mesh=PP_MESH.dims)


def _stage_states() -> list[RankState]:
    """Each pipeline stage holds its own layer, laid out over (dp, tp) only (no stage named)."""
    lay = Layout(("dp", "tp"), (Shard(0), Shard(1)))
    out = []
    for r in range(8):
        coords = PP_MESH.coords(r)
        fqn = f"layers.{coords['pp']}.w"
        boxes = tuple(hb.box for hb in held_boxes((8, 8), lay, coords, dict(PP_MESH.dims)))
        out.append(RankState(rank=r, tensors=(HeldTensor(fqn=fqn, dtype="F32", shape=(8, 8),
                                                         placement=placement_record(lay), boxes=boxes),)))
    return out


def test_a_tensor_one_pipeline_stage_holds_is_placed_with_that_stage_from_one_claim_list_per_stage():
    states = _stage_states()
    plan = plan_placed(states, PP_TOPOLOGY)
    assert {f: p.placement.stage for f, p in plan.placed.items()} == {"layers.0.w": 0, "layers.1.w": 1}
    got = _written_pp(states, plan)
    assert sorted(got.values()) == list(range(8))  # no replicas: every rank writes its own box


def _written_pp(states, plan) -> dict[tuple, int]:
    got = {}
    for s in states:
        pieces = {t.fqn: [(b, torch.empty(0)) for b in t.boxes] for t in s.tensors}
        for it in my_items(s, pieces, rank_writes(plan.placed, plan.listed, s, PP_TOPOLOGY), rank=s.rank):
            got[(it.fqn, it.box.offsets, it.box.lengths)] = s.rank
    return got


def test_a_stage_whose_ranks_do_not_all_hold_the_tensor_lists_it():
    states = _stage_states()
    states[5] = RankState(rank=5)  # a rank of stage 1 holds nothing: its box would be lost if placed
    plan = plan_placed(states, PP_TOPOLOGY)
    assert list(plan.placed) == ["layers.0.w"]
    assert {k[0] for k in plan.listed} == {"layers.1.w"}
    assert 5 not in plan.listed.values()


def test_ranks_that_disagree_on_a_dtype_fail_the_plan_naming_the_tensor():
    states = [RankState(rank=r, tensors=(HeldTensor(fqn="step", dtype="F32" if r != 6 else "F64", shape=(),
                                                    boxes=(Box((), ()),)),)) for r in range(8)]
    with pytest.raises(StateDictError, match="step: ranks disagree on dtype/shape"):
        plan_placed(states, TOPOLOGY)


def test_a_rank_that_is_not_first_of_its_group_sends_no_claims():
    tensors = {"wo": ((16, 64), Layout(("dp", "tp"), (Shard(0), Shard(1))))}
    states = _states(tensors)
    split = [split_claims(s, TOPOLOGY) for s in states]
    groups = first_of_groups([claims_digest(c) for c, _ in split])
    assert groups == {0: tuple(range(8))}
    summaries = [summary_of(s, c, ls, groups=groups, differing=frozenset()) for s, (c, ls) in zip(states, split)]
    assert summaries[0].claims is not None and all(s.claims is None and not s.listed for s in summaries[1:])
