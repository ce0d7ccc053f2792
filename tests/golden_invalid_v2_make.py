"""Write spec/golden/invalid-v2/: the golden checkpoint spec/golden/v2 with one defect per case.

Each case directory holds the checkpoint and ``expect.json``, as spec/golden/invalid/ does for
version 1 (FORMAT.md section 11.1): the rule it breaks (``section`` of FORMAT.md, and ``item`` of
section 11's reject list, or null for the unnumbered rules of sections 8 and 10), ``fails_at``
("open": opening the checkpoint, COMMITTED and the root manifest, already refuses it; "load": it
opens, and a load that reads the parts, rank indexes and files it needs refuses it), the error
class a load raises (``shardfmt.errors``) and the code of the validator's problem.

Where a digest would catch a defect first, the case is re-signed as a hostile author would, up
the chain that vouches for what it edits: a data file's edit re-signs its rank index (size,
header size and digest, shard-aligned chunk digests, file digest), a rank index's edit its entry
in the rank-table part, a part's edit its record in the root, and a root's edit COMMITTED. The
digests are computed here from the bytes (xxh3-128 and section 6's rules), not by shardfmt.

A case that git cannot hold (a FIFO) is committed without that file and names it in
``expect.json`` under ``special`` (``{"path": ..., "kind": "fifo"}``): whoever uses the case
creates it first (``make_special``), as tests/test_golden_invalid_v2.py does.

Regenerate (deterministic: the same bytes every time): ``python tests/golden_invalid_v2_make.py --write``.
``tests/test_golden_invalid_v2.py`` checks that the committed cases are what this script writes.
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

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.normpath(os.path.join(HERE, "..", "spec", "golden", "v2"))
INVALID = os.path.normpath(os.path.join(HERE, "..", "spec", "golden", "invalid-v2"))
CHUNK = 4096  # spec/golden/v2's chunk_size
PART = "index/ranks_00000000.json"


def data(rank: int) -> str:
    return f"data/rank_{rank:05d}.safetensors"


def index(rank: int) -> str:
    return f"index/rank_{rank:05d}.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    section: str
    item: int | None
    defect: str
    fails_at: str  # "open" or "load"
    error: str     # class name in shardfmt.errors
    problem: str | None  # the validator's Problem.code (None: the validator finds it valid; only a load refuses it)
    make: Callable[[str], None]
    special: tuple[str, str] | None = None  # (path, kind): made by whoever uses the case

    def expect(self) -> bytes:
        obj = {"section": self.section, "item": self.item, "defect": self.defect,
               "fails_at": self.fails_at, "error": self.error, "problem": self.problem}
        if self.special is not None:
            obj["special"] = {"path": self.special[0], "kind": self.special[1]}
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def make_special(path: str, special: dict) -> None:
    """Create the file git cannot hold that a case's ``expect.json`` names."""
    assert special["kind"] == "fifo", special
    os.mkfifo(os.path.join(path, special["path"]))


# ----------------------------------------------------------------------------- signing

def digest(raw: bytes) -> str:
    """A digest string as FORMAT.md section 6 spells it."""
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(raw)


def dumps(obj) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"


def read_json(path: str, name: str):
    with open(os.path.join(path, name), "rb") as f:
        return orjson.loads(f.read())


def write_raw(path: str, name: str, raw: bytes) -> bytes:
    with open(os.path.join(path, name), "wb") as f:
        f.write(raw)
    return raw


def sign_root(path: str) -> None:
    """COMMITTED vouches for manifest.json as it is."""
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        raw = f.read()
    commit = read_json(path, "COMMITTED")
    commit["manifest_digest"] = digest(raw)
    write_raw(path, "COMMITTED", dumps(commit))


def sign_part(path: str) -> None:
    """The root's part record vouches for the rank-table part as it is; then COMMITTED."""
    with open(os.path.join(path, PART), "rb") as f:
        raw = f.read()
    root = read_json(path, "manifest.json")
    root["ranks"][0].update(size=len(raw), digest=digest(raw))
    write_raw(path, "manifest.json", dumps(root))
    sign_root(path)


def sign_index(path: str, rank: int) -> None:
    """Rank ``rank``'s entry in the part vouches for its index as it is; then up the chain."""
    with open(os.path.join(path, index(rank)), "rb") as f:
        raw = f.read()
    part = read_json(path, PART)
    part["ranks"][str(rank)].update(size=len(raw), digest=digest(raw))
    write_raw(path, PART, dumps(part))
    sign_part(path)


def file_record(raw: bytes) -> dict:
    """A data file's record as its writer's index holds it (section 4.2, section 6)."""
    n = struct.unpack("<Q", raw[:8])[0]
    header = orjson.loads(raw[8:8 + n])
    spans = sorted((8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1])
                   for k, e in header.items() if k != "__metadata__")
    chunks = [xxhash.xxh3_128_digest(raw[s:min(s + CHUNK, e)]) for a, e in spans if a < e
              for s in range(a, e, CHUNK)]
    head = xxhash.xxh3_128_digest(raw[:8 + n])
    return {"size": len(raw), "header_size": 8 + n, "header_digest": "xxh3-128:" + head.hex(),
            "digest": digest(head + b"".join(chunks)), "chunks": b"".join(chunks).hex()}


