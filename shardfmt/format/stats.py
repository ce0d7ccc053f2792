"""Per-tensor statistics that add up across shards: what a restore checks the loaded values by.

Digests prove that the bytes read are the bytes written; they cannot see a load that puts
intact bytes where they do not belong or turns them into other values (a wrong cast, a wrong
target, rows swapped by a resharding bug). Each stored box contributes three numbers, summed
over a tensor's boxes into the root's optional ``tensor_stats`` extension (spec/FORMAT.md
section 9: a statistic, ignored by readers that do not know it):

- ``sum``: the sum of the elements;
- ``sumsq``: the sum of their squares;
- ``rows``: the sum of the elements weighted by ``1 + (i mod 7)``, ``i`` the element's global
  index along dimension 0 (of a 1-D tensor: its index), which changes when rows move.

Each is additive over disjoint boxes, so ranks that loaded disjoint parts of a tensor add
theirs up (an all-reduce) and compare with the saved total, whatever the topology. Computed in
float32 over pieces of 2^20 elements by torch's cascaded sums (a dot product's running float32
sum is off by up to 4e-4 on near-constant data: not used), accumulated in float64: about 10 ms
per 256 MiB and statistic on one core here. The extension's value names that method
(``METHOD``); sums taken another way are not compared. ``close`` compares with tolerances scaled by the tensor's norm
``L = sqrt(sumsq)``: ``1e-3 L + 1e-6 |sum|`` for ``sum``, ``1e-4 sumsq`` for ``sumsq``,
``1e-2 L + 1e-5 |rows|`` for ``rows``: 50x or more above the float32 rounding that two
partitions of one tensor give (measured up to 1e-5 L, 3e-6 sumsq and 2e-4 L on 16 M
elements), and below what another tensor, a rescaled one or two swapped rows of a 4096 x 16384
matrix change. A statistic that is not finite (an infinite element, or sums that overflow) is
not compared. Sums are taken in float64 for float64 and integer tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

PIECE = 1 << 20
NSTATS = 3  # sum, sumsq, rows
EXTENSION = "tensor_stats"
METHOD = "cascade-f32/1"  # how the sums are taken: torch's cascaded sums of float32 pieces, added in float64


def box_stats(data: torch.Tensor, offsets: Sequence[int]) -> tuple[float, float, float]:
    """(sum, sumsq, rows) of a box of a tensor: ``data`` its elements, ``offsets`` where it sits."""
    if data.numel() == 0:
        return 0.0, 0.0, 0.0
    t = data.detach()
    if t.dim() == 0:
        x = float(t.double())
        return x, x * x, x
    rows0 = int(offsets[0]) if len(offsets) else 0
    if t.dim() == 1:
        return _vector_stats(t, rows0)
    n0 = t.shape[0]
    flat = t.reshape(n0, -1)
    s = q = w = 0.0
    step = max(1, PIECE // max(1, flat.shape[1]))
    for r in range(0, n0, step):
        p = _as_float(flat[r:r + step])
        rowsum = p.sum(dim=1)
        s += float(rowsum.sum())
        pf = p.reshape(-1)
        q += float((pf * pf).sum())
        weights = ((torch.arange(r, r + p.shape[0], device=p.device) + rows0) % 7 + 1).to(p.dtype)
        w += float((rowsum * weights).sum())
    return s, q, w


def run_stats(run: torch.Tensor, start: int, shape: Sequence[int], offsets: Sequence[int]) -> tuple[float, float, float]:
    """(sum, sumsq, rows) of a run of a box's elements: ``run`` (1-D) holds the elements
    ``start, start + 1, ...`` of the box (``shape``, at ``offsets``) in row-major order. What a
    reader sums as each piece of a box lands, in whatever pieces: the runs of a partition of a
    box add up to ``box_stats`` of the box (to rounding)."""
    n = run.numel()
    if n == 0:
        return 0.0, 0.0, 0.0
    if len(shape) == 0:
        return box_stats(run.reshape(()), ())
    if len(shape) == 1:
        return _vector_stats(run, int(offsets[0]) + start)
    inner = 1
    for d in shape[1:]:
        inner *= d
    row, col = divmod(start, inner)
    row += int(offsets[0])
    out = [0.0, 0.0, 0.0]
    head = min(n, inner - col) if col else 0
    if head:  # the end of a row begun in an earlier run
        _add_to(out, _row_stats(run[:head], row))
        row += 1
    m = (n - head) // inner
    if m:
        _add_to(out, box_stats(run[head:head + m * inner].view(m, inner), (row, 0)))
        row += m
    if head + m * inner < n:  # the start of a row a later run ends
        _add_to(out, _row_stats(run[head + m * inner:], row))
    return out[0], out[1], out[2]


def _row_stats(part: torch.Tensor, row: int) -> tuple[float, float, float]:
    """Part of one row (``row``: its index along dimension 0)."""
    p = _as_float(part)
    s = float(p.sum())
    return s, float((p * p).sum()), s * (1 + row % 7)


def _add_to(acc: list[float], vals: Sequence[float]) -> None:
    for i, v in enumerate(vals):
        acc[i] += v


def _as_float(p: torch.Tensor) -> torch.Tensor:
    """A piece in the precision its sums are taken in: float64 for float64 and integer tensors
    (large integers, timestamps: float32 would round or overflow), float32 for the rest."""
    if p.dtype == torch.float64 or not (p.is_floating_point() or p.is_complex()):
        return p.to(torch.float64)
    return p if p.dtype == torch.float32 else p.float()


def _vector_stats(t: torch.Tensor, first: int) -> tuple[float, float, float]:
    """A 1-D box: the weights ``1 + (i mod 7)`` repeat every 7 elements, so each piece is viewed
    as rows of 7 and multiplied by the 7 weights (no temporary the size of the piece)."""
    s = q = w = 0.0
    n = t.shape[0]
    for a in range(0, n, PIECE):
        p = _as_float(t[a:a + PIECE]).contiguous()
        s += float(p.sum())
        q += float((p * p).sum())
        lead = (-(first + a)) % 7  # elements before the first whose global index is a multiple of 7
        head, body = p[:lead], p[lead:]
        m = body.shape[0] // 7 * 7
        if m:
            w += float(body[:m].view(-1, 7).sum(dim=0) @ torch.arange(1, 8, dtype=body.dtype, device=body.device))
        for k, x in ((first + a + j, head[j]) for j in range(head.shape[0])):
            w += float(x) * (1 + k % 7)
        for j in range(m, body.shape[0]):
            w += float(body[j]) * (1 + (first + a + lead + j) % 7)
    return s, q, w


def add(into: dict[str, list[float]], fqn: str, stats: Iterable[float]) -> None:
    acc = into.setdefault(fqn, [0.0] * NSTATS)
    for i, v in enumerate(stats):
        acc[i] += v


def close(saved: Sequence[float], got: Sequence[float], numel: int) -> bool:
    """Whether ``got`` (sum, sumsq, rows) matches ``saved`` within ``RTOL`` of each one's scale."""
    q = abs(saved[1])
    r = math.sqrt(q) if math.isfinite(q) else math.inf  # the tensor's L2 norm
    tol = (1e-3 * r + 1e-6 * abs(saved[0]), 1e-4 * q, 1e-2 * r + 1e-5 * abs(saved[2]))
    for a, b, t in zip(saved, got, tol):
        if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(t)):
            continue  # an overflowed or non-finite sum says nothing either way: not compared
        if abs(a - b) > t + 1e-30:
            return False
    return True


