"""Re-signing a checkpoint after editing it, as a hostile author would (tests of what the checks
behind the digests catch)."""

from __future__ import annotations

import os

import orjson

from shardfmt.format import hashing
from shardfmt.format.hashing import digest_bytes
from shardfmt.format.manifest import COMMITTED_NAME, MANIFEST_NAME, CommitRecord


def recommit(path: str, raw: bytes, save_id: str) -> None:
    """Write a COMMITTED that vouches for manifest bytes ``raw``."""
    with open(os.path.join(path, COMMITTED_NAME), "wb") as f:
        f.write(CommitRecord(save_id=save_id, manifest_digest=digest_bytes(raw)).to_json())


def reseal(path: str, save_id: str | None = None) -> None:
    """Re-sign the checkpoint at ``path`` as its author would after editing it: every listed file
    that exists gets its size, header size and digest, chunk digests, file digest and its shards'
    digests recomputed from the bytes on disk (shard byte ranges follow a header that changed
    length), and COMMITTED vouches for the new manifest. Fields the edit broke are left broken."""
    mpath = os.path.join(path, MANIFEST_NAME)
    with open(mpath, "rb") as f:
        raw = f.read()
    try:
        obj = orjson.loads(raw)
        _reseal_files(path, obj)
        raw = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"
    except (orjson.JSONDecodeError, TypeError, KeyError, ValueError, AttributeError):
        pass  # not a manifest any more: re-sign the bytes as they are
    with open(mpath, "wb") as f:
        f.write(raw)
    recommit(path, raw, save_id if save_id is not None else (obj.get("save_id") if isinstance(obj, dict) else "x"))


def _reseal_files(path: str, obj: dict) -> None:
    chunk = obj["chunk_size"]
    for name, rec in obj["files"].items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath) or not isinstance(rec, dict):
            continue
        with open(fpath, "rb") as f:
            data = f.read()
        n = int.from_bytes(data[:8], "little") if len(data) >= 8 else None
        shift = 0
        if n is not None and 8 + n <= len(data):
            shift = 8 + n - rec["header_size"]
            rec["header_size"] = 8 + n
        chunks = [digest_bytes(data[i:i + chunk]) for i in range(0, len(data), chunk)]
        rec.update(size=len(data), chunks=chunks, digest=hashing.combine(chunks),
                   header_digest=digest_bytes(data[:rec["header_size"]]))
        for table in (obj["tensors"], obj["storages"]):
            for t in table.values():
                for sh in t.get("shards", []):
                    if sh.get("file") != name:
                        continue
                    sh["byte_range"] = [sh["byte_range"][0] + shift, sh["byte_range"][1] + shift]
                    span = hashing.chunk_span(*sh["byte_range"], chunk)
                    sh["digest"] = hashing.combine(chunks[span.start:span.stop])