def sign_file(path: str, rank: int, name: str | None = None) -> None:
    """Rank ``rank``'s index records its data file ``name`` (default: its one file) as it is;
    then up the chain."""
    name = name or data(rank)
    with open(os.path.join(path, name), "rb") as f:
        raw = f.read()
    idx = read_json(path, index(rank))
    idx["files"][name] = file_record(raw)
    write_raw(path, index(rank), dumps(idx))
    sign_index(path, rank)


# ----------------------------------------------------------------------------- edits

def root(fn: Callable[[dict], None], *, sign: bool = True) -> Callable[[str], None]:
    """A case that edits the root manifest (and, with ``sign``, re-signs COMMITTED)."""
    def make(path: str) -> None:
        obj = read_json(path, "manifest.json")
        fn(obj)
        write_raw(path, "manifest.json", dumps(obj))
        if sign:
            sign_root(path)
    return make


def part(fn: Callable[[dict], None], *, sign: bool = True) -> Callable[[str], None]:
    def make(path: str) -> None:
        obj = read_json(path, PART)
        fn(obj)
        write_raw(path, PART, dumps(obj))
        if sign:
            sign_part(path)
    return make


def rank_index(rank: int, fn: Callable[[dict], None], *, sign: bool = True) -> Callable[[str], None]:
    def make(path: str) -> None:
        obj = read_json(path, index(rank))
        fn(obj)
        write_raw(path, index(rank), dumps(obj))
        if sign:
            sign_index(path, rank)
    return make


def file_of(idx: dict, rank: int) -> dict:
    return idx["files"][data(rank)]


def read_file(path: str, rank: int) -> tuple[dict, dict[str, bytes]]:
    """A data file's header (decoded, ``shards`` decoded too) and each entry's bytes."""
    with open(os.path.join(path, data(rank)), "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = orjson.loads(raw[8:8 + n])
    header["__metadata__"]["shards"] = orjson.loads(header["__metadata__"]["shards"])
    blobs = {k: raw[8 + n + e["data_offsets"][0]:8 + n + e["data_offsets"][1]]
             for k, e in header.items() if k != "__metadata__"}
    return header, blobs


def write_file(path: str, rank: int, header: dict, blobs: dict[str, bytes], *, tail: bytes = b"",
               name: str | None = None) -> None:
    """Pack ``blobs`` in the file's order (its entries' old starts; new keys last) with offsets
    that follow their lengths, as shardfmt writes a file (compact sorted header, space-padded
    to 8 bytes), then re-sign it."""
    meta = header.pop("__metadata__")
    order = sorted(blobs, key=lambda k: (header[k].get("data_offsets", [1 << 62])[0], k))
    pos, body = 0, b""
    for k in order:
        header[k]["data_offsets"] = [pos, pos + len(blobs[k])]
        pos += len(blobs[k])
        body += blobs[k]
    if "shards" in meta:
        meta = {**meta, "shards": orjson.dumps(meta["shards"], option=orjson.OPT_SORT_KEYS).decode()}
    header["__metadata__"] = meta
    text = orjson.dumps(header, option=orjson.OPT_SORT_KEYS)
    text += b" " * (-(8 + len(text)) % 8)
    write_raw(path, name or data(rank), struct.pack("<Q", len(text)) + text + body + tail)
    sign_file(path, rank, name)


def edit_file(rank: int, fn: Callable[[dict, dict[str, bytes]], None], *, tail: bytes = b"") -> Callable[[str], None]:
    """A case that edits a data file's header and entries (``fn`` edits both in place), re-signed."""
    def make(path: str) -> None:
        header, blobs = read_file(path, rank)
        fn(header, blobs)
        write_file(path, rank, header, blobs, tail=tail)
    return make


def flip(name: str, offset: int) -> Callable[[str], None]:
    def make(path: str) -> None:
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x40]))
    return make


def set_commit(**fields) -> Callable[[str], None]:
    """A case whose COMMITTED has ``fields`` changed (None removes one)."""
    def make(path: str) -> None:
        obj = read_json(path, "COMMITTED")
        for k, v in fields.items():
            if v is None:
                obj.pop(k)
            else:
                obj[k] = v
        write_raw(path, "COMMITTED", dumps(obj))
    return make


def write_bytes(name: str, raw: bytes, *, sign: bool = False) -> Callable[[str], None]:
    def make(path: str) -> None:
        write_raw(path, name, raw)
        if sign:
            sign_root(path)
    return make


def remove(name: str) -> Callable[[str], None]:
    return lambda path: os.remove(os.path.join(path, name))


def seq(*steps: Callable[[str], None]) -> Callable[[str], None]:
    def make(path: str) -> None:
        for step in steps:
            step(path)
    return make


