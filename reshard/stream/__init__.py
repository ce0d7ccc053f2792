"""Budgeted streaming: slices of a checkpoint -> new files written in order, in bounded memory.

The offline tools (``convert``, ``export-hf``, ``import-hf``) read slices of a source and
write them into new files whose layout is fixed up front (every file's slices in a known
order). This package is their one engine::

    plan (pure, no I/O)                   run (the I/O)
    pieces + units -> windows             per window: plan_load -> Executor fills the buffer,
                                          then each file's parts are written, in order

- ``records``: a *piece* is one slice a destination file holds: a box of a source record (a
  tensor or a storage of the source manifest), written in an output dtype. The pieces of one
  file appear in ``pieces`` in that file's order. A *unit* is the list of pieces of one record
  (its boxes in every file). Units come in an order consistent with every file's order, so
  writing unit after unit appends to each file.
- ``plan``: a *window* is one fill of the buffer. Whole units are packed while they fit; a
  larger unit is cut into row-major runs of its record (``geometry.box_spans``) and each run
  is intersected with every piece, so each source byte is read once even when it feeds
  several files. When a file holds several pieces of the unit in an order the runs would
  interleave (boxes side by side along an inner dim), the unit is cut piece by piece instead.
- ``memory``: how a budget is split into window slots and bounce buffers.
- ``run``: fill each window from the source and write its parts to the files' sinks.

Trade-offs: windows are sized in output bytes, which is what the buffer holds. Reads that
cast or land in a strided region go through fixed bounce buffers (``MemoryPlan``), small ones
outside the budget (in its 32 MiB slack), larger ones taken from it; a plan reads a hash chunk
once per window (``plan_load``). Hash chunks at window edges are read twice: those are the
only re-reads, fewer with a larger budget. The budget is split in two slots so that the next
window's reads overlap this window's writes, and windows are kept to ~1/16 of the data (at
least 64 MiB) so that the unoverlapped first read and last write stay short.
"""
