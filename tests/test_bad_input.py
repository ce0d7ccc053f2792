"""Hostile or broken checkpoints get the project's typed errors, naming file and cause."""

import os
import struct

import orjson
import pytest
import torch
from conftest import flip_byte

import shardfmt
import shardfmt.saving.protocol
import shardfmt.saving.writer
from shardfmt.format import hashing
from shardfmt.format.manifest import CommitRecord


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ck")
    w = shardfmt.saving.writer.CheckpointWriter(path, chunk_size=4096, format_version=1)
    full = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    w.write_rank(0, [shardfmt.saving.writer.ShardData(fqn="w", data=full[:32], global_shape=(64, 64), offsets=(0, 0))])
    w.write_rank(1, [shardfmt.saving.writer.ShardData(fqn="w", data=full[32:], global_shape=(64, 64), offsets=(32, 0))])
    w.add_value("v", 1)
    w.commit(step=1)
    return path, full


def recommit(path, mutate):
    """Edit the manifest object and re-sign COMMITTED, so only the edit itself can be caught."""
    mpath = os.path.join(path, "manifest.json")
    with open(mpath, "rb") as f:
        obj = orjson.loads(f.read())
    mutate(obj)
    raw = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"
    write_manifest(path, raw, obj.get("save_id", "x"))


def write_manifest(path, raw, save_id):
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(raw)
    rec = CommitRecord(save_id=save_id if isinstance(save_id, str) else "x",
                       manifest_digest=hashing.digest_bytes(raw))
    with open(os.path.join(path, "COMMITTED"), "wb") as f:
        f.write(rec.to_json())


def load_w(path, **kw):
    out = {"w": torch.zeros(64, 64)}
    shardfmt.load(out, path, **kw)
    return out["w"]


def shard0(obj):
    return obj["tensors"]["w"]["shards"][0]


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "data/../../x.safetensors",
                                 "data/sub/../../etc.safetensors", "data/\u0000.safetensors", "C:\\x.safetensors"])
def test_path_traversal_is_refused(saved, bad):
    path, _ = saved

    def mutate(o):
        f = shard0(o)["file"]
        o["files"][bad] = o["files"].pop(f)
        for s in o["tensors"]["w"]["shards"]:
            if s["file"] == f:
                s["file"] = bad
    recommit(path, mutate)
    with pytest.raises(shardfmt.errors.ManifestError, match="data/<name>.safetensors"):
        load_w(path)
    rep = shardfmt.validate(path)
    assert not rep.ok


@pytest.mark.parametrize("field,value,match", [
    ("offsets", [-1, 0], "integer"),
    ("offsets", [2**63, 0], "integer"),
    ("offsets", [40, 0], "outside the shape"),
    ("lengths", [33, 64], "holds"),
    ("byte_range", [0, 8192], "overlaps the"),
    ("byte_range", [10**9, 10**9 + 8192], "past the end"),
    ("offsets", [0.5, 0], "integer"),
])
def test_bad_shard_geometry_is_refused(saved, field, value, match):
    path, _ = saved

    def mutate(o):
        shard0(o)[field] = value
    recommit(path, mutate)
    with pytest.raises(shardfmt.errors.ManifestError, match=match):
        load_w(path)
    assert not shardfmt.validate(path).ok


@pytest.mark.parametrize("wanted", [("a",), ("a", "b")])
def test_shard_borrowing_another_records_key_is_refused(tmp_path, wanted):
    """A key is unique within its file: a record reusing one (and its bytes) is refused whatever
    the load asks for, before any data is read."""
    path = str(tmp_path / "ck")
    shardfmt.save({"a": torch.zeros(8), "b": torch.ones(8)}, path, format_version=1)
    recommit(path, lambda o: o["tensors"]["a"].__setitem__("shards", o["tensors"]["b"]["shards"]))
    out = {k: torch.full((8,), 7.0) for k in wanted}
    with pytest.raises(shardfmt.errors.ManifestError, match="key 'b' of data/rank_00000.safetensors is used by"):
        shardfmt.load(out, path)
    assert all(torch.equal(t, torch.full((8,), 7.0)) for t in out.values())
    assert not shardfmt.validate(path).ok


