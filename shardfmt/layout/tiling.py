"""Whether element boxes tile a region exactly, in time linear in the number of boxes.

The rule (spec section 10): every box lies inside the region, the non-empty ones are pairwise
disjoint, and together they cover it. Checking disjointness pair by pair is O(n^2), and a
manifest author chooses n (a 1-D tensor cut into 8,000 shards took 13 s, 100,000 hours), so the
decision is made another way:

- The indicator of a box ``[a, b)`` (per dim ``k``) has the generating polynomial
  ``prod_k (r_k^b_k - r_k^a_k) / (r_k - 1)``. Boxes tile the region exactly iff the sum of their
  indicators equals the region's (every element covered once), iff the sums of their
  polynomials are equal. Evaluated at random points modulo the prime ``2^127 - 1`` that is
  Schwartz-Zippel's identity test: a true tiling always passes; anything else passes with
  probability at most (sum of the region's extents) / 2^127 < 2^-68, fresh random points per
  call, so an author cannot aim at them. Coordinates repeat in real layouts (a grid), so each
  power is computed once per distinct coordinate: O(n * ndim) multiplications.
- Only when the answer is no does a locator name the offending slices (cuts found by a sort and
  a sweep, then pairwise checks inside what cannot be cut), within a fixed budget of work;
  past it the message gives the element counts instead.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from shardfmt.layout.geometry import Box, intersect

_P = (1 << 127) - 1  # a Mersenne prime
LOCATE_BUDGET = 1_000_000  # box visits and pair checks the locator may spend naming problems


def tiling_problems(boxes: Sequence[Box], region: Box, *, limit: int = 20) -> list[str]:
    """Return why ``boxes`` do not tile ``region`` exactly (an empty list: they do)."""
    problems: list[str] = []
    inside = []
    for b in boxes:
        if b.ndim != region.ndim:
            problems.append(f"slice {_describe(b)} has rank {b.ndim}, expected {region.ndim}")
        elif not region.contains(b):
            problems.append(f"slice {_describe(b)} is outside {list(region.lengths)}")
        elif not b.is_empty():
            inside.append(b)
        if len(problems) >= limit:
            break
    if problems or region.is_empty():
        return problems
    if region.ndim == 0:
        return [] if len(inside) == 1 else [f"0-d tensor has {len(inside)} slices, expected 1"]
    if _tiles(inside, region):
        return []
    return _locate(inside, region, limit) or [_counts(inside, region)]


def _tiles(boxes: list[Box], region: Box) -> bool:
    """The fingerprint test: whether the boxes (inside ``region``, non-empty) cover every
    element of it exactly once."""
    while True:
        rs = [2 + secrets.randbelow(_P - 3) for _ in range(region.ndim)]
        want = 1
        for r, o, e in zip(rs, region.offsets, region.ends):
            want = want * (pow(r, e, _P) - pow(r, o, _P)) % _P
        if want:  # zero only if some r's order divides an extent: draw again
            break
    powers = [_powers(r, {b.offsets[k] for b in boxes} | {b.offsets[k] + b.lengths[k] for b in boxes})
              for k, r in enumerate(rs)]
    total = 0
    for b in boxes:
        f = 1
        for pw, o, n in zip(powers, b.offsets, b.lengths):
            f = f * (pw[o + n] - pw[o]) % _P
        total += f
    return total % _P == want


def _powers(r: int, coords: set[int]) -> dict[int, int]:
    """``r ** x % _P`` for every ``x`` in ``coords``, each from the one before it (in a grid the
    steps repeat, so nearly every power costs one multiplication)."""
    out: dict[int, int] = {}
    steps: dict[int, int] = {}
    x0, v = 0, 1
    for x in sorted(coords):
        step = steps.get(x - x0)
        if step is None:
            step = steps[x - x0] = pow(r, x - x0, _P)
        v = v * step % _P
        out[x] = v
        x0 = x
    return out


def _describe(b: Box) -> str:
    return f"{list(b.offsets)}+{list(b.lengths)}"


def _counts(boxes: list[Box], region: Box) -> str:
    covered = sum(b.numel for b in boxes)
    how = "some overlap" if covered > region.numel else "some leave gaps" if covered < region.numel else \
        "some overlap and others leave gaps"
    return (f"slices do not tile {_describe(region)}: they hold {covered} elements of its {region.numel} "
            f"({how}; not located within the check's budget)")


def _locate(boxes: list[Box], region: Box, limit: int) -> list[str]:
    """Name what is wrong: cut the group where no box straddles (all cuts of one dim at once),
    report pieces no box covers, and check what cannot be cut pair by pair; stop when the
    budget is spent."""
    problems: list[str] = []
    budget = LOCATE_BUDGET
    stack = [(boxes, region)]
    while stack and len(problems) < limit and budget > 0:
        group, reg = stack.pop()
        if not group:
            problems.append(f"region {_describe(reg)} is not covered by any slice")
        elif len(group) == 1:
            if group[0] != reg:
                problems.append(f"slice {_describe(group[0])} leaves part of {_describe(reg)} uncovered")
        else:
            pieces, sorts = _split(group, reg)
            budget -= len(group) * sorts  # one sort per dim tried
            if pieces is None:
                budget = _pairwise(group, reg, problems, limit, budget)
            else:
                stack.extend(reversed(pieces))
    return problems[:limit]


def _split(group: list[Box], reg: Box) -> tuple[list[tuple[list[Box], Box]] | None, int]:
    """Cut ``reg`` along the first dim where some position inside it is straddled by no box:
    at every such position (and around every gap) at once (None when no dim has one); and how
    many dims were sorted to find it."""
    sorts = 0
    for d in range(reg.ndim):
        if reg.lengths[d] < 2:
            continue  # nothing to cut
        sorts += 1
        order = sorted(group, key=lambda b: b.offsets[d])
        lo, hi = reg.offsets[d], reg.offsets[d] + reg.lengths[d]
        cuts: list[int] = []
        reach = lo
        for b in order:
            start = b.offsets[d]
            if start >= reach and lo < reach < hi and (not cuts or cuts[-1] != reach):
                cuts.append(reach)
            if start > reach:
                cuts.append(start)
            reach = max(reach, start + b.lengths[d])
        if lo < reach < hi and (not cuts or cuts[-1] != reach):
            cuts.append(reach)
        if not cuts:
            continue
        bounds = [lo, *cuts, hi]
        pieces: list[tuple[list[Box], Box]] = []
        k = 0
        for a, z in zip(bounds, bounds[1:]):
            members = []
            while k < len(order) and order[k].offsets[d] < z:
                members.append(order[k])
                k += 1
            piece = Box(reg.offsets[:d] + (a,) + reg.offsets[d + 1:],
                        reg.lengths[:d] + (z - a,) + reg.lengths[d + 1:])
            pieces.append((members, piece))
        return pieces, sorts
    return None, sorts


def _pairwise(group: list[Box], reg: Box, problems: list[str], limit: int, budget: int) -> int:
    order = sorted(group, key=lambda b: b.offsets)
    found = len(problems)
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            budget -= 1
            if budget <= 0:
                return budget
            if intersect(a, b) is not None:
                problems.append(f"slices {_describe(a)} and {_describe(b)} overlap")
                if len(problems) >= limit:
                    return budget
    if len(problems) == found and sum(b.numel for b in group) != reg.numel:
        problems.append(f"slices cover {sum(b.numel for b in group)} of the {reg.numel} elements of {_describe(reg)}")
    return budget
