"""Property: v2 placed tensors — who stores which box — agree with visiting every rank.

The reference enumerates every rank's held boxes (``shardfmt.layout.topology.held_boxes``),
keeps the non-empty ones, groups ranks holding the same set, and lets member ``k mod size``
of each group (sorted by rank) write it. ``shardfmt.layout.placed`` must find the same
writers and boxes without that loop: a world of 2^24 ranks answers at once, and a rank of an
8B load at 4096 ranks looks up its 1164 tensors in well under a second.
"""

from __future__ import annotations

import collections
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfmt.layout.geometry import Box, intersect
from shardfmt.layout.placed import SavedPiece, check_placed, saved_pieces, writer_rank, written_by
from shardfmt.layout.tiling import tiling_problems
from shardfmt.layout.topology import (
    Flat,
    Layout,
    Mesh,
    Replicate,
    Shard,
    StridedShard,
    TopologyError,
    chunk_range,
    held_boxes,
)


def stored_boxes(shape, layout: Layout, mesh: Mesh, writer: int) -> dict[Box, int]:
    """Every stored box -> its writer rank, by visiting every rank (the reference)."""
    groups: dict[frozenset, list[int]] = collections.defaultdict(list)
    for r in range(mesh.world_size):
        boxes = [hb.box for hb in held_boxes(shape, layout, mesh.coords(r), dict(mesh.dims)) if not hb.box.is_empty()]
        if boxes:
            groups[frozenset(boxes)].append(r)
    out: dict[Box, int] = {}
    for boxes, ranks in groups.items():
        for b in boxes:
            assert b not in out, f"box {b} held by two groups"
            out[b] = sorted(ranks)[writer % len(ranks)]
    return out