def encode_sums(totals: Mapping[str, Sequence[float]]) -> dict:
    """fqn -> [sum, sumsq, rows] as typed JSON (non-finite numbers as ``$float``)."""
    def enc(v: float):
        return v if math.isfinite(v) else {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    return {f: [enc(v) for v in vals] for f, vals in sorted(totals.items())}


def decode_sums(value) -> dict[str, tuple[float, float, float]]:
    """``encode_sums``'s value back (an unusable entry is left out: a statistic, never a reason to refuse)."""
    out = {}
    if not isinstance(value, dict):
        return out

    def dec(v):
        if isinstance(v, dict) and set(v) == {"$float"}:
            return float(v["$float"])
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    for f, vals in value.items():
        if isinstance(vals, list) and len(vals) == NSTATS:
            got = [dec(v) for v in vals]
            if all(v is not None for v in got):
                out[f] = tuple(got)
    return out


def as_extension_value(totals: Mapping[str, Sequence[float]]) -> dict:
    """The extension's value: ``{"sums": METHOD, "tensors": encode_sums(totals)}``."""
    return {"sums": METHOD, "tensors": encode_sums(totals)}


def from_extension_value(value) -> dict[str, tuple[float, float, float]]:
    """The per-tensor sums of an extension's value taken by ``METHOD``; none (nothing to compare)
    for sums taken another way: the first release's (a bare fqn map, its squares summed by
    float32 dot products, off by up to 4e-4 on near-constant data) would fail loads that are right."""
    if not isinstance(value, dict) or value.get("sums") != METHOD:
        return {}
    return decode_sums(value.get("tensors"))


__all__ = ["EXTENSION", "METHOD", "NSTATS", "add", "as_extension_value", "box_stats", "close", "decode_sums",
           "encode_sums", "from_extension_value", "run_stats"]
