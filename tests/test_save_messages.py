"""The typed messages ranks exchange during a save: they round-trip through their wire form, and a
record another rank sends is checked as the manifest's parsers check a manifest's."""

import orjson
import pytest
import torch

import shardfmt
from shardfmt.errors import ManifestError, ShardfmtError
from shardfmt.layout.geometry import Box
from shardfmt.saving.coordinator import LocalCoordinator
from shardfmt.saving.describe import describe
from shardfmt.saving.messages import RankError, RankState, Written, envelope, open_envelope
from shardfmt.saving.plan import assign_writers
from shardfmt.saving.shard_file import ShardData, write_shard_file


def _wire(rank, msg, decode):
    return open_envelope(orjson.loads(orjson.dumps(envelope(rank, msg))), decode)


def test_a_rank_state_round_trips_with_views_aliases_values_and_placements():
    base, w = torch.arange(12.0), torch.ones(3)
    st = shardfmt.ShardedTensor(torch.ones(2, 4), (4, 4), (2, 0))
    state, _ = describe({"a": base[:6], "b": base[6:], "w": w, "tied": w, "s": st, "v": {"x": (1, 2)},
                         "r": shardfmt.PerRank(3)}, rank=1)
    back = _wire(1, state, RankState.from_json)
    assert back == state
    assert back.aliases == {"w": "tied"} or back.aliases == {"tied": "w"}
    assert set(back.views) == {"a", "b"} and back.views["b"].view.storage_offset == 6
    assert {t.fqn for t in back.tensors} == {"s", ".storage.a", "tied" if "w" in back.aliases else "w"}
    assert back.values == {"v": state.values["v"]} and back.per_rank == {"r": 3}


def test_a_file_record_from_another_rank_is_validated_like_a_manifest(tmp_path):
    from shardfmt.io.registry import get_storage

    storage, root = get_storage(str(tmp_path), None)
    (tmp_path / "data").mkdir()
    w = torch.arange(8.0)
    file = write_shard_file(storage, root, "data/rank_00001.safetensors", 1,
                            [ShardData(fqn="w", data=w[4:], global_shape=(8,), offsets=(4,))], chunk_size=4096)
    state, _ = describe({"w": shardfmt.ShardedTensor(w[4:], (8,), (4,))}, rank=1)
    records = {t.fqn: t.record() for t in state.tensors}
    assert _wire(1, Written(file=file), Written.decoder(records)) == Written(file=file)
    wire = orjson.loads(orjson.dumps(envelope(1, Written(file=file))))
    wire["body"]["file"]["shards"][0][1]["byte_range"][1] += 4  # claims a 5th element
    with pytest.raises(ManifestError, match="byte_range"):
        open_envelope(wire, Written.decoder(records))
    wire = orjson.loads(orjson.dumps(envelope(1, Written(file=file))))
    wire["body"]["file"]["name"] = "../escape.safetensors"
    with pytest.raises(ManifestError, match="data/<name>.safetensors"):
        open_envelope(wire, Written.decoder(records))


def test_a_box_outside_the_tensor_is_refused():
    state, _ = describe({"w": shardfmt.ShardedTensor(torch.ones(2), (4,), (2,))}, rank=0)
    wire = orjson.loads(orjson.dumps(envelope(0, state)))
    wire["body"]["tensors"][0]["boxes"][0][0] = [3]
    with pytest.raises(ShardfmtError, match="outside the shape"):
        open_envelope(wire, RankState.from_json)


def test_a_failure_crosses_the_wire_by_name_and_stays_itself_locally():
    err = shardfmt.errors.StateDictError("w: bad")
    msg = RankError.of(2, err)
    assert _wire(2, msg, RankState.from_json) == RankError(rank=2, kind="StateDictError", message="w: bad")
    with pytest.raises(shardfmt.errors.StateDictError) as got:
        LocalCoordinator().raise_failures([msg], "describing the state")
    assert got.value is err


def test_each_distinct_box_is_written_once_by_the_least_loaded_holder():
    def holding(rank, *boxes):
        state, _ = describe({"w": shardfmt.ShardedTensor(torch.ones(2), (4,), boxes[0])}, rank=rank)
        return state
    states = [holding(0, (0,)), holding(1, (0,)), holding(2, (2,))]
    assert assign_writers(states) == {("w", (0,), (2,)): 0, ("w", (2,), (2,)): 2}
    assert Box((0,), (2,)) in states[1].tensors[0].boxes