def nested(depth: int):
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def tensor(fqn: str) -> Callable[[Callable[[dict], None]], Callable[[str], None]]:
    """An edit of one record of the root's ``tensors``."""
    return lambda fn: root(lambda o: fn(o["tensors"][fqn]))


def replace_kind(**kind) -> Callable[[dict], None]:
    def fn(rec: dict) -> None:
        for k in ("shards", "placed", "alias_of", "view"):
            rec.pop(k, None)
        rec.update(kind)
    return fn


def placed(**changes) -> Callable[[dict], None]:
    return lambda rec: rec["placed"].update(changes)


def emb_rows_on_rank1(first_row: int) -> Callable[[str], None]:
    """Rank 1's listed box of model.emb (24 x 64 F32, rows [18, 24)) becomes rows
    [first_row, 24), its bytes the tensor's (rank 0 holds rows [0, 18)); its file, index and
    the root's box re-signed: files and digests agree, only the tiling is wrong."""
    def make(path: str) -> None:
        _, b0 = read_file(path, 0)
        header, blobs = read_file(path, 1)
        rows = b0["model.emb"] + blobs["model.emb"]
        blobs["model.emb"] = rows[first_row * 256:]
        header["model.emb"]["shape"] = [24 - first_row, 64]
        header["__metadata__"]["shards"]["model.emb"]["offsets"] = [first_row, 0]
        write_file(path, 1, header, blobs)
        root(lambda o: o["tensors"]["model.emb"]["shards"][1].update(offsets=[first_row, 0],
                                                                     lengths=[24 - first_row, 64]))(path)
    return make


