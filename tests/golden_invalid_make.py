"""Write spec/golden/invalid/: the golden checkpoint spec/golden/v1 with one defect per case.

Each case directory holds the checkpoint and ``expect.json``: the rule it breaks (``section`` of
FORMAT.md, and ``item`` of section 11's reject list, or null for the unnumbered rules of sections
8 and 10), ``fails_at`` ("open": ``shardfmt.read_manifest`` already refuses it, the defect is in
COMMITTED or the manifest; "load": it opens, and a verifying load refuses it), the error class a
load raises (``shardfmt.errors``) and the code of the validator's problem. Where a defect must get
past the digests that would otherwise catch it first, the case is re-signed as a hostile author
would (``tests/reseal.py``): the defect is then the only thing wrong.

Regenerate (deterministic: the same bytes every time): ``python tests/golden_invalid_make.py --write``.
``tests/test_golden_invalid.py`` checks that the committed cases are what this script writes.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reseal import recommit, reseal  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.normpath(os.path.join(HERE, "..", "spec", "golden", "v1"))
INVALID = os.path.normpath(os.path.join(HERE, "..", "spec", "golden", "invalid"))
R0, R1 = "data/rank_00000.safetensors", "data/rank_00001.safetensors"


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    section: str
    item: int | None
    defect: str
    fails_at: str  # "open" or "load"
    error: str     # class name in shardfmt.errors
    problem: str   # the validator's Problem.code
    make: Callable[[str], None]

    def expect(self) -> bytes:
        obj = {"section": self.section, "item": self.item, "defect": self.defect,
               "fails_at": self.fails_at, "error": self.error, "problem": self.problem}
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


# ----------------------------------------------------------------------------- editing helpers

def digest(data: bytes) -> str:
    """A digest string as FORMAT.md section 6 spells it."""
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(data)


def manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return orjson.loads(f.read())


def write_manifest(path: str, raw: bytes, *, sign: bool = True, save_id: str = "0123456789abcdef") -> None:
    """Replace manifest.json with ``raw``; with ``sign``, COMMITTED vouches for it."""
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(raw)
    if sign:
        recommit(path, raw, save_id)


def edit(fn: Callable[[dict], None], *, sign: bool = True) -> Callable[[str], None]:
    """A case that edits the manifest object (and, with ``sign``, re-signs COMMITTED for it)."""
    def make(path: str) -> None:
        obj = manifest(path)
        fn(obj)
        write_manifest(path, orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n", sign=sign)
    return make


def set_commit(**fields) -> Callable[[str], None]:
    """A case whose COMMITTED has ``fields`` changed (None removes one)."""
    def make(path: str) -> None:
        with open(os.path.join(path, "COMMITTED"), "rb") as f:
            obj = orjson.loads(f.read())
        for k, v in fields.items():
            if v is None:
                obj.pop(k)
            else:
                obj[k] = v
        with open(os.path.join(path, "COMMITTED"), "wb") as f:
            f.write(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n")
    return make


def write_bytes(name: str, data: bytes) -> Callable[[str], None]:
    def make(path: str) -> None:
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return make


def remove(name: str) -> Callable[[str], None]:
    return lambda path: os.remove(os.path.join(path, name))


def read_file(path: str, name: str) -> tuple[dict, bytes]:
    """A data file's header (decoded) and data section."""
    with open(os.path.join(path, name), "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    return orjson.loads(raw[8:8 + n]), raw[8 + n:]


def write_file(path: str, name: str, header: dict, data: bytes) -> None:
    """Write a data file as shardfmt does: compact sorted header JSON, space-padded to 8 bytes."""
    text = orjson.dumps(header, option=orjson.OPT_SORT_KEYS)
    text += b" " * (-(8 + len(text)) % 8)
    with open(os.path.join(path, name), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def edit_file(name: str, fn: Callable[[dict, bytes], bytes]) -> Callable[[str], None]:
    """A case that rewrites a data file's header (``fn`` edits it and returns the data section),
    then re-signs everything: the manifest's byte ranges follow the header's new length."""
    def make(path: str) -> None:
        header, data = read_file(path, name)
        write_file(path, name, header, fn(header, data))
        reseal(path)
    return make


def origins(header: dict) -> dict:
    return orjson.loads(header["__metadata__"]["shards"])


def set_origins(header: dict, value: dict) -> None:
    header["__metadata__"]["shards"] = orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def shards(obj: dict, fqn: str) -> list[dict]:
    return obj["tensors"][fqn]["shards"]


def flip(name: str, offset: int) -> Callable[[str], None]:
    def make(path: str) -> None:
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x40]))
    return make


