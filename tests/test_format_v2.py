"""Format version 2 on one process: the files a save leaves, what a load reads of them, and the
edits of a hostile author each refused with its own error (spec/FORMAT.md sections 4.2, 9, 11)."""

from __future__ import annotations

import json
import os

import orjson
import pytest
import torch

import shardfmt
from shardfmt import ShardedTensor, errors
from shardfmt.format import hashing


def _state():
    torch.manual_seed(0)
    base = torch.arange(40, dtype=torch.float32)
    sd = {"w": torch.randn(64, 48), "b": torch.arange(7, dtype=torch.int16), "s": torch.tensor(2.5),
          "e": torch.zeros(0, 4), "bf": torch.randn(5, 3).bfloat16(), "step": 7, "cfg": {"lr": 0.5},
          "va": base[0:30], "vb": base[10:40].view(5, 6)}
    sd["tied"] = sd["w"]
    return sd


def _targets():
    return {"w": torch.zeros(64, 48), "b": torch.zeros(7, dtype=torch.int16), "s": torch.tensor(0.0),
            "e": torch.zeros(0, 4), "bf": torch.zeros(5, 3).bfloat16(), "step": 0, "cfg": None,
            "va": torch.zeros(30), "vb": torch.zeros(5, 6), "tied": torch.zeros(64, 48)}


