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
from test_bad_input import recommit, write_manifest

import shardfmt
from shardfmt import hashing


def _bad_ndarray(dtype: str = "(-1,)i4", shape=(1,)) -> dict:
    return {"$ndarray": {"dtype": dtype, "shape": list(shape), "data": "AAAAAA=="}}


@pytest.fixture
def small(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": {"lr": 0.5}}, path, step=3)
    return path


# ----------------------------------------------------------------------------- 1. typed JSON


@pytest.mark.parametrize("value", [
    _bad_ndarray("(-1,)i4"), _bad_ndarray("(2,3)i4"), _bad_ndarray("((2,),(3,))i4"), _bad_ndarray("i4,i4"),
    _bad_ndarray("<i4", (0, 1 << 47, 1 << 47)), {"$npscalar": {"dtype": "3f4", "data": "AAAAAAAAAAAAAAAA"}},
], ids=["negative-subarray", "subarray", "nested-subarray", "structured", "empty-but-huge", "scalar-subarray"])
def test_a_stored_value_numpy_refuses_is_the_checkpoints_fault(small, value):
    recommit(small, lambda o: o["values"]["v"].update(value={"lr": value}))
    with pytest.raises(shardfmt.ManifestError, match="v.lr"):
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
    shardfmt.save({"a": base[0:8].view(2, 4), "b": base[4:20].view(4, 4)}, path)
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
    with deadline(20, "load"), pytest.raises(shardfmt.PlanError, match="do not cover"):
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
    with pytest.raises(shardfmt.ManifestError, match="share bytes"):
        shardfmt.load({"a": torch.zeros(2, 4)}, path, verify=False)


def test_honest_views_still_load(views):
    path, base = views
    out = {"a": torch.zeros(2, 4), "b": torch.zeros(4, 4)}
    shardfmt.load(out, path)
    assert torch.equal(out["a"], base[0:8].view(2, 4)) and torch.equal(out["b"], base[4:20].view(4, 4))