def test_shards_of_one_tensor_swapping_keys_are_refused(tmp_path):
    path = str(tmp_path / "ck2")
    w = shardfmt.saving.writer.CheckpointWriter(path, chunk_size=4096, format_version=1)
    w.write_rank(0, [shardfmt.saving.writer.ShardData(fqn="w", data=torch.arange(4.0), global_shape=(8,), offsets=(0,)),
                     shardfmt.saving.writer.ShardData(fqn="w", data=torch.arange(4.0, 8.0), global_shape=(8,), offsets=(4,))])
    w.commit()

    def mutate(o):
        s0, s1 = o["tensors"]["w"]["shards"]
        s1["key"], s1["byte_range"] = s0["key"], s0["byte_range"]
    recommit(path, mutate)
    with pytest.raises(shardfmt.errors.ManifestError, match="unique within its file"):
        shardfmt.load({"w": torch.zeros(8)}, path)


def test_shard_pointing_at_another_tensors_bytes_is_refused(tmp_path):
    """Its own key, another record's byte range: the file's header says the bytes are not its own."""
    path = str(tmp_path / "ck")
    shardfmt.save({"a": torch.zeros(8), "b": torch.ones(8)}, path, format_version=1)
    recommit(path, lambda o: o["tensors"]["a"]["shards"][0].__setitem__(
        "byte_range", o["tensors"]["b"]["shards"][0]["byte_range"]))
    with pytest.raises(shardfmt.errors.ShardfmtError, match="'a'|overlaps"):
        shardfmt.load({"a": torch.empty(8)}, path)
    assert not shardfmt.validate(path).ok


def test_overlapping_shards_are_refused(saved):
    path, _ = saved

    def mutate(o):
        s1 = o["tensors"]["w"]["shards"][1]
        s1["offsets"] = [16, 0]  # overlaps shard 0 rows 16..31, leaves rows 48..63 uncovered
    recommit(path, mutate)
    with pytest.raises(shardfmt.errors.PlanError, match="do not cover"):
        load_w(path)
    rep = shardfmt.validate(path)
    assert any(p.code == "tiling" and p.tensor == "w" for p in rep.problems)