@pytest.fixture()
def ck(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save(_state(), path, step=3, chunk_size=4096)
    return path


def _read_json(path, name):
    with open(os.path.join(path, name), "rb") as f:
        return orjson.loads(f.read())


def _write_json(path, name, obj) -> bytes:
    raw = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"
    with open(os.path.join(path, name), "wb") as f:
        f.write(raw)
    return raw


def test_a_v2_checkpoint_holds_a_root_a_rank_table_and_rank_indexes(ck):
    root = _read_json(ck, "manifest.json")
    assert root["format_version"] == 2 and "files" not in root and "ranks" not in root["topology"]
    assert _read_json(ck, "COMMITTED")["format_version"] == 2
    assert sorted(os.listdir(os.path.join(ck, "index"))) == ["rank_00000.json", "ranks_00000000.json"]
    assert root["ranks"] == [{"first": 0, "end": 1, "name": "index/ranks_00000000.json",
                              "size": os.path.getsize(os.path.join(ck, "index", "ranks_00000000.json")),
                              "digest": root["ranks"][0]["digest"]}]
    index = _read_json(ck, "index/rank_00000.json")
    assert list(index["files"]) == ["data/rank_00000.safetensors"]
    assert all(set(r) <= {"dtype", "shape", "shards", "alias_of", "view", "placement"} for r in root["tensors"].values())
    assert root["tensors"]["w"] == {"alias_of": "tied", "dtype": "F32", "shape": [64, 48]} or \
        root["tensors"]["tied"] == {"alias_of": "w", "dtype": "F32", "shape": [64, 48]}


def test_round_trip_is_bit_exact_and_validates_deep(ck):
    out = _targets()
    rep = shardfmt.load(out, ck)
    want = _state()
    for k, v in want.items():
        assert (torch.equal(out[k], v) if torch.is_tensor(v) else out[k] == v), k
    assert rep.metadata_reads >= 3  # the rank-table part, the rank index, the header
    assert shardfmt.validate(ck, deep=True).ok


def test_hash_chunks_are_aligned_to_each_shard_and_shard_digests_are_content_addresses(tmp_path):
    """The same tensor bytes give the same shard digest wherever they sit in a file."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    x = torch.randn(3000)
    shardfmt.save({"x": x}, a, chunk_size=4096)
    shardfmt.save({"x": x, "aaa": torch.randn(123)}, b, chunk_size=4096)  # "aaa" sorts first in the file
    da = shardfmt.read_manifest(a).tensors["x"].shards[0].digest
    db = shardfmt.read_manifest(b).tensors["x"].shards[0].digest
    assert da == db
    m = shardfmt.read_manifest(b)
    f = m.files["data/rank_00000.safetensors"]
    grid = f.grid(m.chunk_size)
    assert grid.chunked_from == f.header_size
    for s in m.tensors["x"].shards + m.tensors["aaa"].shards:
        assert grid.widen(*s.byte_range) == s.byte_range  # no chunk crosses a shard's edge


def test_a_verified_slice_reads_about_what_it_needs(tmp_path):
    """Shard-aligned 4 KiB chunks: reading 1/8 of a tensor reads under 1.1x its bytes + 2 chunks."""
    path = str(tmp_path / "ck")
    w = torch.randn(1024, 256)
    shardfmt.save({"w": w, "a": torch.randn(777)}, path, chunk_size=4096)
    local = torch.empty(128, 256)
    rep = shardfmt.load({"w": ShardedTensor(local, (1024, 256), (512, 0))}, path, strict=False)
    assert torch.equal(local, w[512:640])
    assert rep.bytes_read <= 1.1 * rep.bytes_needed + 2 * 4096


def test_per_rank_values_live_in_their_rank_index(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"rng": shardfmt.PerRank({"seed": 11}), "w": torch.ones(2)}, path)
    assert _read_json(path, "manifest.json")["values"]["rng"] == {"per_rank": True}
    assert _read_json(path, "index/rank_00000.json")["values"] == {"rng": {"seed": 11}}
    out = {"rng": shardfmt.PerRank(None), "w": torch.zeros(2)}
    shardfmt.load(out, path)
    assert out["rng"].value == {"seed": 11}
    assert shardfmt.read_manifest(path).values["rng"].per_rank == {0: {"seed": 11}}


def test_v1_stays_writable_and_readable(tmp_path):
    path = str(tmp_path / "v1")
    shardfmt.save(_state(), path, format_version=1)
    root = _read_json(path, "manifest.json")
    assert root["format_version"] == 1 and "files" in root and not os.path.exists(os.path.join(path, "index"))
    assert "format_version" not in _read_json(path, "COMMITTED")
    out = _targets()
    shardfmt.load(out, path)
    assert all(torch.equal(out[k], v) if torch.is_tensor(v) else out[k] == v for k, v in _state().items())
    assert shardfmt.validate(path, deep=True).ok


# ----------------------------------------------------------------------------- hostile edits


def _resign_root(path, edit):
    """Edit the root manifest and re-sign COMMITTED, as a hostile author would."""
    root = _read_json(path, "manifest.json")
    edit(root)
    raw = _write_json(path, "manifest.json", root)
    commit = _read_json(path, "COMMITTED")
    commit["manifest_digest"] = hashing.digest_bytes(raw)
    _write_json(path, "COMMITTED", commit)


def _resign_index(path, edit):
    """Edit rank 0's index and re-sign the rank table and the root (every digest consistent)."""
    index = _read_json(path, "index/rank_00000.json")
    edit(index)
    raw = _write_json(path, "index/rank_00000.json", index)
    part = _read_json(path, "index/ranks_00000000.json")
    part["ranks"]["0"].update(size=len(raw), digest=hashing.digest_bytes(raw))
    praw = _write_json(path, "index/ranks_00000000.json", part)
    _resign_root(path, lambda r: r["ranks"][0].update(size=len(praw), digest=hashing.digest_bytes(praw)))


def _load(path, **kw):
    return shardfmt.load(_targets(), path, **kw)


def test_an_edited_rank_index_fails_its_digest(ck):
    with open(os.path.join(ck, "index", "rank_00000.json"), "r+b") as f:
        f.seek(20)
        f.write(b" ")
    with pytest.raises(errors.IntegrityError, match="rank_00000.json.*changed after the commit"):
        _load(ck)
    assert "rank_index" in [p.code for p in shardfmt.validate(ck).problems]


def test_a_missing_rank_table_part_is_refused(ck):
    os.remove(os.path.join(ck, "index", "ranks_00000000.json"))
    with pytest.raises(errors.ShardfmtError, match="ranks_00000000.json"):
        _load(ck)
    assert "rank_table" in [p.code for p in shardfmt.validate(ck).problems]


def test_an_unknown_required_extension_is_refused_by_name_and_an_optional_one_ignored(ck):
    _resign_root(ck, lambda r: r["extensions"].update(hints={"required": False, "value": {"x": 1}}))
    _load(ck)
    assert shardfmt.validate(ck).ok
    _resign_root(ck, lambda r: r["extensions"].update(flat_ranges={"required": True, "value": None}))
    with pytest.raises(errors.FormatVersionError, match="flat_ranges"):
        _load(ck)
    assert shardfmt.validate(ck).unsupported


@pytest.mark.parametrize("edit,match", [
    (lambda r: r["tensors"]["b"]["shards"][0].__setitem__("rank", 1), "rank"),
    (lambda r: r["tensors"]["b"].__setitem__("placed", {"mesh_dims": ["tp"], "placements": [["shard", 0]],
                                                         "stage": None, "writer": 0}), "exactly one of"),
    (lambda r: r["topology"].__setitem__("ranks", [[0]]), "unknown field"),
    (lambda r: r["values"]["step"].__setitem__("per_rank", {"0": 1}), "per_rank"),
    (lambda r: r["ranks"][0].__setitem__("end", 2), "ranks"),
    (lambda r: r["ranks"][0].__setitem__("name", "index/../x.json"), "name"),
    (lambda r: r.__setitem__("files", {}), "unknown field"),
])
def test_root_fields_are_checked_one_by_one(ck, edit, match):
    _resign_root(ck, edit)
    with pytest.raises(errors.ManifestError, match=match):
        _load(ck)
    assert not shardfmt.validate(ck).ok


def test_a_placed_record_naming_a_dim_the_mesh_lacks_is_refused(ck):
    def edit(r):
        rec = r["tensors"]["b"]
        rec.pop("shards")
        rec["placed"] = {"mesh_dims": ["tp"], "placements": [["shard", 0]], "stage": None, "writer": 0}
    _resign_root(ck, edit)
    with pytest.raises(errors.ManifestError, match="not a dim of the topology"):
        _load(ck)


@pytest.mark.parametrize("edit,error,match", [
    (lambda i: i["files"]["data/rank_00000.safetensors"].__setitem__("chunks", "00" * 16), errors.IntegrityError,
     "chunk"),
    (lambda i: i["files"]["data/rank_00000.safetensors"].__setitem__("header_digest", "xxh3-128:" + "0" * 32),
     errors.IntegrityError, "header"),
    (lambda i: i["files"]["data/rank_00000.safetensors"].__setitem__("size", 10**9), errors.IntegrityError, "bytes"),
    (lambda i: i.__setitem__("rank", 3), errors.ManifestError, "rank"),
    (lambda i: i.__setitem__("save_id", "0" * 16), errors.ManifestError, "save_id"),
    (lambda i: i["files"].__setitem__("data/../x.safetensors", i["files"].pop("data/rank_00000.safetensors")),
     errors.ManifestError, "file path"),
])
def test_rank_index_fields_are_checked_when_read(ck, edit, error, match):
    _resign_index(ck, edit)
    with pytest.raises(error, match=match):
        _load(ck)
    assert not shardfmt.validate(ck, deep=True).ok


def test_a_box_its_writer_does_not_hold_is_named(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"a": torch.ones(4), "b": torch.ones(4)}, path)
    _resign_root(path, lambda r: r["tensors"]["a"]["shards"][0].__setitem__("offsets", [0]) or
                 r["tensors"].__setitem__("c", dict(r["tensors"]["a"])))
    with pytest.raises(errors.ManifestError, match="rank 0 should have written"):
        shardfmt.load({"c": torch.zeros(4)}, path, strict=False)
    codes = [p.code for p in shardfmt.validate(path).problems]
    assert "missing_shards" in codes


def test_a_corrupt_chunk_is_caught_on_load_and_by_a_deep_validate(ck):
    m = shardfmt.read_manifest(ck)
    (shard,) = m.tensors[m.resolve("w")[0]].shards
    with open(os.path.join(ck, shard.file), "r+b") as f:
        f.seek(shard.byte_range[0] + 5000)
        f.write(b"\xff\xff")
    with pytest.raises(errors.IntegrityError, match="chunk"):
        _load(ck)
    assert "chunk_hash" in [p.code for p in shardfmt.validate(ck, deep=True).problems]
    assert shardfmt.validate(ck).ok  # quick checks do not hash data
    json.dumps(m.to_json_obj())  # the whole manifest still serialises as the root
