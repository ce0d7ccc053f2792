"""Property: whatever ``save`` accepts, ``validate`` passes and ``load`` reads back.

A writer that commits a checkpoint its own reader refuses has lost the user's data while
reporting success. Each case saves a small state dict at or past one of the format's
limits (nesting depth of values and metadata, name lengths, step range, tensor rank,
integers too large for 64 bits) and asserts: ``save`` either refuses with a
``ShardfmtError`` or the checkpoint validates and loads back equal, each within a few
seconds (a tiny checkpoint that takes longer is a hang waiting for a bigger input).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from deadline import deadline
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardfmt

SECONDS = 5  # a tiny checkpoint validates and loads in milliseconds


def assert_round_trip(sd: dict[str, Any], **save_kw: Any) -> bool:
    """Save ``sd``; unless save refuses with a ShardfmtError, validate and load must agree.

    Returns whether the save was accepted. Any other exception from save fails the test.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ckpt"
        try:
            shardfmt.save(sd, path, **save_kw)
        except shardfmt.errors.ShardfmtError:
            return False
        what = f"validate of a checkpoint holding {_describe(sd, save_kw)}"
        with deadline(SECONDS, what):
            report = shardfmt.validate(path)
        problems = [str(p)[:200] for p in report.problems][:3]
        assert report.ok, f"save committed a checkpoint validate rejects: {problems}"
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
        try:
            with deadline(SECONDS, what.replace("validate", "load", 1)):
                shardfmt.load(target, path)
        except shardfmt.errors.ShardfmtError as e:
            pytest.fail(f"save committed a checkpoint load refuses: {type(e).__name__}: {str(e)[-200:]}")
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(target[k], v), k
            else:
                assert target[k] == v, k
        if "step" in save_kw:
            assert shardfmt.read_manifest(path).step == save_kw["step"]
        if "metadata" in save_kw:
            assert shardfmt.read_manifest(path).metadata is not None or save_kw["metadata"] is None
        return True


def _describe(sd: dict, save_kw: dict) -> str:
    return repr({k: v for k, v in sd.items() if not isinstance(v, torch.Tensor)} | save_kw)[:300]


def nest(leaf: Any, kinds: list[str]) -> Any:
    """Wrap ``leaf`` once per entry of ``kinds`` (innermost first)."""
    v = leaf
    for k in kinds:
        v = {"list": lambda x: [x], "tuple": lambda x: (x,), "dict": lambda x: {"k": x},
             "intkey": lambda x: {1: x}}[k](v)
    return v


LEAVES = [None, True, 0, -1, 2**63, 10**40, 1.5, float("inf"), "s", "$x", b"\x00\xff", (), [], {}]
nested_values = st.builds(
    nest,
    st.sampled_from(LEAVES),
    st.integers(0, 90).flatmap(lambda n: st.lists(st.sampled_from(["list", "tuple", "dict", "intkey"]),
                                                 min_size=n, max_size=n)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=nested_values, where=st.sampled_from(["value", "metadata"]))
def test_nested_values_and_metadata_round_trip(value, where):
    if where == "value":
        accepted = assert_round_trip({"x": torch.zeros(2), "cfg": value})
    else:
        accepted = assert_round_trip({"x": torch.zeros(2)}, metadata=value)
    event(f"{where}: {'saved' if accepted else 'refused'}")


@pytest.mark.parametrize("depth", [8, 16])
@pytest.mark.parametrize("kind", ["tuple", "intkey", "list"])
def test_nested_tagged_values_validate_quickly(kind, depth):
    """Tagged values ($tuple, $dict) nest one JSON level deeper per level: still linear to check."""
    assert_round_trip({"x": torch.zeros(2), "cfg": nest(0, [kind] * depth)})


@pytest.mark.parametrize("length", [1, 4096, 4097, 10_000])
@pytest.mark.parametrize("what", ["tensor", "value"])
def test_long_names_round_trip(what, length):
    name = "n" * length
    sd = {name: torch.arange(3.0)} if what == "tensor" else {"x": torch.zeros(2), name: 1}
    assert_round_trip(sd)


@pytest.mark.parametrize("step", [None, 0, 7, 2**62, 2**62 + 1, 2**63 - 1, -1])
def test_steps_round_trip(step):
    assert_round_trip({"x": torch.zeros(2)}, step=step)


@pytest.mark.parametrize("ndim", [0, 1, 8, 63, 64, 65])
def test_tensor_ranks_round_trip(ndim):
    t = torch.arange(3.0).reshape((3,) + (1,) * (ndim - 1)) if ndim else torch.tensor(2.5)
    assert_round_trip({"x": t})


@pytest.mark.parametrize("value", [2**64, -(2**64), 10**4000, 10**5000], ids=["2^64", "-2^64", "1e4000", "1e5000"])
def test_big_integers_round_trip(value):
    assert_round_trip({"x": torch.zeros(2), "n": value})