@st.composite
def placed_cases(draw):
    ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 2, 3, 3]))
    shape = tuple(draw(st.sampled_from([0] + [1, 2, 3, 4, 5, 6, 7, 8] * 3)) for _ in range(ndim))  # 0: 1 in 25
    names = draw(st.lists(st.sampled_from(["pp", "dp", "tp", "cp"]), min_size=1, max_size=3, unique=True))
    mesh = Mesh(tuple((n, draw(st.integers(1, 4))) for n in names))
    used = [n for n in draw(st.permutations(names)) if draw(st.integers(0, 3))]  # most mesh dims listed
    places = []
    for _ in used:
        kinds = ["replicate"] + (["shard", "strided", "strided"] if ndim else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "replicate":
            places.append(Replicate())
        elif kind == "shard":
            places.append(Shard(draw(st.integers(0, ndim - 1))))
        else:
            places.append(StridedShard(draw(st.integers(0, ndim - 1)), draw(st.integers(1, 3))))
    pp = dict(mesh.dims).get("pp", 1)
    stage = draw(st.none() | st.integers(0, pp))  # pp itself: a stage no rank is at
    if "pp" in used and not isinstance(places[used.index("pp")], Replicate):
        stage = None  # a stage dim that shards the tensor is refused (see test_bad_placements...)
    writer = draw(st.integers(0, 20))
    offsets = [draw(st.integers(0, n)) for n in shape]
    ends = [draw(st.integers(o, n)) for n, o in zip(shape, offsets)]
    want = Box.full(shape) if draw(st.booleans()) else Box(tuple(offsets), tuple(e - o for o, e in zip(offsets, ends)))
    return shape, Layout(tuple(used), tuple(places), stage=stage), mesh, writer, want


@st.composite
def flat_cases(draw):
    """A ``Flat`` entry (ZeRO) last, after shard or replicate entries, its pieces just long
    enough (or longer) to reach the last element of the largest box the shards leave."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    names = draw(st.lists(st.sampled_from(["pp", "dp", "tp", "cp"]), min_size=1, max_size=3, unique=True))
    mesh = Mesh(tuple((n, draw(st.integers(1, 4))) for n in names))
    order = draw(st.permutations(names))
    flat_dim, before = order[-1], [n for n in order[:-1] if draw(st.booleans())]
    places = [draw(st.sampled_from([Replicate(), Shard(draw(st.integers(0, ndim - 1)))])) for _ in before]
    largest = list(shape)
    for n, p in zip(before, places):
        if isinstance(p, Shard):
            largest[p.dim] = chunk_range(largest[p.dim], mesh.size(n), 0)[1]
    numel, k = math.prod(largest), mesh.size(flat_dim)
    offset = draw(st.integers(0, 5))
    part = max(1, -(-(offset + numel) // k)) + draw(st.integers(0, 2))
    used, places = [*before, flat_dim], [*places, Flat(offset, part)]
    if draw(st.booleans()):  # a replicate entry may follow the flat one
        rest = [n for n in names if n not in used]
        if rest:
            used, places = [*used, rest[0]], [*places, Replicate()]
    writer = draw(st.integers(0, 20))
    offsets = [draw(st.integers(0, n)) for n in shape]
    ends = [draw(st.integers(o, n)) for n, o in zip(shape, offsets)]
    want = Box.full(shape) if draw(st.booleans()) else Box(tuple(offsets), tuple(e - o for o, e in zip(offsets, ends)))
    layout = Layout(tuple(used), tuple(places))
    check_placed(shape, layout, mesh, writer=writer)
    return shape, layout, mesh, writer, want


def cases():
    return st.one_of(placed_cases(), flat_cases())


@settings(max_examples=examples(600), deadline=None)
@given(case=cases())
def test_saved_pieces_are_the_stored_boxes_a_box_overlaps(case):
    shape, layout, mesh, writer, want = case
    stored = stored_boxes(shape, layout, mesh, writer)
    pieces = saved_pieces(shape, layout, mesh.dims, writer=writer, box=want)
    expect = {(r, b) for b, r in stored.items() if intersect(b, want) is not None}
    assert {(p.rank, p.box) for p in pieces} == expect
    assert len(pieces) == len(expect)
    assert all(p.overlap == intersect(p.box, want) for p in pieces)
    if stored:  # someone holds the tensor: the pieces tile the requested box exactly
        assert tiling_problems([p.overlap for p in pieces], want) == []
    assert [p.box.offsets for p in pieces] == sorted(p.box.offsets for p in pieces)


@settings(max_examples=examples(400), deadline=None)
@given(case=cases())
def test_every_stored_box_is_written_once_by_its_writer(case):
    shape, layout, mesh, writer, _ = case
    stored = stored_boxes(shape, layout, mesh, writer)
    written = [(r, hb.box) for r in range(mesh.world_size)
               for hb in written_by(shape, layout, mesh, writer=writer, rank=r)]
    assert sorted(written, key=repr) == sorted(((r, b) for b, r in stored.items()), key=repr)
    whole = saved_pieces(shape, layout, mesh, writer=writer, box=Box.full(shape))
    assert {(p.rank, p.box) for p in whole} == set(written)
    if stored:
        assert tiling_problems(list(stored), Box.full(shape)) == []


@settings(max_examples=examples(300), deadline=None)
@given(case=cases())
def test_writer_rank_names_the_writer_of_the_ranks_group(case):
    shape, layout, mesh, writer, _ = case
    stored = stored_boxes(shape, layout, mesh, writer)
    for r in range(mesh.world_size):
        w = writer_rank(shape, layout, mesh, writer=writer, coords_or_rank=r)
        assert w == writer_rank(shape, layout, mesh, writer=writer, coords_or_rank=mesh.coords(r))
        boxes = [hb.box for hb in held_boxes(shape, layout, mesh.coords(r), dict(mesh.dims))]
        if not boxes:  # another stage
            assert w is None
            continue
        assert writer_rank(shape, layout, mesh, writer=writer, coords_or_rank=w) == w
        assert held_boxes(shape, layout, mesh.coords(w), dict(mesh.dims)) == held_boxes(
            shape, layout, mesh.coords(r), dict(mesh.dims))
        for b in boxes:
            if not b.is_empty():
                assert stored[b] == w


def test_spec_example_and_edge_cases():
    mesh = (("dp", 2), ("tp", 2))
    fsdp_tp = Layout(("dp", "tp"), (StridedShard(0, 2), Shard(0)))
    got = saved_pieces((8, 4), fsdp_tp, mesh, writer=0, box=Box((3, 1), (2, 2)))
    assert got == (SavedPiece(rank=2, box=Box((2, 0), (2, 4)), overlap=Box((3, 1), (1, 2))),
                   SavedPiece(rank=1, box=Box((4, 0), (2, 4)), overlap=Box((4, 1), (1, 2))))
    assert saved_pieces((8, 4), fsdp_tp, dict(mesh), writer=0, box=Box((3, 1), (2, 2))) == got
    assert saved_pieces((8, 4), fsdp_tp, Mesh.parse("dp=2,tp=2"), writer=0, box=Box((3, 1), (2, 2))) == got
    # a 0-d tensor: one box, one element, written by member k mod 4 of the whole world
    assert saved_pieces((), Layout((), ()), mesh, writer=6, box=Box((), ())) == (
        SavedPiece(rank=2, box=Box((), ()), overlap=Box((), ())),)
    assert [hb.box for hb in written_by((), Layout((), ()), mesh, writer=6, rank=2)] == [Box((), ())]
    # no elements: nothing stored, nothing to read
    assert saved_pieces((0, 4), fsdp_tp, mesh, writer=0, box=Box((0, 0), (0, 4))) == ()
    assert all(written_by((0, 4), fsdp_tp, mesh, writer=0, rank=r) == () for r in range(4))
    assert saved_pieces((8, 4), fsdp_tp, mesh, writer=0, box=Box((2, 0), (3, 0))) == ()
    # a stage: only pp=1 holds it; pp is neither a replica dim nor a coordinate of the group
    staged = Layout(("tp",), (Shard(1),), stage=1)
    pp = (("pp", 2), ("dp", 3), ("tp", 2))
    assert [(p.rank, p.box) for p in saved_pieces((2, 4), staged, pp, writer=4, box=Box((0, 0), (2, 4)))] == [
        (6 + 2, Box((0, 0), (2, 2))), (6 + 2 + 1, Box((0, 2), (2, 2)))]
    assert writer_rank((2, 4), staged, pp, writer=4, coords_or_rank={"pp": 0, "dp": 1, "tp": 1}) is None
    assert saved_pieces((2, 4), Layout((), (), stage=2), pp, writer=0, box=Box((0, 0), (2, 4))) == ()


@pytest.mark.parametrize("layout, writer, message", [
    (Layout(("ep",), (Shard(0),)), 0, "'ep' is not a dim of the mesh"),
    (Layout(("ep",), (Replicate(),)), 0, "'ep' is not a dim of the mesh"),
    (Layout(("dp", "dp"), (Shard(0), Shard(1))), 0, "'dp' is used twice"),
    (Layout(("dp", "dp"), (Replicate(), Replicate())), 0, "'dp' is used twice"),
    (Layout(("tp",), (Shard(2),)), 0, "shards tensor dim 2, outside a 2-d tensor"),
    (Layout(("tp",), (StridedShard(0, 0),)), 0, "split factor 0"),
    (Layout(("tp",), (Shard(0),), stage=-1), 0, "stage -1"),
    (Layout(("tp", "pp"), (Shard(0), StridedShard(1, 2)), stage=0), 0, "'pp' picks the stage and also shards"),
    (Layout(("tp",), (Shard(0),)), -1, "writer -1"),
    (Layout(("tp",), (Shard(0),)), True, "writer True"),
    (Layout(("tp",), (Shard(0),)), 1.0, "writer 1.0"),
    (Layout(("dp", "tp"), (Flat(0, 16), Shard(1))), 0, "flat entry must be the only one and come after"),
    (Layout(("dp", "tp"), (Flat(0, 16), Flat(0, 16))), 0, "flat entry must be the only one"),
    (Layout(("tp", "dp"), (StridedShard(0, 2), Flat(0, 16))), 0, "cannot follow a strided shard"),
    (Layout(("dp",), (Flat(0, 15),)), 0, "2 pieces of 15 elements from offset 0 do not reach the last of 32"),
    (Layout(("tp", "dp"), (Shard(1), Flat(1, 8))), 0, "2 pieces of 8 elements from offset 1 do not reach the last of 16"),
    (Layout(("dp",), (Flat(0, 0),)), 0, "part 0"),
])
def test_bad_placements_raise_topology_errors(layout, writer, message):
    mesh = (("pp", 2), ("dp", 2), ("tp", 2))
    with pytest.raises(TopologyError, match=message):
        check_placed((8, 4), layout, mesh, writer=writer)
    with pytest.raises(TopologyError, match=message):
        saved_pieces((8, 4), layout, mesh, writer=writer, box=Box((0, 0), (8, 4)))
    with pytest.raises(TopologyError, match=message):
        written_by((8, 4), layout, mesh, writer=writer, rank=0)
    with pytest.raises(TopologyError, match=message):
        writer_rank((8, 4), layout, mesh, writer=writer, coords_or_rank=0)


@pytest.mark.parametrize("box, message", [(Box((0,), (8,)), "not a 2-d Box"),
                                          (Box((4, 0), (5, 4)), "not inside shape"),
                                          (Box((-1, 0), (2, 4)), "not inside shape")])
def test_a_box_outside_the_tensor_raises_a_topology_error(box, message):
    layout = Layout(("dp", "tp"), (Shard(0), Replicate()))
    with pytest.raises(TopologyError, match=message):
        saved_pieces((8, 4), layout, (("dp", 2), ("tp", 2)), writer=0, box=box)


def test_meshes_that_do_not_name_ranks_raise_topology_errors():
    layout = Layout(("tp",), (Shard(0),))
    with pytest.raises(TopologyError, match="repeats a dim name"):
        check_placed((8,), layout, (("tp", 2), ("tp", 2)), writer=0)
    with pytest.raises(TopologyError, match="every size must be >= 1"):
        check_placed((8,), layout, (("tp", 0),), writer=0)
    with pytest.raises(TopologyError, match="outside a mesh of 2 ranks"):
        writer_rank((8,), layout, (("tp", 2),), writer=0, coords_or_rank=2)
    with pytest.raises(TopologyError, match="do not name a rank"):
        writer_rank((8,), layout, (("tp", 2),), writer=0, coords_or_rank={"tp": 2})


# ---- scale: a Llama-3-8B state (1164 tensors) saved FSDP2-over-TP at 4096 ranks ----

def llama8b(*, dp: str = "dp", tp_save: int = 8, stages: int = 0):
    """(fqn, shape, layout) of a Llama-3-8B's parameters and Adam state (1164 tensors), FSDP2
    over TP: column-parallel weights strided over dp, row-parallel ones sharded on dim 0."""
    col = Layout((dp, "tp"), (StridedShard(0, tp_save), Shard(0)))
    row = Layout((dp, "tp"), (Shard(0), Shard(1)))
    norm = Layout((dp, "tp"), (Shard(0), Replicate()))
    params = [("tok_embeddings.weight", (128256, 4096), col, 0)]
    for i in range(32):
        stage = i * stages // 32 if stages else None
        for name, shape, lay in [("attention.wq", (4096, 4096), col), ("attention.wk", (1024, 4096), col),
                                 ("attention.wv", (1024, 4096), col), ("attention.wo", (4096, 4096), row),
                                 ("feed_forward.w1", (14336, 4096), col), ("feed_forward.w3", (14336, 4096), col),
                                 ("feed_forward.w2", (4096, 14336), row), ("attention_norm", (4096,), norm),
                                 ("ffn_norm", (4096,), norm)]:
            params.append((f"layers.{i}.{name}.weight", shape, lay, stage))
    params += [("norm.weight", (4096,), norm, stages - 1), ("output.weight", (128256, 4096), col, stages - 1)]
    out = []
    for fqn, shape, lay, stage in params:
        lay = Layout(lay.mesh_dims, lay.placements, stage=stage if stages else None)
        out += [(f"model.{fqn}", shape, lay), (f"optim.{fqn}.exp_avg", shape, lay),
                (f"optim.{fqn}.exp_avg_sq", shape, lay), (f"optim.{fqn}.step", (), Layout((), (), stage=lay.stage))]
    return out


def load_targets(tensors, *, dp: int, tp: int, rank: int) -> list[Box]:
    """The box each tensor's load rank wants at dp x tp (FSDP2 over TP, as saved): one each."""
    mesh = Mesh((("dp", dp), ("tp", tp)))
    out = []
    for _, shape, saved in tensors:
        lay = Layout(saved.mesh_dims, tuple(StridedShard(p.dim, tp) if isinstance(p, StridedShard) else p
                                            for p in saved.placements))
        (hb,) = held_boxes(shape, lay, mesh.coords(rank), dict(mesh.dims))
        out.append(hb.box)
    return out


def timed_lookups(tensors, mesh, targets) -> tuple[float, int]:
    t = time.process_time()
    n = 0
    for i, ((_, shape, lay), want) in enumerate(zip(tensors, targets)):
        n += len(saved_pieces(shape, lay, mesh, writer=i, box=want))
    return time.process_time() - t, n


def test_a_world_of_2_24_ranks_answers_without_visiting_them():
    mesh = (("dp", 1 << 21), ("tp", 8))
    col = Layout(("dp", "tp"), (StridedShard(0, 8), Shard(0)))
    got = saved_pieces((14336, 4096), col, mesh, writer=5, box=Box((1792 * 3 + 1000, 7), (2, 9)))
    assert [(p.rank, p.box) for p in got] == [((1000 << 3) + 3, Box((1792 * 3 + 1000, 0), (1, 4096))),
                                              ((1001 << 3) + 3, Box((1792 * 3 + 1001, 0), (1, 4096)))]
    norm = Layout(("dp", "tp"), (Shard(0), Replicate()))  # replicated over tp: tp member 5 % 8 writes
    assert [(p.rank, p.box) for p in saved_pieces((4096,), norm, mesh, writer=13, box=Box((4095,), (1,)))] == [
        ((4095 << 3) + 5, Box((4095,), (1,)))]


@pytest.mark.slow
@pytest.mark.parametrize("save_mesh, stages", [((("dp", 512), ("tp", 8)), 0),
                                               ((("dp", 32), ("pp", 16), ("tp", 8)), 16)])
def test_one_rank_of_an_8b_load_finds_its_pieces_fast(save_mesh, stages):
    """A rank of a dp=1024 x tp=4 load looks up all 1164 tensors of a 4096-rank save: measured
    0.03 s CPU on the 2-core dev box, caches cold; visiting the 4096 ranks per tensor (the
    reference above) took 53-99 s, a loop that only computes each rank's coordinates 14 s."""
    tensors = llama8b(stages=stages)
    assert len(tensors) == 1164
    targets = load_targets(tensors, dp=1024, tp=4, rank=1024 * 4 // 3 + 1)
    took, pieces = timed_lookups(tensors, save_mesh, targets)
    assert pieces == len(tensors)  # this rank's 4-row boxes each lie inside one stored box
    assert took < 0.5, f"{took:.2f} s CPU for 1164 lookups ({pieces} pieces)"
