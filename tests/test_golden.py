"""The writer reproduces spec/golden/v1 byte for byte (clock, save id, versions pinned).

Regenerate (only with a format change and a spec diff): ``python tests/test_golden.py``.
"""

import datetime as dt
import os
import shutil
import sys

import torch

import shardfmt
from shardfmt.saving.options import SaveOptions, Seams
from shardfmt.saving.shard_file import ShardData
from shardfmt.saving.writer import CheckpointWriter

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "spec", "golden", "v1")
FILES = ("COMMITTED", "manifest.json", "data/rank_00000.safetensors", "data/rank_00001.safetensors")


def write_golden(path: str) -> None:
    """Two ranks: a row-split matrix, a bf16 vector, a 0-d step, an alias, and values."""
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8
    norm = torch.linspace(-1, 1, 5).to(torch.bfloat16)
    seams = Seams(
        save_id="0123456789abcdef",
        clock=lambda: dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
        writer_versions={"python": "3.x", "shardfmt": "golden", "torch": "2.x"},
    )
    writer = CheckpointWriter(path, options=SaveOptions(chunk_size=4096, format_version=1, _seams=seams))
    writer.write_rank(0, [
        ShardData(fqn="model.w", data=w[:3], global_shape=(6, 4), offsets=(0, 0)),
        ShardData(fqn="model.norm", data=norm, global_shape=(5,), offsets=(0,)),
    ])
    writer.write_rank(1, [
        ShardData(fqn="model.w", data=w[3:], global_shape=(6, 4), offsets=(3, 0)),
        ShardData(fqn="optim.step", data=torch.tensor(7, dtype=torch.int64), global_shape=(), offsets=()),
    ])
    writer.add_alias("model.head", "model.w")
    writer.add_value("optim.param_groups", [{"lr": 0.001, "betas": (0.9, 0.999), "params": ["model.w"]}])
    writer.add_value("rng", per_rank={0: b"\x00\x01", 1: (float("nan"), 1 << 70)})
    from shardfmt.format.manifest import Topology

    writer.commit(step=7, metadata={"config": {"layers": 2}}, topology=Topology(world_size=2, mesh=(("dp", 2),)))


def test_writer_reproduces_golden_bytes(tmp_path):
    out = str(tmp_path / "golden")
    write_golden(out)
    for name in FILES:
        with open(os.path.join(GOLDEN, name), "rb") as f:
            want = f.read()
        with open(os.path.join(out, name), "rb") as f:
            got = f.read()
        assert got == want, f"{name} differs from spec/golden/v1"
    assert sorted(os.listdir(out)) == ["COMMITTED", "data", "manifest.json"]


def test_golden_checkpoint_loads_and_validates():
    rep = shardfmt.validate(GOLDEN, deep=True)
    assert rep.ok, rep.problems
    out = {"model": {"w": torch.empty(6, 4), "head": torch.empty(6, 4), "norm": torch.empty(5, dtype=torch.bfloat16)},
           "optim": {"step": torch.empty((), dtype=torch.int64), "param_groups": None}, "rng": None}
    shardfmt.load(out, GOLDEN, rank=1)
    assert torch.equal(out["model"]["head"], torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8)
    assert out["optim"]["step"].item() == 7
    assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert out["rng"][1] == 1 << 70


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("pass --write to regenerate spec/golden/v1 (a format change needs a spec diff too)")
    shutil.rmtree(GOLDEN, ignore_errors=True)
    write_golden(GOLDEN)
    print("wrote", GOLDEN)
