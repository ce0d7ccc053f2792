"""Property: the tiling check agrees with counting every element, and its cost is linear.

``shardfmt.layout.tiling.tiling_problems`` decides with a randomised fingerprint and names problems with
a bounded locator; the reference here covers small regions element by element.
"""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfmt.layout.geometry import Box
from shardfmt.layout.tiling import tiling_problems


def _counts(boxes: list[Box], region: Box) -> dict[tuple[int, ...], int]:
    cover = {idx: 0 for idx in itertools.product(*[range(o, o + n) for o, n in zip(region.offsets, region.lengths)])}
    for b in boxes:
        for idx in itertools.product(*[range(o, o + n) for o, n in zip(b.offsets, b.lengths)]):
            cover[idx] = cover.get(idx, 0) + 1
    return cover


def _tiles(boxes: list[Box], region: Box) -> bool:
    inside = all(region.contains(b) for b in boxes)
    return inside and all(c == 1 for c in _counts(boxes, region).values())


@st.composite
def guillotine(draw, region: Box, depth: int = 0) -> list[Box]:
    """A random guillotine tiling of ``region`` (recursive cuts along random dims)."""
    if depth > 3 or region.numel <= 1 or draw(st.booleans()):
        return [region]
    d = draw(st.integers(0, region.ndim - 1))
    if region.lengths[d] < 2:
        return [region]
    cut = draw(st.integers(1, region.lengths[d] - 1))
    o, n = region.offsets, region.lengths
    lo = Box(o, n[:d] + (cut,) + n[d + 1:])
    hi = Box(o[:d] + (o[d] + cut,) + o[d + 1:], n[:d] + (n[d] - cut,) + n[d + 1:])
    return draw(guillotine(lo, depth + 1)) + draw(guillotine(hi, depth + 1))


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    region = Box((0,) * ndim, tuple(draw(st.integers(1, 5)) for _ in range(ndim)))
    boxes = draw(guillotine(region))
    edit = draw(st.sampled_from(["none", "drop", "duplicate", "grow", "shift", "random"]))
    i = draw(st.integers(0, len(boxes) - 1))
    b = boxes[i]
    if edit == "drop":
        boxes = boxes[:i] + boxes[i + 1:]
    elif edit == "duplicate":
        boxes = boxes + [b]
    elif edit in ("grow", "shift"):
        d = draw(st.integers(0, ndim - 1))
        delta = draw(st.sampled_from([-1, 1]))
        offs, lens = list(b.offsets), list(b.lengths)
        if edit == "grow":
            lens[d] = max(0, lens[d] + delta)
        else:
            offs[d] = max(0, offs[d] + delta)
        boxes = boxes[:i] + [Box(tuple(offs), tuple(lens))] + boxes[i + 1:]
    elif edit == "random":
        boxes = [Box(tuple(draw(st.integers(0, n - 1)) for n in region.lengths),
                     tuple(draw(st.integers(0, 3)) for _ in region.lengths)) for _ in range(draw(st.integers(0, 6)))]
    return boxes, region


@settings(max_examples=examples(400), deadline=None)
@given(case=cases())
def test_tiling_check_agrees_with_counting_every_element(case):
    boxes, region = case
    want = _tiles([b for b in boxes if not b.is_empty()] + [b for b in boxes if b.is_empty()], region)
    got = tiling_problems(boxes, region)
    assert (got == []) == want, (boxes, region, got)


def _time(boxes: list[Box], region: Box) -> float:
    t = time.perf_counter()
    assert tiling_problems(boxes, region) == []
    return time.perf_counter() - t


@pytest.mark.slow
def test_many_shards_cost_linear_time():
    """Layouts that cost the old guillotine-and-pairs check O(n^2) (13 s at 8,000 shards, hours
    at 100,000) or worse: 1-D slices, a staircase of L-shapes (one cut per level), and a
    non-guillotine weave (no cut at all: the pairwise fallback)."""
    n = 100_000
    line = [Box((i,), (1,)) for i in range(n)]
    assert _time(line, Box((0,), (n,))) < 10
    k = 20_000  # a staircase: box i covers row i from column i on, and column i below row i
    stairs = [Box((i, i), (1, k - i)) for i in range(k)] + [Box((i + 1, i), (k - i - 1, 1)) for i in range(k - 1)]
    assert _time(stairs, Box((0, 0), (k, k))) < 10
    # pinwheels (5 boxes in 3x3 with no straight cut through them), stacked along dim 0
    pin = [Box((0, 0), (2, 1)), Box((0, 1), (1, 2)), Box((1, 1), (1, 1)), Box((2, 0), (1, 2)), Box((1, 2), (2, 1))]
    reps = 20_000
    weave = [Box((3 * r + b.offsets[0], b.offsets[1]), b.lengths) for r in range(reps) for b in pin]
    assert _time(weave, Box((0, 0), (3 * reps, 3))) < 10
    bad = weave[:-1] + [Box((0, 0), (1, 1))]
    t = time.perf_counter()
    assert tiling_problems(bad, Box((0, 0), (3 * reps, 3)))
    assert time.perf_counter() - t < 20
