"""``layout.flat.flat_boxes``: a flat range of a tensor's row-major elements, cut into boxes.

For any shape and range: the boxes come in flattening order, each box's elements are the
consecutive run of the range starting at its ``start``, together they are exactly the range
(clipped to the tensor), none is empty, and there are at most ``2 * ndim - 1``."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfmt.layout.flat import flat_boxes


@st.composite
def _cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    n = math.prod(shape)
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n + 3))
    return shape, lo, hi


@settings(max_examples=examples(400), deadline=None)
@given(_cases())
def test_the_boxes_of_a_flat_range_are_its_elements_in_order(case):
    shape, lo, hi = case
    n = math.prod(shape)
    index = torch.arange(n).reshape(shape)
    boxes = flat_boxes(shape, lo, hi)
    pos = lo
    for fb in boxes:
        assert fb.start == pos
        sl = tuple(slice(o, o + k) for o, k in zip(fb.box.offsets, fb.box.lengths))
        got = index[sl].reshape(-1).tolist()
        assert got == list(range(pos, pos + len(got))) and got
        pos += len(got)
    assert pos == max(lo, min(hi, n))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