def test_truncated_file(saved):
    path, _ = saved
    f = os.path.join(path, "data", "rank_00001.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(shardfmt.errors.IntegrityError, match="rank_00001.*bytes, manifest says"):
        load_w(path)
    rep = shardfmt.validate(path)
    assert [p.code for p in rep.problems] == ["file_size"] and rep.problems[0].file == "data/rank_00001.safetensors"
    # a rank that only needs rank 0's rows still loads them
    local = torch.zeros(32, 64)
    shardfmt.load({"w": shardfmt.ShardedTensor(local, (64, 64), (0, 0))}, path)


def test_flipped_data_byte_is_caught(saved):
    path, full = saved
    f = os.path.join(path, "data", "rank_00001.safetensors")
    flip_byte(f, 5000, 0x40)
    with pytest.raises(shardfmt.errors.IntegrityError, match="rank_00001.safetensors: chunk 1"):
        load_w(path)
    assert shardfmt.validate(path).ok  # quick validation does not read data
    deep = shardfmt.validate(path, deep=True)
    assert [(p.code, p.file, p.byte_range) for p in deep.problems] == [
        ("chunk_hash", "data/rank_00001.safetensors", (4096, 8192))]
    assert not torch.equal(load_w(path, verify=False), full)  # verify=False trusts the bytes


def test_header_disagreeing_with_manifest(saved):
    path, _ = saved
    f = os.path.join(path, "data", "rank_00000.safetensors")
    with open(f, "r+b") as fh:
        raw = fh.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(b'"shape":[32,64]', b'"shape":[64,32]')
    assert len(header) == n
    with open(f, "wb") as fh:
        fh.write(raw[:8] + header + raw[8 + n:])
    rep = shardfmt.validate(path)
    assert any(p.code == "header" and p.tensor == "w" and "[64, 32]" in p.message for p in rep.problems)
    with pytest.raises(shardfmt.errors.IntegrityError):
        load_w(path)  # the header's chunk no longer hashes right


def test_non_json_manifest(saved):
    path, _ = saved
    write_manifest(path, b"{not json", "x")
    with pytest.raises(shardfmt.errors.ManifestError, match="not valid JSON"):
        load_w(path)
    rep = shardfmt.validate(path)
    assert [p.code for p in rep.problems] == ["manifest_json"]


def test_manifest_over_the_limit(saved, monkeypatch):
    path, _ = saved
    import shardfmt.format.parse as mf
    import shardfmt.loading.reader as rd

    monkeypatch.setattr(rd, "MAX_MANIFEST_BYTES", 100)
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(shardfmt.errors.IntegrityError, match="limit"):  # the checkpoint is bad, not the storage
        load_w(path)


def test_huge_header_length_is_refused(saved):
    path, _ = saved
    f = os.path.join(path, "data", "rank_00000.safetensors")
    with open(f, "r+b") as fh:
        fh.write(struct.pack("<Q", 10**12))
    rep = shardfmt.validate(path)
    assert any(p.code == "header" and "limit" in p.message for p in rep.problems)


def test_missing_committed(saved):
    path, _ = saved
    os.remove(os.path.join(path, "COMMITTED"))
    with pytest.raises(shardfmt.errors.CommitError, match="not committed"):
        load_w(path)


def test_newer_format_version_names_both(saved):
    path, _ = saved
    recommit(path, lambda o: o.__setitem__("format_version", 3))
    with pytest.raises(shardfmt.errors.FormatVersionError, match=r"version 3.*up to 2"):
        load_w(path)
    assert any("version 3" in p.message for p in shardfmt.validate(path).problems)


def test_a_version_never_written_is_refused_not_migrated(saved):
    """One reader per version (spec section 9): there is no version 0 and no migration to find."""
    path, _ = saved
    recommit(path, lambda o: (o.__setitem__("format_version", 0), o.__setitem__("legacy_field", 1)))
    with pytest.raises(shardfmt.errors.FormatVersionError, match="never written"):
        load_w(path)


def test_a_v1_manifest_marked_v2_is_malformed_not_newer(saved):
    """A v1-shaped manifest claiming version 2 is checked by the v2 reader, which names what is missing."""
    path, _ = saved
    recommit(path, lambda o: o.__setitem__("format_version", 2))
    with pytest.raises(shardfmt.errors.ManifestError, match="missing field"):
        load_w(path)


def test_unknown_dtype_in_manifest(saved):
    path, _ = saved
    recommit(path, lambda o: o["tensors"]["w"].__setitem__("dtype", "F128"))
    with pytest.raises(shardfmt.errors.ManifestError, match="F128"):
        load_w(path)


def test_missing_path_and_cli_exit_codes(tmp_path, saved, capsys):
    from shardfmt.cli import main

    path, _ = saved
    assert main(["validate", path]) == 0
    assert main(["validate", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err
    os.remove(os.path.join(path, "COMMITTED"))
    assert main(["validate", path]) == 1
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError):
        load_w(str(tmp_path / "nope"))


@pytest.mark.parametrize("member", ["manifest.json", "COMMITTED"])
def test_a_directory_where_the_checkpoint_has_a_file_is_an_invalid_checkpoint(saved, member, capsys):
    """Not a storage failure (exit 2, "read failed: Is a directory"): the checkpoint is invalid."""
    from reshard.cli import main as reshard_main
    from shardfmt.cli import main

    path, _ = saved
    os.remove(os.path.join(path, member))
    os.mkdir(os.path.join(path, member))
    with pytest.raises(shardfmt.errors.SpecialFileError, match=f"{member}: is a directory, not a regular file"):
        load_w(path)
    assert main(["inspect", path]) == 1
    assert reshard_main(["convert", path, path + "-out", "--mesh", "dp=1"]) == 1
    err = capsys.readouterr().err
    assert err.count("is a directory, not a regular file") == 2 and "Traceback" not in err
    assert not os.path.exists(path + "-out")


def test_a_path_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path):
    bad = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"ck\xff"))
    with pytest.raises(shardfmt.errors.StorageError, match="valid UTF-8"):
        shardfmt.save({"w": torch.ones(3)}, bad, step=1, format_version=1)
    with pytest.raises(shardfmt.errors.StorageError, match="valid UTF-8"):
        shardfmt.async_save({"w": torch.ones(3)}, bad, step=1, stager=shardfmt.Stager()).wait()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("step", [-1, 1 << 63, True, 1.0, "3"])
def test_a_bad_step_fails_before_any_data_is_written(tmp_path, monkeypatch, step):
    def no_writer(*a, **k):
        raise AssertionError("a save with a bad step must not start writing")

    monkeypatch.setattr("shardfmt.saving.protocol.CheckpointWriter", no_writer)
    path = str(tmp_path / "ck")
    with pytest.raises(shardfmt.errors.StateDictError, match="step must be"):
        shardfmt.save({"w": torch.ones(3)}, path, step=step, format_version=1)
    with pytest.raises(shardfmt.errors.StateDictError, match="step must be"):
        shardfmt.async_save({"w": torch.ones(3)}, path, step=step, stager=shardfmt.Stager())
    assert os.listdir(tmp_path) == []