def resize_w_on_rank1(first_row: int) -> Callable[[str], None]:
    """Rank 1's shard of ``model.w`` (6 x 4 F32, rows [3, 6)) becomes rows [first_row, 6), its
    bytes taken from the tensor's values (rank 0's file holds rows [0, 3)); everything re-signed."""
    def make(path: str) -> None:
        h0, d0 = read_file(path, R0)
        h1, d1 = read_file(path, R1)
        rows = d0[slice(*h0["model.w"]["data_offsets"])] + d1[slice(*h1["model.w"]["data_offsets"])]
        w = rows[first_row * 16:]
        step = d1[slice(*h1["optim.step"]["data_offsets"])]
        h1["model.w"] = {"data_offsets": [8, 8 + len(w)], "dtype": "F32", "shape": [6 - first_row, 4]}
        o = origins(h1)
        o["model.w"]["offsets"] = [first_row, 0]
        set_origins(h1, o)
        write_file(path, R1, h1, step + w)
        obj = manifest(path)
        header_size = os.path.getsize(os.path.join(path, R1)) - len(step + w)
        obj["files"][R1]["header_size"] = header_size
        shards(obj, "optim.step")[0]["byte_range"] = [header_size, header_size + 8]
        shards(obj, "model.w")[1].update(offsets=[first_row, 0], lengths=[6 - first_row, 4],
                                         byte_range=[header_size + 8, header_size + 8 + len(w)])
        write_manifest(path, orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n")
        reseal(path)
    return make


def link_data_file(path: str) -> None:
    """data/rank_00001.safetensors becomes a symbolic link to a regular copy beside it."""
    f = os.path.join(path, R1)
    os.rename(f, f[:-len(".safetensors")] + ".bytes")
    os.symlink("rank_00001.bytes", f)


def link_data_dir(path: str) -> None:
    os.rename(os.path.join(path, "data"), os.path.join(path, "data.real"))
    os.symlink("data.real", os.path.join(path, "data"))


def rename_file(new: str) -> Callable[[dict], None]:
    def fn(o: dict) -> None:
        o["files"][new] = o["files"].pop(R1)
        for s in shards(o, "model.w") + shards(o, "optim.step"):
            if s["file"] == R1:
                s["file"] = new
    return fn


def nested(depth: int):
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def stale_header_digest(path: str) -> None:
    """A padding byte of rank 1's header becomes a tab (still JSON whitespace); every digest is
    re-signed except the header's own."""
    old = manifest(path)["files"][R1]["header_digest"]
    with open(os.path.join(path, R1), "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n - 1)
        assert f.read(1) == b" "
        f.seek(8 + n - 1)
        f.write(b"\t")
    reseal(path)
    edit(lambda o: o["files"][R1].__setitem__("header_digest", old))(path)


def short_header_size(path: str) -> None:
    """The manifest's header_size of rank 1 is 8 less than its length prefix says (still at or
    before every byte range), with header_digest over the bytes it names."""
    obj = manifest(path)
    rec = obj["files"][R1]
    rec["header_size"] -= 8
    with open(os.path.join(path, R1), "rb") as f:
        rec["header_digest"] = digest(f.read(rec["header_size"]))
    write_manifest(path, orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n")


def drop_shards_entry(header: dict, data: bytes) -> bytes:
    del header["__metadata__"]["shards"]
    return data


def norm_as_f16(header: dict, data: bytes) -> bytes:
    header["model.norm"]["dtype"] = "F16"
    return data


def corrupt_header_json(path: str) -> None:
    with open(os.path.join(path, R1), "r+b") as f:
        f.seek(8)
        f.write(b"[")
    reseal(path)


def swap_w_offsets(o: dict) -> None:
    a, b = shards(o, "model.w")
    a["offsets"], b["offsets"] = b["offsets"], a["offsets"]


def add_view_past_end(o: dict) -> None:
    o["storages"][".storage.model.v"] = {"dtype": "F32", "shape": [0], "shards": []}
    o["tensors"]["model.v"] = {"dtype": "F32", "shape": [2],
                               "view": {"base": ".storage.model.v", "storage_offset": 0, "stride": [1]}}


def seq(*steps: Callable[[str], None]) -> Callable[[str], None]:
    def make(path: str) -> None:
        for step in steps:
            step(path)
    return make


# ----------------------------------------------------------------------------- the cases

OPEN, LOAD = "open", "load"
CASES = [
    # 1: no COMMITTED, no manifest
    Case(name="item01-no-committed", section="11", item=1, fails_at=OPEN, error="CommitError", problem="not_committed",
         defect="COMMITTED is missing (an interrupted save)", make=remove("COMMITTED")),
    Case(name="item01-no-manifest", section="11", item=1, fails_at=OPEN, error="CommitError", problem="manifest_missing",
         defect="manifest.json is missing", make=remove("manifest.json")),
    # 2: COMMITTED malformed
    Case(name="item02-committed-not-json", section="11", item=2, fails_at=OPEN, error="ManifestError", problem="not_committed",
         defect="COMMITTED is not JSON", make=write_bytes("COMMITTED", b"committed\n")),
    Case(name="item02-committed-unknown-field", section="11", item=2, fails_at=OPEN, error="ManifestError", problem="not_committed",
         defect="COMMITTED has a field version 1 does not define", make=set_commit(step=7)),
    Case(name="item02-committed-missing-field", section="11", item=2, fails_at=OPEN, error="ManifestError", problem="not_committed",
         defect="COMMITTED has no save_id", make=set_commit(save_id=None)),
    Case(name="item02-committed-malformed-digest", section="11", item=2, fails_at=OPEN, error="ManifestError", problem="not_committed",
         defect="COMMITTED's manifest_digest is in uppercase hex",
         make=set_commit(manifest_digest="xxh3-128:DC238894AB0EDA55FC904C6CB1CE0057")),
    # 3: manifest digest
    Case(name="item03-manifest-digest-mismatch", section="11", item=3, fails_at=OPEN, error="IntegrityError", problem="manifest_digest",
         defect="manifest.json was edited after the commit (step 7 -> 8): its digest is not COMMITTED's",
         make=edit(lambda o: o.__setitem__("step", 8), sign=False)),
    # 4: manifest JSON, format, version
    Case(name="item04-manifest-not-json", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_json",
         defect="manifest.json is not valid JSON (cut short)", make=lambda p: write_manifest(p, b'{"format":"shardfmt",\n')),
    Case(name="item04-manifest-not-an-object", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="manifest.json's top level is an array", make=lambda p: write_manifest(p, b"[]\n")),
    Case(name="item04-nesting-too-deep", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_json",
         defect="metadata nests to depth 65 (64 nested arrays under the top-level object)",
         make=edit(lambda o: o.__setitem__("metadata", nested(64)))),
    Case(name="item04-format-not-shardfmt", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='format is "safetensors"', make=edit(lambda o: o.__setitem__("format", "safetensors"))),
    Case(name="item04-newer-format-version", section="11", item=4, fails_at=OPEN, error="FormatVersionError", problem="format_version",
         defect="format_version 3, newer than this reader's (a version error, not an invalid checkpoint)",
         make=edit(lambda o: o.__setitem__("format_version", 3))),
    Case(name="item04-version-never-written", section="11", item=4, fails_at=OPEN, error="FormatVersionError", problem="format_version",
         defect="format_version 0: no version 0 was ever written, so no reader exists for it",
         make=edit(lambda o: o.__setitem__("format_version", 0))),
    # 5: save ids
    Case(name="item05-save-id-mismatch", section="11", item=5, fails_at=OPEN, error="IntegrityError", problem="save_id",
         defect="COMMITTED's save_id is not the manifest's", make=set_commit(save_id="fedcba9876543210")),
    # 6: schema
    Case(name="item06-unknown-field", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the manifest has a top-level field version 1 does not define",
         make=edit(lambda o: o.__setitem__("comment", "x"))),
    Case(name="item06-missing-field", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the manifest has no created_at", make=edit(lambda o: o.pop("created_at"))),
    Case(name="item06-wrong-type", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='step is the string "7"', make=edit(lambda o: o.__setitem__("step", "7"))),
    Case(name="item06-hash-algorithm", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='hash_algorithm is "sha256"', make=edit(lambda o: o.__setitem__("hash_algorithm", "sha256"))),
    Case(name="item06-chunk-size-limit", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="chunk_size 1024, below the limit of 4096 (digests re-signed for it)",
         make=seq(edit(lambda o: o.__setitem__("chunk_size", 1024)), reseal)),
    # 7: file names
    Case(name="item07-name-escapes-data", section="11", item=7, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a file is named data/../rank_00001.safetensors", make=edit(rename_file("data/../rank_00001.safetensors"))),
    Case(name="item07-absolute-path", section="11", item=7, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a file is named /data/rank_00001.safetensors", make=edit(rename_file("/data/rank_00001.safetensors"))),
    Case(name="item07-shard-file-not-listed", section="11", item=7, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a shard of model.norm names data/rank_00009.safetensors, which files does not list",
         make=edit(lambda o: shards(o, "model.norm")[0].__setitem__("file", "data/rank_00009.safetensors"))),
    # 8: dtypes
    Case(name="item08-unknown-dtype", section="11", item=8, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='model.norm has dtype "BF17"', make=edit(lambda o: o["tensors"]["model.norm"].__setitem__("dtype", "BF17"))),
    # 9: element boxes
    Case(name="item09-negative-offset", section="11", item=9, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a shard of model.w has offsets [-3, 0]",
         make=edit(lambda o: shards(o, "model.w")[1].__setitem__("offsets", [-3, 0]))),
    Case(name="item09-slice-outside-shape", section="11", item=9, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a shard of model.w (6 x 4) has rows [4, 7)",
         make=edit(lambda o: shards(o, "model.w")[1].__setitem__("offsets", [4, 0]))),
    Case(name="item09-offsets-rank", section="11", item=9, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a shard of the 2-d model.w has one offset",
         make=edit(lambda o: shards(o, "model.w")[0].__setitem__("offsets", [0]))),
    # 10: byte ranges
    Case(name="item10-byte-range-length", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.norm (5 x BF16, 10 bytes) has byte range [400, 408)",
         make=edit(lambda o: shards(o, "model.norm")[0].__setitem__("byte_range", [400, 408]))),
    Case(name="item10-byte-range-in-header", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.norm's byte range [8, 18) starts inside the header (header_size 352)",
         make=edit(lambda o: shards(o, "model.norm")[0].__setitem__("byte_range", [8, 18]))),
    Case(name="item10-byte-range-past-file", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.norm's byte range [402, 412) ends past its 410-byte file",
         make=edit(lambda o: shards(o, "model.norm")[0].__setitem__("byte_range", [402, 412]))),
    # 11: file records
    Case(name="item11-chunk-count", section="11", item=11, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a 400-byte file with chunk_size 4096 lists two chunk digests",
         make=edit(lambda o: o["files"][R1]["chunks"].append(o["files"][R1]["chunks"][0]))),
    Case(name="item11-header-size-limit", section="11", item=11, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a file's header_size is 4 (below 8)", make=edit(lambda o: o["files"][R1].__setitem__("header_size", 4))),
    Case(name="item11-file-rank", section="11", item=11, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a file's rank is 2 in a world of 2", make=edit(lambda o: o["files"][R1].__setitem__("rank", 2))),
    # 12: tensor kinds, aliases, views, storages, names
    Case(name="item12-alias-target-missing", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.head is an alias of model.x, which does not exist",
         make=edit(lambda o: o["tensors"]["model.head"].__setitem__("alias_of", "model.x"))),
    Case(name="item12-alias-shape-differs", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.head (4 x 6) is an alias of model.w (6 x 4)",
         make=edit(lambda o: o["tensors"]["model.head"].__setitem__("shape", [4, 6]))),
    Case(name="item12-two-kinds", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.norm has both shards and alias_of",
         make=edit(lambda o: o["tensors"]["model.norm"].__setitem__("alias_of", "model.w"))),
    Case(name="item12-name-in-two-maps", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.w is both a tensor and a value",
         make=edit(lambda o: o["values"].__setitem__("model.w", {"value": 1}))),
    Case(name="item12-storage-not-1d", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a storage record of shape [2, 0]",
         make=edit(lambda o: o["storages"].__setitem__(".storage.s", {"dtype": "F32", "shape": [2, 0], "shards": []}))),
    Case(name="item12-view-past-end", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.v, a view of 2 elements, reaches past the end of its empty storage",
         make=edit(add_view_past_end)),
    # 13: topology, placements, value records
    Case(name="item13-mesh-product", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the mesh dp=3 does not multiply to world_size 2",
         make=edit(lambda o: o["topology"]["mesh"][0].__setitem__("size", 3))),
    Case(name="item13-ranks-list", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="topology.ranks is [[1], [0]], not every rank's row-major coordinates",
         make=edit(lambda o: o["topology"].__setitem__("ranks", [[1], [0]]))),
    Case(name="item13-unknown-placement", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='model.w has the placement ["bogus"]',
         make=edit(lambda o: o["tensors"]["model.w"].__setitem__(
             "placement", {"mesh_dims": ["dp"], "placements": [["bogus"]], "stage": None}))),
    Case(name="item13-value-record", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the value record of rng has both value and per_rank",
         make=edit(lambda o: o["values"]["rng"].__setitem__("value", 1))),
    Case(name="item13-per-rank-key", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='rng has the per-rank key "00", not canonical decimal',
         make=edit(lambda o: o["values"]["rng"]["per_rank"].__setitem__("00", o["values"]["rng"]["per_rank"].pop("0")))),
    Case(name="item13-per-rank-key-past-world", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='rng has the per-rank key "2" in a world of 2',
         make=edit(lambda o: o["values"]["rng"]["per_rank"].__setitem__("2", 0))),
    # 14-17: files, while loading
    Case(name="item14-truncated-file", section="11", item=14, fails_at=LOAD, error="IntegrityError", problem="file_size",
         defect="data/rank_00001.safetensors lost its last 8 bytes",
         make=lambda p: os.truncate(os.path.join(p, R1), 392)),
    Case(name="item15-chunk-hash", section="11", item=15, fails_at=LOAD, error="IntegrityError", problem="chunk_hash",
         defect="a data byte of model.w in data/rank_00001.safetensors is flipped", make=flip(R1, 390)),
    Case(name="item15-header-digest", section="11", item=15, fails_at=LOAD, error="IntegrityError", problem="header",
         defect="a padding byte of rank 1's header is a tab; every digest re-signed but header_digest",
         make=stale_header_digest),
    Case(name="item15-header-size-vs-prefix", section="11", item=15, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's header_size is 336, its length prefix says 8 + 336 (header_digest re-signed for 336 bytes)",
         make=short_header_size),
    Case(name="item16-header-not-json", section="11", item=16, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's header starts with [ (re-signed)", make=corrupt_header_json),
    Case(name="item16-no-shards-metadata", section="11", item=16, fails_at=LOAD, error="HeaderError", problem="header",
         defect='rank 1\'s header has no __metadata__["shards"] (re-signed)', make=edit_file(R1, drop_shards_entry)),
    Case(name="item16-data-past-entries", section="11", item=16, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's file has 8 bytes after its last tensor (re-signed)",
         make=edit_file(R1, lambda h, d: d + bytes(8))),
    Case(name="item17-key-form", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect='model.norm\'s shard has key "norm" (neither its name nor name@offsets)',
         make=edit(lambda o: shards(o, "model.norm")[0].__setitem__("key", "norm"))),
    Case(name="item17-header-dtype", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 0's header says model.norm is F16, the manifest BF16 (re-signed)", make=edit_file(R0, norm_as_f16)),
    Case(name="item17-offsets-swapped", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect="the offsets of model.w's two shards are swapped in the manifest (re-signed): only the files' shards entries tell",
         make=edit(swap_w_offsets)),
    # 18: special files
    Case(name="item18-data-file-link", section="11", item=18, fails_at=LOAD, error="SpecialFileError", problem="special_file",
         defect="data/rank_00001.safetensors is a symbolic link (to a regular file beside it)", make=link_data_file),
    Case(name="item18-data-dir-link", section="11", item=18, fails_at=LOAD, error="SpecialFileError", problem="special_file",
         defect="data/ is a symbolic link (to data.real/)", make=link_data_dir),
    # unnumbered rules: tiling (section 10), typed JSON (section 8)
    Case(name="sec10-tiling-gap", section="10", item=None, fails_at=LOAD, error="PlanError", problem="tiling",
         defect="model.w's shards hold rows [0, 3) and [4, 6): row 3 is in none (files and digests consistent)",
         make=resize_w_on_rank1(4)),
    Case(name="sec10-tiling-overlap", section="10", item=None, fails_at=LOAD, error="PlanError", problem="tiling",
         defect="model.w's shards hold rows [0, 3) and [2, 6): row 2 is in both (files and digests consistent)",
         make=resize_w_on_rank1(2)),
    Case(name="sec08-value-unknown-tag", section="8", item=None, fails_at=LOAD, error="ManifestError", problem="value",
         defect='optim.param_groups is {"$nope": 1}, an unknown tag',
         make=edit(lambda o: o["values"]["optim.param_groups"].__setitem__("value", {"$nope": 1}))),
]


def write_case(case: Case, out: str) -> None:
    """Write ``case`` into the new directory ``out``."""
    shutil.copytree(GOLDEN, out)
    case.make(out)
    with open(os.path.join(out, "expect.json"), "wb") as f:
        f.write(case.expect())


def write_all(root: str) -> None:
    os.makedirs(root, exist_ok=True)
    for case in CASES:
        write_case(case, os.path.join(root, case.name))


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("pass --write to regenerate spec/golden/invalid")
    for name in os.listdir(INVALID) if os.path.isdir(INVALID) else ():
        if os.path.isdir(os.path.join(INVALID, name)):
            shutil.rmtree(os.path.join(INVALID, name))
    write_all(INVALID)
    print("wrote", len(CASES), "cases under", INVALID)
