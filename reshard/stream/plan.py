"""Windows: the parts every fill of the buffer holds, in an order that appends to every file (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reshard._shardfmt import Box, box_spans, intersect, is_run, row_major_strides
from reshard.errors import BudgetError
from reshard.parse import human
from reshard.stream.records import ALIGN, Part, Piece, Window, aligned
from shardfmt.errors import PlanError


class _Packer:
    """Pack parts into windows of at most ``capacity`` bytes, in order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.windows: list[Window] = []
        self._parts: list[Part] = []
        self._used = 0

    def room(self) -> int:
        return self.capacity - self._used

    def add(self, piece: int, box: Box, nbytes: int) -> None:
        self._parts.append(Part(piece=piece, box=box, offset=self._used, nbytes=nbytes))
        self._used += aligned(nbytes)

    def flush(self) -> None:
        if self._parts:
            self.windows.append(Window(parts=tuple(self._parts), nbytes=self._used))
        self._parts, self._used = [], 0


def plan_windows(pieces: Sequence[Piece], units: Sequence[Sequence[int]], shapes: Mapping[str, Sequence[int]],
                 *, capacity: int, names: Mapping[int, str] | None = None) -> list[Window]:
    """Return the windows that stream every piece of ``units``, in order, ``capacity`` bytes each.

    ``shapes`` maps each source record to its shape; ``names`` (piece -> tensor name, for
    errors) defaults to the record name. Raises ``BudgetError`` when a piece that cannot be
    cut (a materialised view) exceeds the capacity.
    """
    pack = _Packer(capacity)
    for unit in units:
        live = [i for i in unit if pieces[i].buffer_bytes]
        size = sum(aligned(pieces[i].buffer_bytes) for i in live)
        if size <= pack.room():
            for i in live:
                pack.add(i, pieces[i].box, pieces[i].buffer_bytes)
            continue
        pack.flush()
        if size <= capacity:
            for i in live:
                pack.add(i, pieces[i].box, pieces[i].buffer_bytes)
            continue
        _cut_unit(pieces, live, shapes, pack, names)
    pack.flush()
    check_windows(pieces, pack.windows)
    return pack.windows


def _cut_unit(pieces: Sequence[Piece], live: list[int], shapes: Mapping[str, Sequence[int]], pack: _Packer,
              names: Mapping[int, str] | None) -> None:
    """A unit larger than a window: cut by runs of its record, or piece by piece."""
    for i in live:
        if pieces[i].strided is not None and aligned(pieces[i].buffer_bytes) > pack.capacity:
            name = names.get(i, pieces[i].src) if names else pieces[i].src
            raise BudgetError(f"tensor {name!r}: a view of {human(pieces[i].buffer_bytes)} of a shared storage "
                              f"must be held whole; the memory budget allows {human(pack.capacity)} per window")
    srcs = {pieces[i].src for i in live}
    dtypes = {pieces[i].dtype for i in live}
    if len(srcs) == 1 and len(dtypes) == 1 and all(pieces[i].strided is None for i in live):
        src = next(iter(srcs))
        isz = next(iter(dtypes)).itemsize
        shape = tuple(shapes[src])
        cap = pack.capacity - ALIGN * len(live)
        if cap >= isz:
            runs = [s.box for s in box_spans(shape, Box.full(shape), isz, max_span=cap)]
            if _runs_keep_file_order(pieces, live, runs):
                for run in runs:
                    parts = []
                    for i in live:
                        inter = intersect(pieces[i].box, run)
                        if inter is not None and not inter.is_empty():
                            parts.append((i, inter, inter.numel * isz))
                    if sum(aligned(n) for _, _, n in parts) > pack.room():
                        pack.flush()
                    for i, box, n in parts:
                        pack.add(i, box, n)
                return
    for i in live:  # piece by piece: whole when it fits, else runs of the piece
        p = pieces[i]
        if aligned(p.buffer_bytes) <= pack.room():
            pack.add(i, p.box, p.buffer_bytes)
            continue
        pack.flush()
        if aligned(p.buffer_bytes) <= pack.capacity:
            pack.add(i, p.box, p.buffer_bytes)
            continue
        isz = p.dtype.itemsize
        for s in box_spans(p.box.lengths, Box.full(p.box.lengths), isz, max_span=pack.capacity):
            box = Box(tuple(a + b for a, b in zip(p.box.offsets, s.box.offsets)), s.box.lengths)
            if aligned(box.numel * isz) > pack.room():
                pack.flush()
            pack.add(i, box, box.numel * isz)


def _runs_keep_file_order(pieces: Sequence[Piece], live: list[int], runs: list[Box]) -> bool:
    """Whether writing run after run appends to every file in its order (no file goes back to
    an earlier piece of the unit after starting a later one)."""
    by_file: dict[int, list[int]] = {}
    for i in live:
        by_file.setdefault(pieces[i].file, []).append(i)
    for idxs in by_file.values():
        if len(idxs) < 2:
            continue
        last = -1
        for run in runs:
            touched = [k for k, i in enumerate(idxs)
                       if (b := intersect(pieces[i].box, run)) is not None and not b.is_empty()]
            if touched:
                if touched[0] < last:
                    return False
                last = touched[-1]
    return True


def check_windows(pieces: Sequence[Piece], windows: Sequence[Window]) -> None:
    """Raise PlanError unless the windows write every file in order: per file, pieces in
    increasing index; per piece, parts that continue its row-major bytes exactly."""
    last_piece: dict[int, int] = {}
    done: dict[int, int] = {}
    for w in windows:
        for part in w.parts:
            p = pieces[part.piece]
            if last_piece.get(p.file, -1) > part.piece:
                raise PlanError(f"internal: file {p.file} goes back to piece {part.piece}")
            last_piece[p.file] = part.piece
            local = part.box.relative_to(p.box)
            if not p.box.contains(part.box) or not is_run(p.box.lengths, local):
                raise PlanError(f"internal: part {part.box} of piece {part.piece} is not a run of it")
            start = sum(o * s for o, s in zip(local.offsets, row_major_strides(p.box.lengths)))
            if start != done.get(part.piece, 0):
                raise PlanError(f"internal: piece {part.piece} continues at element {start}, "
                                f"expected {done.get(part.piece, 0)}")
            done[part.piece] = start + part.box.numel
    for i, p in enumerate(pieces):
        if p.buffer_bytes and i in done and done[i] != p.box.numel:
            raise PlanError(f"internal: piece {i} was written only up to element {done[i]}")


__all__ = ["check_windows", "plan_windows"]
