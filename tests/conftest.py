import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def ckpt_dir(tmp_path):
    return str(tmp_path / "ckpt")


def flip_byte(path: str, offset: int, mask: int = 1) -> None:
    """Corrupt one byte of a file in place (XOR with ``mask``), as a failing disk would."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ mask]))


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN-safe), same dtype and shape."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def as_next_format_version(path: str, where: str) -> None:
    """Make the committed checkpoint at ``path`` look as format version 2 might: its manifest
    says 2 (COMMITTED re-signed; the body still a valid version 1 one), or (``where`` =
    "COMMITTED") its COMMITTED carries ``format_version`` 2 and a field version 1 does not know."""
    import orjson

    from shardfmt.format import hashing

    with open(os.path.join(path, "manifest.json"), "rb") as f:
        raw = f.read()
    obj = orjson.loads(raw)
    commit = {"format": "shardfmt", "save_id": obj["save_id"]}
    if where == "manifest":
        obj["format_version"] = 2
        raw = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"
        with open(os.path.join(path, "manifest.json"), "wb") as f:
            f.write(raw)
    else:
        commit.update(format_version=2, manifest_index={"shards": 1})
    commit["manifest_digest"] = hashing.digest_bytes(raw)
    with open(os.path.join(path, "COMMITTED"), "wb") as f:
        f.write(orjson.dumps(commit, option=orjson.OPT_SORT_KEYS) + b"\n")