def stale_header_digest(path: str) -> None:
    """A padding byte of rank 0's header becomes a tab (still JSON whitespace); everything is
    re-signed but the index's header_digest."""
    old = file_of(read_json(path, index(0)), 0)["header_digest"]
    with open(os.path.join(path, data(0)), "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n - 1)
        assert f.read(1) == b" "
        f.seek(8 + n - 1)
        f.write(b"\t")
    sign_file(path, 0)
    rank_index(0, lambda o: file_of(o, 0).update(header_digest=old))(path)


def short_header_size(path: str) -> None:
    """Rank 1's index says header_size 8 less than its length prefix (header_digest and file
    digest re-signed for those bytes, the chunks unchanged)."""
    idx = read_json(path, index(1))
    rec = file_of(idx, 1)
    with open(os.path.join(path, data(1)), "rb") as f:
        head = f.read(rec["header_size"] - 8)
    rec["header_size"] -= 8
    rec["header_digest"] = digest(head)
    rec["digest"] = digest(xxhash.xxh3_128_digest(head) + bytes.fromhex(rec["chunks"]))
    write_raw(path, index(1), dumps(idx))
    sign_index(path, 1)


def corrupt_header_json(path: str) -> None:
    with open(os.path.join(path, data(1)), "r+b") as f:
        f.seek(8)
        f.write(b"[")
    idx = read_json(path, index(1))
    with open(os.path.join(path, data(1)), "rb") as f:
        raw = f.read()
    rec = file_of(idx, 1)
    head = xxhash.xxh3_128_digest(raw[:rec["header_size"]])
    rec.update(header_digest="xxh3-128:" + head.hex(), digest=digest(head + bytes.fromhex(rec["chunks"])))
    write_raw(path, index(1), dumps(idx))
    sign_index(path, 1)


def link(name: str) -> Callable[[str], None]:
    """``name`` becomes a symbolic link to a regular copy beside it (``<name>.real``)."""
    def make(path: str) -> None:
        f = os.path.join(path, name)
        os.rename(f, f + ".real")
        os.symlink(os.path.basename(name) + ".real", f)
    return make


def over_1024_ranks(o: dict) -> None:
    """world 2048 (mesh dp=1024 x tp=2) in one part of ranks [0, 2048)."""
    o["topology"] = {"world_size": 2048, "mesh": [{"name": "dp", "size": 1024}, {"name": "tp", "size": 2}]}
    o["ranks"][0]["end"] = 2048


def drop_rank(rank: int) -> Callable[[dict], None]:
    return lambda o: o["ranks"].pop(str(rank))


def swap_key_offsets(h: dict, blobs: dict) -> None:
    """rank 2's header says its wo box (columns [0, 3)) is at offsets [0, 3]."""
    h["__metadata__"]["shards"]["model.layers.0.wo"]["offsets"] = [0, 3]


def rename_key(old: str, new: str) -> Callable[[dict, dict], None]:
    def fn(h: dict, blobs: dict) -> None:
        h[new] = h.pop(old)
        blobs[new] = blobs.pop(old)
        shards = h["__metadata__"]["shards"]
        shards[new] = shards.pop(old)
    return fn


def norm_twice(h: dict, blobs: dict) -> None:
    """rank 1's file holds model.norm's box under two keys (``model.norm``, ``model.norm@0``)."""
    h["model.norm@0"] = dict(h["model.norm"])
    blobs["model.norm@0"] = blobs["model.norm"]
    h["__metadata__"]["shards"]["model.norm@0"] = dict(h["__metadata__"]["shards"]["model.norm"])


def norm_in_a_second_file(path: str) -> None:
    """Rank 1 also wrote data/rank_00001_part_001.safetensors, holding model.norm's box again."""
    header, blobs = read_file(path, 1)
    shards = header["__metadata__"]["shards"]
    header = {"model.norm": header["model.norm"],
              "__metadata__": {**header["__metadata__"], "shards": {"model.norm": shards["model.norm"]}}}
    write_file(path, 1, header, {"model.norm": blobs["model.norm"]}, name="data/rank_00001_part_001.safetensors")


# ----------------------------------------------------------------------------- the cases

OPEN, LOAD = "open", "load"
EMB = "model.emb"
WQ, W1, WO = "model.layers.0.wq", "model.layers.0.w1", "model.layers.0.wo"
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
         defect="COMMITTED has a field version 2 does not define", make=set_commit(step=7)),
    Case(name="item02-committed-missing-field", section="11", item=2, fails_at=OPEN, error="ManifestError", problem="not_committed",
         defect="COMMITTED has no save_id", make=set_commit(save_id=None)),
    Case(name="item02-committed-malformed-digest", section="11", item=2, fails_at=OPEN, error="ManifestError", problem="not_committed",
         defect="COMMITTED's manifest_digest is in uppercase hex",
         make=set_commit(manifest_digest="xxh3-128:DC238894AB0EDA55FC904C6CB1CE0057")),
    Case(name="item02-committed-version-1", section="11", item=2, fails_at=OPEN, error="IntegrityError", problem="not_committed",
         defect="COMMITTED has no format_version (version 1's marker) over a version-2 manifest",
         make=set_commit(format_version=None)),
    # 3: digests of the root, the parts, the rank indexes
    Case(name="item03-manifest-digest-mismatch", section="11", item=3, fails_at=OPEN, error="IntegrityError", problem="manifest_digest",
         defect="manifest.json was edited after the commit (step 7 -> 8): its digest is not COMMITTED's",
         make=root(lambda o: o.__setitem__("step", 8), sign=False)),
    Case(name="item03-part-digest-mismatch", section="11", item=3, fails_at=LOAD, error="IntegrityError", problem="rank_table",
         defect="the rank-table part was edited after the commit (rank 3's index size 392 -> 393): not the root's digest",
         make=part(lambda o: o["ranks"]["3"].__setitem__("size", 393), sign=False)),
    Case(name="item03-index-digest-mismatch", section="11", item=3, fails_at=LOAD, error="IntegrityError", problem="rank_index",
         defect="rank 1's index was edited after the commit (its file's size 2266 -> 2267): not the part's digest",
         make=rank_index(1, lambda o: file_of(o, 1).__setitem__("size", 2267), sign=False)),
    Case(name="item03-part-missing", section="11", item=3, fails_at=LOAD, error="IntegrityError", problem="rank_table",
         defect="index/ranks_00000000.json, the one rank-table part, is missing", make=remove(PART)),
    Case(name="item03-index-missing", section="11", item=3, fails_at=LOAD, error="IntegrityError", problem="rank_index",
         defect="index/rank_00002.json, which the rank table names, is missing", make=remove(index(2))),
    # 4: root JSON, format, version, required extensions; a part's nesting
    Case(name="item04-manifest-not-json", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_json",
         defect="manifest.json is not valid JSON (cut short)", make=write_bytes("manifest.json", b'{"format":"shardfmt",\n', sign=True)),
    Case(name="item04-manifest-not-an-object", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="manifest.json's top level is an array", make=write_bytes("manifest.json", b"[]\n", sign=True)),
    Case(name="item04-nesting-too-deep", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_json",
         defect="metadata nests to depth 65 (64 nested arrays under the top-level object)",
         make=root(lambda o: o.__setitem__("metadata", nested(64)))),
    Case(name="item04-index-nesting-too-deep", section="11", item=4, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 1's per-rank value rng nests to depth 65 of its index (63 nested arrays at depth 3; re-signed)",
         make=rank_index(1, lambda o: o["values"].__setitem__("rng", nested(63)))),
    Case(name="item04-format-not-shardfmt", section="11", item=4, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='format is "safetensors"', make=root(lambda o: o.__setitem__("format", "safetensors"))),
    Case(name="item04-newer-format-version", section="11", item=4, fails_at=OPEN, error="FormatVersionError", problem="format_version",
         defect="format_version 3, newer than this reader's (a version error, not an invalid checkpoint)",
         make=root(lambda o: o.__setitem__("format_version", 3))),
    Case(name="item04-version-never-written", section="11", item=4, fails_at=OPEN, error="FormatVersionError", problem="format_version",
         defect="format_version 0: no version 0 was ever written, so no reader exists for it",
         make=root(lambda o: o.__setitem__("format_version", 0))),
    Case(name="item04-unknown-required-extension", section="11", item=4, fails_at=OPEN, error="FormatVersionError",
         problem="format_version", defect='a required extension "flat_ranges" this reader does not know',
         make=root(lambda o: o["extensions"].__setitem__("flat_ranges", {"required": True, "value": None}))),
    # 5: save ids
    Case(name="item05-save-id-mismatch", section="11", item=5, fails_at=OPEN, error="IntegrityError", problem="save_id",
         defect="COMMITTED's save_id is not the manifest's", make=set_commit(save_id="fedcba9876543210")),
    Case(name="item05-part-save-id", section="11", item=5, fails_at=LOAD, error="ManifestError", problem="rank_table",
         defect="the rank-table part's save_id is not the root's (re-signed)",
         make=part(lambda o: o.__setitem__("save_id", "fedcba9876543210"))),
    Case(name="item05-index-save-id", section="11", item=5, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 2's index's save_id is not the root's (re-signed)",
         make=rank_index(2, lambda o: o.__setitem__("save_id", "fedcba9876543210"))),
    # 6: schema
    Case(name="item06-unknown-field", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the root has version 1's top-level files, which version 2 does not define",
         make=root(lambda o: o.__setitem__("files", {}))),
    Case(name="item06-topology-ranks", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="topology has version 1's ranks list, which version 2 derives and does not define",
         make=root(lambda o: o["topology"].__setitem__("ranks", [[0, 0], [0, 1], [1, 0], [1, 1]]))),
    Case(name="item06-missing-field", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the root has no extensions", make=root(lambda o: o.pop("extensions"))),
    Case(name="item06-wrong-type", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='step is the string "7"', make=root(lambda o: o.__setitem__("step", "7"))),
    Case(name="item06-hash-algorithm", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='hash_algorithm is "sha256"', make=root(lambda o: o.__setitem__("hash_algorithm", "sha256"))),
    Case(name="item06-chunk-size-limit", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="chunk_size 1024, below the limit of 4096", make=root(lambda o: o.__setitem__("chunk_size", 1024))),
    Case(name="item06-part-record-digest", section="11", item=6, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the root's part record has a digest without its xxh3-128: prefix",
         make=root(lambda o: o["ranks"][0].__setitem__("digest", o["ranks"][0]["digest"][9:]))),
    Case(name="item06-index-unknown-field", section="11", item=6, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 0's index has a field version 2 does not define (re-signed)",
         make=rank_index(0, lambda o: o.__setitem__("step", 7))),
    Case(name="item06-part-entry-missing-field", section="11", item=6, fails_at=LOAD, error="ManifestError", problem="rank_table",
         defect="rank 2's rank-table entry has no size (re-signed)", make=part(lambda o: o["ranks"]["2"].pop("size"))),
    # 7: names
    Case(name="item07-name-escapes-data", section="11", item=7, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 1's index names its file data/../rank_00001.safetensors (re-signed)",
         make=rank_index(1, lambda o: o["files"].__setitem__("data/../rank_00001.safetensors", o["files"].pop(data(1))))),
    Case(name="item07-absolute-path", section="11", item=7, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 1's index names its file /data/rank_00001.safetensors (re-signed)",
         make=rank_index(1, lambda o: o["files"].__setitem__("/data/rank_00001.safetensors", o["files"].pop(data(1))))),
    Case(name="item07-part-name", section="11", item=7, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the root names its rank-table part index/ranks_0.json", make=root(lambda o: o["ranks"][0].__setitem__("name", "index/ranks_0.json"))),
    Case(name="item07-index-name", section="11", item=7, fails_at=LOAD, error="ManifestError", problem="rank_table",
         defect="the part names rank 2's index index/rank_00003.json, another rank's name (re-signed)",
         make=part(lambda o: o["ranks"]["2"].__setitem__("name", index(3)))),
    # 8: dtypes
    Case(name="item08-unknown-dtype", section="11", item=8, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='model.norm has dtype "BF17"', make=tensor("model.norm")(lambda r: r.__setitem__("dtype", "BF17"))),
    # 9: listed boxes
    Case(name="item09-negative-offset", section="11", item=9, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a listed box of model.emb has offsets [-18, 0]",
         make=tensor(EMB)(lambda r: r["shards"][1].__setitem__("offsets", [-18, 0]))),
    Case(name="item09-slice-outside-shape", section="11", item=9, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a listed box of model.emb (24 x 64) has rows [20, 26)",
         make=tensor(EMB)(lambda r: r["shards"][1].__setitem__("offsets", [20, 0]))),
    Case(name="item09-offsets-rank", section="11", item=9, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a listed box of the 2-d model.emb has one offset",
         make=tensor(EMB)(lambda r: r["shards"][0].__setitem__("offsets", [0]))),
    # 10: writer ranks, placed records against the mesh
    Case(name="item10-listed-rank-past-world", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a listed box of model.emb was written by rank 4, in a world of 4",
         make=tensor(EMB)(lambda r: r["shards"][1].__setitem__("rank", 4))),
    Case(name="item10-placed-mesh-dim-missing", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.layers.0.wq is placed over mesh dims dp and ep; the mesh is dp x tp",
         make=tensor(WQ)(placed(mesh_dims=["dp", "ep"]))),
    Case(name="item10-placed-mesh-dim-twice", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.layers.0.wq is placed over mesh dims dp and dp",
         make=tensor(WQ)(placed(mesh_dims=["dp", "dp"]))),
    Case(name="item10-stage-without-pp", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.norm is placed at stage 0; the mesh dp x tp has no pp dim",
         make=tensor("model.norm")(placed(stage=0))),
    Case(name="item10-writer-limit", section="11", item=10, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.norm's writer is 2^24, above the limit 2^24 - 1", make=tensor("model.norm")(placed(writer=1 << 24))),
    # 11: file records of the rank indexes
    Case(name="item11-chunk-count", section="11", item=11, fails_at=LOAD, error="IntegrityError", problem="chunks",
         defect="rank 0's index lists 5 chunk digests; its header's entries cut into 6 (emb's 4608 bytes into 2; re-signed)",
         make=rank_index(0, lambda o: file_of(o, 0).__setitem__("chunks", file_of(o, 0)["chunks"][:-32]))),
    Case(name="item11-chunks-not-hex", section="11", item=11, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 3's index gives its chunk digests in uppercase hex (re-signed)",
         make=rank_index(3, lambda o: file_of(o, 3).__setitem__("chunks", file_of(o, 3)["chunks"].upper()))),
    Case(name="item11-header-size-limit", section="11", item=11, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 1's index gives its file header_size 4 (below 8; re-signed)",
         make=rank_index(1, lambda o: file_of(o, 1).__setitem__("header_size", 4))),
    Case(name="item11-header-size-past-file", section="11", item=11, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 3's index gives its 932-byte file header_size 936 (re-signed)",
         make=rank_index(3, lambda o: file_of(o, 3).__setitem__("header_size", 936))),
    # 12: kinds, aliases, views, storages, names
    Case(name="item12-alias-target-missing", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.head is an alias of model.x, which does not exist",
         make=tensor("model.head")(lambda r: r.__setitem__("alias_of", "model.x"))),
    Case(name="item12-alias-shape-differs", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.head (64 x 24) is an alias of model.emb (24 x 64)",
         make=tensor("model.head")(lambda r: r.__setitem__("shape", [64, 24]))),
    Case(name="item12-two-kinds", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.emb has both shards and placed",
         make=tensor(EMB)(lambda r: r.__setitem__("placed", {"mesh_dims": [], "placements": [], "stage": None, "writer": 0}))),
    Case(name="item12-placement-beside-placed", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.norm is placed and also has a descriptive placement",
         make=tensor("model.norm")(lambda r: r.__setitem__("placement", {"mesh_dims": [], "placements": [], "stage": None}))),
    Case(name="item12-name-in-two-maps", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.emb is both a tensor and a value", make=root(lambda o: o["values"].__setitem__(EMB, {"value": 1}))),
    Case(name="item12-storage-not-1d", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="a storage record of shape [2, 0]",
         make=root(lambda o: o["storages"].__setitem__(".storage.s", {"dtype": "F32", "shape": [2, 0], "shards": []}))),
    Case(name="item12-storage-alias", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the storage .storage.model.rope.cos is an alias of model.emb, not stored by placed or shards",
         make=root(lambda o: replace_kind(alias_of=EMB)(o["storages"][".storage.model.rope.cos"]))),
    Case(name="item12-view-past-end", section="11", item=12, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.rope.sin (4 elements from storage offset 7) reaches past the end of its 10-element storage",
         make=tensor("model.rope.sin")(lambda r: r["view"].__setitem__("storage_offset", 7))),
    # 13: mesh, placements, value records, rank keys
    Case(name="item13-mesh-product", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the mesh dp=3 x tp=2 does not multiply to world_size 4",
         make=root(lambda o: o["topology"]["mesh"][0].__setitem__("size", 3))),
    Case(name="item13-unknown-placement", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='model.layers.0.wo is placed with ["bogus"] over dp', make=tensor(WO)(placed(placements=[["bogus"], ["shard", 1]]))),
    Case(name="item13-placements-length", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="model.layers.0.wq names two mesh dims and has one placement",
         make=tensor(WQ)(placed(placements=[["shard", 0]]))),
    Case(name="item13-shard-of-0d", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the 0-d model.scale is placed with [\"shard\", 0] over tp", make=tensor("model.scale")(placed(placements=[["shard", 0]]))),
    Case(name="item13-flat-not-last", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='optim.w2 is placed with ["flat", 2, 6] over dp before ["shard", 1] over tp',
         make=tensor("optim.w2")(placed(mesh_dims=["dp", "tp"], placements=[["flat", 2, 6], ["shard", 1]]))),
    Case(name="item13-flat-after-strided", section="11", item=13, fails_at=OPEN, error="ManifestError",
         problem="manifest_field", defect='optim.w2 is placed with ["flat", 0, 9] after a strided_shard',
         make=tensor("optim.w2")(placed(placements=[["strided_shard", 1, 2], ["flat", 0, 9]]))),
    Case(name="item13-flat-short", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="optim.avg's 2 flat pieces of 2 elements from offset 0 do not reach its 5th element",
         make=tensor("optim.avg")(placed(placements=[["flat", 0, 2]]))),
    Case(name="item13-flat-of-0d", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect='the 0-d model.scale is placed with ["flat", 0, 1] over tp',
         make=tensor("model.scale")(placed(placements=[["flat", 0, 1]]))),
    Case(name="item13-value-record", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the value record of rng has both value and per_rank",
         make=root(lambda o: o["values"]["rng"].__setitem__("value", 1))),
    Case(name="item13-per-rank-map", section="11", item=13, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="rng's value record is version 1's {\"per_rank\": {rank: value}}, not {\"per_rank\": true}",
         make=root(lambda o: o["values"]["rng"].__setitem__("per_rank", {"0": 1}))),
    Case(name="item13-rank-key", section="11", item=13, fails_at=LOAD, error="ManifestError", problem="rank_table",
         defect='the part keys rank 1\'s entry "01", not canonical decimal (re-signed)',
         make=part(lambda o: o["ranks"].__setitem__("01", o["ranks"].pop("1")))),
    Case(name="item13-rank-key-past-part", section="11", item=13, fails_at=LOAD, error="ManifestError", problem="rank_table",
         defect='the part of ranks [0, 4) has an entry keyed "4" (re-signed)',
         make=part(lambda o: o["ranks"].__setitem__("4", dict(o["ranks"]["3"])))),
    # 14-17: data files, while loading
    Case(name="item14-truncated-file", section="11", item=14, fails_at=LOAD, error="IntegrityError", problem="file_size",
         defect="data/rank_00003.safetensors lost its last 4 bytes", make=lambda p: os.truncate(os.path.join(p, data(3)), 632)),
    Case(name="item15-chunk-hash", section="11", item=15, fails_at=LOAD, error="IntegrityError", problem="chunk_hash",
         defect="a byte of model.emb's second chunk in data/rank_00000.safetensors is flipped",
         make=flip(data(0), 936 + 40 + 4096 + 100)),
    Case(name="item15-header-digest", section="11", item=15, fails_at=LOAD, error="IntegrityError", problem="header",
         defect="a padding byte of rank 0's header is a tab; every digest re-signed but header_digest",
         make=stale_header_digest),
    Case(name="item15-header-size-vs-prefix", section="11", item=15, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's index says header_size 952, its length prefix 8 + 952 (header_digest re-signed for 672 bytes)",
         make=short_header_size),
    Case(name="item16-header-not-json", section="11", item=16, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's header starts with [ (re-signed)", make=corrupt_header_json),
    Case(name="item16-no-shards-metadata", section="11", item=16, fails_at=LOAD, error="HeaderError", problem="header",
         defect='rank 1\'s header has no __metadata__["shards"] (re-signed)',
         make=edit_file(1, lambda h, b: h["__metadata__"].pop("shards"))),
    Case(name="item16-data-past-entries", section="11", item=16, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 3's file has 8 bytes after its last tensor (re-signed)",
         make=edit_file(3, lambda h, b: None, tail=bytes(8))),
    Case(name="item17-key-form", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect='rank 1\'s file keys model.norm\'s box "norm" (neither its name nor name@offsets; re-signed)',
         make=edit_file(1, rename_key("model.norm", "norm"))),
    Case(name="item17-header-dtype", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's header says model.norm is F16, the root BF16 (re-signed)",
         make=edit_file(1, lambda h, b: h["model.norm"].__setitem__("dtype", "F16"))),
    Case(name="item17-global-shape", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 3's shards entry gives model.layers.0.wo the global shape [4, 7] (re-signed)",
         make=edit_file(3, lambda h, b: h["__metadata__"]["shards"][WO].__setitem__("global_shape", [4, 7]))),
    Case(name="item17-other-offsets", section="11", item=17, fails_at=LOAD, error="ManifestError", problem="missing_shards",
         defect="rank 2's shards entry places its box of model.layers.0.wo (columns [0, 3)) at offsets [0, 3] (re-signed)",
         make=edit_file(2, swap_key_offsets)),
    Case(name="item17-box-twice", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's file holds model.norm's one box twice, keys model.norm and model.norm@0 (re-signed)",
         make=edit_file(1, norm_twice)),
    Case(name="item17-box-in-two-files", section="11", item=17, fails_at=LOAD, error="HeaderError", problem="header",
         defect="rank 1's index lists a second file, data/rank_00001_part_001.safetensors, that holds model.norm's box too (re-signed)",
         make=norm_in_a_second_file),
    Case(name="item17-offsets-swapped", section="11", item=17, fails_at=LOAD, error="ManifestError", problem="missing_shards",
         defect="the root lists model.emb's boxes with their writers swapped (re-signed): rank 1's files hold no box at [0, 0]",
         make=tensor(EMB)(lambda r: [s.__setitem__("rank", 1 - s["rank"]) for s in r["shards"]])),
    # 18: special files
    Case(name="item18-index-fifo", section="11", item=18, fails_at=LOAD, error="SpecialFileError", problem="special_file",
         defect="index/rank_00001.json is a FIFO (git cannot hold one: expect.json's special says what to create)",
         make=remove(index(1)), special=(index(1), "fifo")),
    Case(name="item18-index-link", section="11", item=18, fails_at=LOAD, error="SpecialFileError", problem="special_file",
         defect="index/rank_00001.json is a symbolic link (to a regular copy beside it)", make=link(index(1))),
    Case(name="item18-part-link", section="11", item=18, fails_at=LOAD, error="SpecialFileError", problem="special_file",
         defect="index/ranks_00000000.json is a symbolic link (to a regular copy beside it)", make=link(PART)),
    Case(name="item18-index-dir-link", section="11", item=18, fails_at=LOAD, error="SpecialFileError", problem="special_file",
         defect="index/ is a symbolic link (to index.real/)", make=link("index")),
    Case(name="item18-data-file-link", section="11", item=18, fails_at=LOAD, error="SpecialFileError", problem="special_file",
         defect="data/rank_00002.safetensors is a symbolic link (to a regular copy beside it)", make=link(data(2))),
    # 19: the rank table
    Case(name="item19-parts-short-of-world", section="11", item=19, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="the root's one part covers ranks [0, 3) of a world of 4",
         make=root(lambda o: o["ranks"][0].__setitem__("end", 3))),
    Case(name="item19-part-over-1024-ranks", section="11", item=19, fails_at=OPEN, error="ManifestError", problem="manifest_field",
         defect="world 2048 (dp=1024 x tp=2) in one part of 2048 ranks", make=root(over_1024_ranks)),
    Case(name="item19-part-first-end", section="11", item=19, fails_at=LOAD, error="ManifestError", problem="rank_table",
         defect="the part says it covers ranks [0, 3), its root record [0, 4) (re-signed)",
         make=part(lambda o: o.__setitem__("end", 3))),
    Case(name="item19-index-rank", section="11", item=19, fails_at=LOAD, error="ManifestError", problem="rank_index",
         defect="rank 2's index says rank 3 (re-signed)", make=rank_index(2, lambda o: o.__setitem__("rank", 3))),
    Case(name="item19-rank-without-entry", section="11", item=19, fails_at=LOAD, error="ManifestError", problem="missing_shards",
         defect="the part has no entry for rank 3, which wrote boxes of model.layers.0.wq, wo and model.scale (re-signed)",
         make=part(drop_rank(3))),
    # 20: per-rank values
    Case(name="item20-per-rank-value-missing", section="11", item=20, fails_at=LOAD, error="ManifestError", problem=None,
         defect="rank 1's index holds no value of the per-rank rng (re-signed)",
         make=rank_index(1, lambda o: o["values"].pop("rng"))),
    # unnumbered rules: tiling (section 10), typed JSON (section 8)
    Case(name="sec10-tiling-gap", section="10", item=None, fails_at=LOAD, error="PlanError", problem="tiling",
         defect="model.emb's listed boxes hold rows [0, 18) and [19, 24): row 18 is in none (files and digests consistent)",
         make=emb_rows_on_rank1(19)),
    Case(name="sec10-tiling-overlap", section="10", item=None, fails_at=LOAD, error="PlanError", problem="tiling",
         defect="model.emb's listed boxes hold rows [0, 18) and [17, 24): row 17 is in both (files and digests consistent)",
         make=emb_rows_on_rank1(17)),
    Case(name="sec08-value-unknown-tag", section="8", item=None, fails_at=LOAD, error="ManifestError", problem="value",
         defect='optim.param_groups is {"$nope": 1}, an unknown tag',
         make=root(lambda o: o["values"]["optim.param_groups"].__setitem__("value", {"$nope": 1}))),
    Case(name="sec08-per-rank-value-unknown-tag", section="8", item=None, fails_at=LOAD, error="ManifestError", problem="value",
         defect='rank 1\'s value of rng is {"$nope": 1}, an unknown tag (re-signed)',
         make=rank_index(1, lambda o: o["values"].__setitem__("rng", {"$nope": 1}))),
]


def write_case(case: Case, out: str) -> None:
    """Write ``case`` into the new directory ``out``."""
    shutil.copytree(GOLDEN, out, symlinks=True)
    case.make(out)
    with open(os.path.join(out, "expect.json"), "wb") as f:
        f.write(case.expect())


def write_all(root_dir: str) -> None:
    os.makedirs(root_dir, exist_ok=True)
    for case in CASES:
        write_case(case, os.path.join(root_dir, case.name))


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("pass --write to regenerate spec/golden/invalid-v2")
    for name in os.listdir(INVALID) if os.path.isdir(INVALID) else ():
        if os.path.isdir(os.path.join(INVALID, name)):
            shutil.rmtree(os.path.join(INVALID, name))
    write_all(INVALID)
    print("wrote", len(CASES), "cases under", INVALID)
