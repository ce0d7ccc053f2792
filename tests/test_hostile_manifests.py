"""Manifests written by an attacker: typed errors, bounded time and bounded memory (issue 16).

Each case edits a valid checkpoint's manifest and re-signs ``COMMITTED`` (a hostile author
does), so only the checks behind the digest can catch it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import pytest
import torch
from deadline import deadline
from test_bad_input import recommit

import shardfmt
import shardfmt.saving.writer
from shardfmt.format import hashing
from shardfmt.format.jsonscan import MAX_DEPTH, bracket_depth, load


def _bad_ndarray(dtype: str = "(-1,)i4", shape=(1,)) -> dict:
    return {"$ndarray": {"dtype": dtype, "shape": list(shape), "data": "AAAAAA=="}}


@pytest.fixture
def small(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": {"lr": 0.5}}, path, step=3, format_version=1)
    return path


# ----------------------------------------------------------------------------- 1. typed JSON


@pytest.mark.slow
@pytest.mark.parametrize("value", [
    _bad_ndarray("(-1,)i4"), _bad_ndarray("(2,3)i4"), _bad_ndarray("((2,),(3,))i4"), _bad_ndarray("i4,i4"),
    _bad_ndarray("<i4", (0, 1 << 47, 1 << 47)), {"$npscalar": {"dtype": "3f4", "data": "AAAAAAAAAAAAAAAA"}},
    _bad_ndarray("i04"), _bad_ndarray("b01"),
], ids=["negative-subarray", "subarray", "nested-subarray", "structured", "empty-but-huge", "scalar-subarray",
        "not-numpys-form", "not-numpys-form-bool"])
def test_a_stored_value_numpy_refuses_is_the_checkpoints_fault(small, value):
    recommit(small, lambda o: o["values"]["v"].update(value={"lr": value}))
    with pytest.raises(shardfmt.errors.ManifestError, match="v.lr"):
        shardfmt.load({"w": torch.zeros(3, 4), "v": None}, small)
    report = shardfmt.validate(small)
    assert [p.code for p in report.problems] == ["value"], report.problems
    cli = subprocess.run([sys.executable, "-m", "shardfmt.cli", "validate", small], capture_output=True, text=True)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr + cli.stdout, cli.stderr


def test_restore_falls_back_past_a_checkpoint_whose_metadata_numpy_refuses(tmp_path):
    root = str(tmp_path / "root")
    model = torch.nn.Linear(3, 2)
    ck = shardfmt.Checkpointer(root)
    ck.save(1, {"model": model})
    with torch.no_grad():
        model.weight += 1
    ck.save(2, {"model": model})
    newest = os.path.join(root, "step_000000002")
    recommit(newest, lambda o: o.update(metadata={"user": _bad_ndarray()}))
    fresh = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="unusable"):
        assert shardfmt.Checkpointer(root).restore({"model": fresh}) == 1


# ----------------------------------------------------------------------------- 2. view extents


@pytest.fixture
def views(tmp_path):
    path = str(tmp_path / "views")
    base = torch.arange(20, dtype=torch.float32)
    shardfmt.save({"a": base[0:8].view(2, 4), "b": base[4:20].view(4, 4)}, path, format_version=1)
    return path, base


@pytest.mark.parametrize("verify", [True, False])
def test_a_view_stride_cannot_make_load_allocate_what_the_checkpoint_does_not_hold(views, verify):
    """A 2x4 view whose stride reaches 2^39 elements into a storage declared that long: the span is
    not stored, and nothing that large may be allocated before the load finds that out."""
    path, _ = views

    def mutate(o):
        o["storages"][".storage.a"]["shape"] = [1 << 40]
        o["tensors"]["a"]["view"]["stride"] = [1 << 39, 1]
    recommit(path, mutate)
    with deadline(20, "load"), pytest.raises(shardfmt.errors.PlanError, match="do not cover"):
        shardfmt.load({"a": torch.zeros(2, 4)}, path, verify=verify)


def test_views_whose_shards_share_bytes_are_refused_before_allocating(views):
    """Without verification no header is read: shards that claim more bytes of a file than it has
    (here the same bytes twice, to cover a storage twice as long) are refused from the manifest."""
    path, _ = views

    def mutate(o):
        st = o["storages"][".storage.a"]
        first = st["shards"][0]
        st["shape"] = [40]
        st["shards"].append(dict(first, offsets=[20], key=".storage.a@20"))
        o["tensors"]["a"]["view"]["stride"] = [32, 1]  # reaches element 35: both copies
    recommit(path, mutate)
    with pytest.raises(shardfmt.errors.ManifestError, match="share bytes"):
        shardfmt.load({"a": torch.zeros(2, 4)}, path, verify=False)


def test_honest_views_still_load(views):
    path, base = views
    out = {"a": torch.zeros(2, 4), "b": torch.zeros(4, 4)}
    shardfmt.load(out, path)
    assert torch.equal(out["a"], base[0:8].view(2, 4)) and torch.equal(out["b"], base[4:20].view(4, 4))


# ----------------------------------------------------------------------------- 6, 8. whole-manifest checks


@pytest.mark.slow
def test_a_tensor_in_20000_shards_saves_validates_and_loads_in_bounded_time(tmp_path):
    """The tiling check at save (the writer's manifest), in validate and at load, and validate's
    JSON Schema pass, all cost linear time (before: the tiling check was quadratic, 13 s at 8,000
    shards, and the schema pass took a minute at 20,000)."""
    n = 20_000
    full = torch.arange(n, dtype=torch.float32)
    path = str(tmp_path / "many")
    t = time.perf_counter()
    with shardfmt.saving.writer.CheckpointWriter(path, chunk_size=4096, format_version=1) as w:
        w.write_rank(0, [shardfmt.saving.writer.ShardData(fqn="w", data=full[i:i + 1], global_shape=(n,), offsets=(i,))
                         for i in range(n)])
        w.commit(step=1)
    saved = time.perf_counter() - t
    t = time.perf_counter()
    assert shardfmt.validate(path).ok
    validated = time.perf_counter() - t
    out = {"w": torch.zeros(n)}
    t = time.perf_counter()
    shardfmt.load(out, path)
    loaded = time.perf_counter() - t
    assert torch.equal(out["w"], full)
    assert (saved, validated, loaded) < (30, 30, 30), (saved, validated, loaded)


def test_validate_rejects_with_the_field_parser_before_any_schema_pass(small):
    """A 400,000-entry shape: the field parser refuses it at once; the schema pass never runs
    over it (it took seconds, and hours at the size limit)."""
    recommit(small, lambda o: o["tensors"]["w"].update(shape=[1] * 400_000))
    t = time.perf_counter()
    report = shardfmt.validate(small)
    assert time.perf_counter() - t < 5
    assert [p.code for p in report.problems] == ["manifest_field"]
    assert "400000 entries, at most 64" in report.problems[0].message


@pytest.mark.slow
def test_the_schema_pass_sees_a_bounded_sample_of_a_conforming_manifest(small):
    """A manifest of thousands of values and a large metadata object still passes the schema
    pass, which sees at most SCHEMA_SAMPLE entries of each map and small values only."""
    from shardfmt.validation import SCHEMA_SAMPLE, schema_sample

    def mutate(o):
        o["values"].update({f"v{i}": {"value": [i, str(i)]} for i in range(5000)})
        o["metadata"] = {"config": [{"layer": i, "dims": [i, i + 1]} for i in range(20_000)]}
    recommit(small, mutate)
    with open(os.path.join(small, "manifest.json"), "rb") as f:
        sample = schema_sample(orjson.loads(f.read()))
    assert len(sample["values"]) == SCHEMA_SAMPLE and sample["metadata"] is None
    t = time.perf_counter()
    assert shardfmt.validate(small).ok
    assert time.perf_counter() - t < 10


# ----------------------------------------------------------------------------- 7. claimed counts


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_a_claimed_world_size_is_checked_by_count_before_anything_is_built(small):
    """A 1 KB manifest declaring 2^24 ranks (and listing one): refused at once, in constant
    memory (before: 2.2 GB of rank coordinates were built, a minute, then the refusal)."""
    recommit(small, lambda o: o["topology"].update(world_size=1 << 24, mesh=[{"name": "world", "size": 1 << 24}],
                                                   ranks=[[0]]))
    t = time.perf_counter()
    [r] = _open_peaks([small])
    assert "lists 1 ranks, the mesh has 16777216" in r["outcome"], r
    assert r["growth"] < 64 << 20, r  # before: 2.2 GB
    assert time.perf_counter() - t < 60


def test_rank_coordinates_are_checked_entry_by_entry(small):
    def mutate(o):
        o["topology"] = {"world_size": 6, "mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 3}],
                         "ranks": [[0, 0], [0, 1], [0, 2], [1, 0], [1, 2], [1, 1]]}
    recommit(small, mutate)
    with pytest.raises(shardfmt.errors.ManifestError, match=r"ranks\[4\]: \[1, 2\] is not rank 4's"):
        shardfmt.load({"w": torch.zeros(3, 4)}, small)


# ----------------------------------------------------------------------------- 9. memory per byte

_PEAK_SCRIPT = """
import json, sys
import shardfmt
from shardfmt.format import hashing
shardfmt.load, shardfmt.read_manifest  # the library's modules loaded before any baseline (import shardfmt is lazy)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield int(line.split()[1]) * 1024
out = []
for path in sys.argv[1:]:
    open("/proc/self/clear_refs", "w").write("5")  # the peak restarts from here
    before = list(hwm())[1]
    try:
        shardfmt.read_manifest(path)
        outcome = "ok"
    except shardfmt.errors.ShardfmtError as e:
        outcome = type(e).__name__ + ": " + str(e)
    out.append({"path": path, "growth": list(hwm())[0] - before, "outcome": outcome})
print(json.dumps(out))
"""


def _open_peaks(paths: list[str]) -> list[dict]:
    """Open each manifest in one fresh process; the peak RSS growth of each, and what happened."""
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, *paths], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return orjson.loads(out.stdout.strip().splitlines()[-1])


JUNK = {  # JSON text that costs the most memory per byte once parsed (22-50x before the bound)
    "empty_lists": lambda n: [[] for _ in range(n // 3)],
    "empty_dicts": lambda n: [{} for _ in range(n // 3)],
    "one_char_strings": lambda n: ["a"] * (n // 4),
    "floats": lambda n: [1.5] * (n // 4),
    "small_ints": lambda n: [7] * (n // 2),
    "distinct_keys": lambda n: {f"k{i}": 0 for i in range(n // 10)},
    "one_key_dicts": lambda n: [{"a": 0} for _ in range(n // 8)],
}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_opening_any_manifest_takes_at_most_10_bytes_per_byte_plus_64_mib(tmp_path):
    """16 MiB of dense JSON in the metadata or a value (before: 22-50x its size while parsing,
    up to 800 MiB), and a manifest of 300,000 minimal shard records: the peak RSS of opening each
    stays within the bound the spec states, and the dense ones are refused by name."""
    base = str(tmp_path / "base")
    shardfmt.save({"w": torch.zeros(3, 4), "v": 1}, base, format_version=1)
    paths = []
    for name, make in JUNK.items():
        for where in ("metadata", "value"):
            path = str(tmp_path / f"{name}-{where}")
            subprocess.run(["cp", "-r", base, path], check=True)
            junk = make(16 << 20)
            recommit(path, (lambda o, j=junk: o.update(metadata={"pad": j})) if where == "metadata"
                     else (lambda o, j=junk: o["values"]["v"].update(value=j)))
            paths.append(path)
    shards = str(tmp_path / "shards")
    _write_minimal_shards(shards, 300_000)
    paths.append(shards)
    for r in _open_peaks(paths):
        size = os.path.getsize(os.path.join(r["path"], "manifest.json"))
        assert r["growth"] <= 10 * size + (64 << 20), (r["path"], size, r["growth"])
        if r["path"] == shards:
            assert r["outcome"] == "ok", r
        else:
            assert r["outcome"].startswith("ManifestError") and "would take more than" in r["outcome"], r


def _write_minimal_shards(path: str, n: int) -> None:
    """A committed manifest (no data needed to open it) of one U8 tensor in ``n`` one-byte shards:
    the shortest shard records the format allows, the most records per byte of manifest."""
    from shardfmt.format.manifest import (
        CommitRecord,
        FileRecord,
        Manifest,
        ShardRecord,
        TensorRecord,
    )

    d = "xxh3-128:" + "0" * 32
    f = FileRecord(rank=0, size=8 + n, header_size=8, header_digest=d, chunks=(d,), digest=d)
    shards = tuple(ShardRecord(offsets=(i,), lengths=(1,), file="data/a.safetensors", key=f"w@{i}",
                               byte_range=(8 + i, 9 + i), digest=d) for i in range(n))
    m = Manifest(save_id="0", created_at="x", chunk_size=1 << 30, files={"data/a.safetensors": f},
                 tensors={"w": TensorRecord(dtype="U8", shape=(n,), shards=shards)})
    raw = m.to_json()
    os.makedirs(path)
    with open(os.path.join(path, "manifest.json"), "wb") as fh:
        fh.write(raw)
    with open(os.path.join(path, "COMMITTED"), "wb") as fh:
        fh.write(CommitRecord(save_id="0", manifest_digest=hashing.digest_bytes(raw)).to_json())


@pytest.mark.parametrize("config", [
    {"layers": [{"dim": 4096, "act": "silu", "i": i} for i in range(20_000)]},  # ~800 KB of small dicts
    {"vocab": {f"tok{i}": i for i in range(50_000)}, "notes": "x" * (3 << 20)},  # a 3 MB string: one piece
], ids=["small-dicts", "vocab-and-long-string"])
def test_typed_json_within_the_budget_is_kept(small, config):
    """Honest metadata of a manifest larger than one piece is accepted and comes back whole."""
    recommit(small, lambda o: o.update(metadata=config))
    assert shardfmt.read_manifest(small).metadata == config


@pytest.mark.parametrize("piece", [64, 512, 4096])
def test_a_manifest_parsed_in_pieces_is_the_manifest_parsed_whole(tmp_path, monkeypatch, piece):
    """The bounded parse (members found by a scan, parsed in batches) gives the same records as
    one parse of the whole text, for a manifest with views, aliases, values and metadata."""
    from shardfmt.format import jsonscan
    from shardfmt.format.parse import parse_manifest

    path = str(tmp_path / "ck")
    base = torch.arange(20, dtype=torch.float32)
    w = torch.randn(6, 4)
    state = {"a": base[0:8].view(2, 4), "b": base[4:20].view(4, 4), "w": w, "tied": w,
             "opt": {"lr": 0.5, "betas": (0.9, 0.999), "names": ["x\\", '"y"', "é"], "n": None},
             "rank": shardfmt.PerRank({"seed": 3})}
    shardfmt.save(state, path, step=9, metadata={"cfg": {"nested": [[1, {"k": [2.5, "s"]}]]}, "big": 2 ** 70}, format_version=1)
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        raw = f.read()
    whole = parse_manifest(raw)
    monkeypatch.setattr(jsonscan, "PIECE_MAX", piece)
    monkeypatch.setattr(jsonscan, "SCAN_BLOCK", 37)
    assert parse_manifest(raw) == whole
    out = {"a": torch.zeros(2, 4), "b": torch.zeros(4, 4), "w": torch.zeros(6, 4), "opt": None,
           "rank": shardfmt.PerRank(None)}
    shardfmt.load(out, path)
    assert torch.equal(out["w"], w) and torch.equal(out["b"], base[4:20].view(4, 4))
    assert out["opt"] == state["opt"] and out["rank"].value == {"seed": 3}


_PARSE_PEAK = """
import sys, orjson
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
text = open(sys.argv[1], "rb").read()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
value = orjson.loads(text)
print(status("VmHWM") - before)
"""


MORE_JUNK = {
    "non_ascii_strings": lambda n: ["\U0001F600" * 3] * (n // 16),
    "one_long_non_ascii_string": lambda n: ["a" * n + "\U0001F600"],
    "mixed": lambda n: [{"k": [1.5, "ab", None, {}], "é": [[7]]} for _ in range(n // 40)],
    "long_strings": lambda n: ["x" * 1000] * (n // 1003),
    "big_ints": lambda n: [12345678901] * (n // 12),
    "typed_json": lambda n: [{"$tuple": [1, {"$float": "nan"}]} for _ in range(n // 32)],
}
ESCAPED = {  # text orjson would never write: \u escapes of characters beyond Latin-1 in ASCII text
    "escaped_astral": lambda n: b'["' + b"a" * n + b'\\ud83d\\ude00"]',
    "many_escaped": lambda n: b"[" + b",".join([b'"abcdefgh\\u4e2d"'] * (n // 17)) + b"]",
}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_the_memory_estimate_bounds_what_parsing_takes(tmp_path):
    """``jsonscan.estimate`` is what lets a large value be parsed whole: it must never be below
    the peak memory orjson takes to parse the text (4 MiB of each kind of dense JSON)."""
    from shardfmt.format.jsonscan import estimate

    texts = {name: orjson.dumps(make(4 << 20)) for name, make in {**JUNK, **MORE_JUNK}.items()}
    texts.update({name: make(4 << 20) for name, make in ESCAPED.items()})
    for name, text in texts.items():  # each in a fresh process: none reuses memory another freed
        path = tmp_path / f"{name}.json"
        path.write_bytes(text)
        out = subprocess.run([sys.executable, "-c", _PARSE_PEAK, str(path)], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout) <= estimate(text), (name, int(out.stdout), estimate(text))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_a_dense_safetensors_header_is_read_within_a_bounded_memory(tmp_path):
    """A data file's header (up to 100 MB of JSON, re-signed by the author) is parsed in pieces
    too: 16 MiB of empty lists in a header entry cost 30x while parsing; now the load refuses
    the header within 10 bytes per byte plus 64 MiB."""
    from reseal import reseal

    path = str(tmp_path / "ck")
    shardfmt.save({"w": torch.arange(12, dtype=torch.float32)}, path, format_version=1)
    name = os.path.join(path, "data", "rank_00000.safetensors")
    with open(name, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = orjson.loads(data[8:8 + n])
    header["zz"] = [[] for _ in range((16 << 20) // 3)]
    js = orjson.dumps(header)
    js += b" " * (-(8 + len(js)) % 8)
    with open(name, "wb") as f:
        f.write(len(js).to_bytes(8, "little") + js + data[8 + n:])
    reseal(path)
    script = ("import shardfmt, torch\n" + _PEAK_SCRIPT.split("out = []")[0]
              + f"open('/proc/self/clear_refs', 'w').write('5'); before = list(hwm())[1]\n"
              f"try:\n    shardfmt.load({{'w': torch.zeros(12)}}, {path!r}); print('loaded')\n"
              f"except shardfmt.errors.ShardfmtError as e:\n    print(type(e).__name__, e)\n"
              f"print(list(hwm())[0] - before)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("HeaderError") and "entry must have exactly" in lines[0], out
    assert int(lines[-1]) <= 10 * len(js) + (64 << 20), lines


# ----------------------------------------------------------------------------- the bounded parse, exactly JSON

PAD = b" " * ((1 << 20) + 16)  # whitespace that makes a container larger than one piece


def _raw_manifest(path: str) -> bytes:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return f.read().strip()


@pytest.mark.parametrize("edit", [
    (b'"storages":{}', b'"storages":{' + PAD + b"}"),
    (b'"ranks":[]', b'"ranks":[' + PAD + b"]"),
    (b'"metadata":null', b'"metadata":[' + PAD + b"]"),
], ids=["empty-object", "empty-array", "empty-metadata-list"])
def test_valid_json_padded_past_one_piece_parses_as_a_whole_parse_does(small, edit):
    from shardfmt.format.parse import parse_manifest

    raw = _raw_manifest(small)
    assert edit[0] in raw
    padded = raw.replace(edit[0], edit[1], 1)
    want = parse_manifest(orjson.dumps(orjson.loads(padded)))
    assert parse_manifest(padded) == want


@pytest.mark.parametrize("edit,match", [
    ((b'"storages":{}', b'"storages":{' + PAD + b"]"), "malformed"),  # the wrong closing bracket
    ((b'"metadata":null', b'"metadata":[' + PAD + b",1]"), "empty array member|not valid JSON"),
    ((b'"step":3', b'"step":[1,,2' + PAD + b'],"step":3'), "given twice"),  # an unparsed duplicate hid garbage
    ((b'"dtype":"F32"', b'"dtype":nul' + PAD + b',"dtype":"F32"'), "not valid JSON|given twice"),
    ((b'"storages":{}', b'"storages":{[' + b"[]," * 400_000 + b'[]]:0}'), "not a string|not valid JSON"),
], ids=["wrong-closer", "empty-member", "duplicate-top-level", "duplicate-in-record", "container-as-key"])
def test_invalid_json_past_one_piece_is_refused_as_a_whole_parse_refuses_it(small, edit, match):
    from shardfmt.format.parse import parse_manifest

    raw = _raw_manifest(small)
    assert edit[0] in raw
    bad = raw.replace(edit[0], edit[1], 1)
    if b"given twice" not in match.encode():
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(bad)
    with pytest.raises(shardfmt.errors.ManifestError, match=match):
        parse_manifest(bad)


def test_a_large_malformed_header_is_a_header_error(tmp_path):
    from shardfmt.format.safetensors import decode_header

    js = b'{"x":tru' + PAD + b"}"
    raw = len(js).to_bytes(8, "little") + js
    with pytest.raises(shardfmt.errors.HeaderError, match="not valid JSON"):
        decode_header(raw, source="f", file_size=len(raw))


def test_lazy_values_are_named_by_kind_and_size_in_errors(small):
    recommit(small, lambda o: o.update(format_version=[0] * 600_000))
    with pytest.raises(shardfmt.errors.ManifestError, match=r"format_version <JSON array of \d+ bytes> is not a version"):
        shardfmt.read_manifest(small)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_views_of_one_storage_share_one_buffer(tmp_path):
    """Eight 2-element views whose strides each reach across a 16 MiB storage: one buffer of the
    storage's span is allocated, not one per view (before: 8 x 16 MiB)."""
    import copy

    n = 4 << 20
    path = str(tmp_path / "views")
    base = torch.arange(n, dtype=torch.float32)
    shardfmt.save({"a": base[0:8].view(2, 4), "b": base[4:n].view(-1)}, path, format_version=1)

    def mutate(o):
        for i in range(8):
            t = copy.deepcopy(o["tensors"]["a"])
            t.update(shape=[2])
            t["view"].update(stride=[n - 1], storage_offset=0)
            o["tensors"][f"v{i}"] = t
    recommit(path, mutate)
    script = ("import shardfmt, torch\n" + _PEAK_SCRIPT.split("out = []")[0]
              + "open('/proc/self/clear_refs', 'w').write('5'); before = list(hwm())[1]\n"
              + f"sd = {{f'v{{i}}': torch.zeros(2) for i in range(8)}}\nshardfmt.load(sd, {path!r})\n"
              + "print(sd['v7'].tolist(), list(hwm())[0] - before)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    values, growth = out.stdout.strip().rsplit(" ", 1)
    assert values == f"[0.0, {float(n - 1)}]"
    assert int(growth) < 2 * 4 * n + (8 << 20), growth


def test_the_tiling_locator_stops_within_its_budget():
    """A staircase of 1,398 boxes embedded in 64 dims with one cell missing: the answer (no)
    comes at once; naming the gap stops at the locator's budget (before: 27 s)."""
    from shardfmt.layout.geometry import Box
    from shardfmt.layout.tiling import tiling_problems

    n, pre_o, pre_l = 700, (0,) * 62, (1,) * 62
    boxes = []
    for k in range(n):
        boxes.append(Box(pre_o + (k, k), pre_l + (1, n - k)))
        if k + 1 < n:
            boxes.append(Box(pre_o + (k + 1, k), pre_l + (n - k - 1, 1)))
    t = time.perf_counter()
    assert tiling_problems(boxes[:-1], Box(pre_o + (0, 0), pre_l + (n, n)), limit=1)
    assert time.perf_counter() - t < 5


def test_brackets_inside_strings_are_not_nesting_and_deep_documents_are_still_refused():
    """``jsonscan.load`` skips walking a parsed document whose brackets (outside strings,
    escaped quotes included) never reach the limit; one that does is walked and refused."""
    text = '{"a": "' + '[{' * 100 + '\\\\", "b": "\\"[[[", "c": [[1]]}'
    assert bracket_depth(text.encode()) == 3
    assert load(text.encode(), source="t")["c"] == [[1]]
    deep = ("[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH).encode()
    with pytest.raises(shardfmt.errors.ManifestError, match="nested deeper"):
        load(deep, source="t")
    assert load(("[" * MAX_DEPTH + "]" * MAX_DEPTH).encode(), source="t")  # empty at the limit: as before
