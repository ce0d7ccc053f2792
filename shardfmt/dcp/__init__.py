"""A storage backend for ``torch.distributed.checkpoint`` (DCP): one line to adopt shardfmt.

    import torch.distributed.checkpoint as dcp
    from shardfmt.dcp import Reader, Writer

    dcp.save(state, storage_writer=Writer("ckpt/step_100"))     # or dcp.async_save(...)
    dcp.load(state, storage_reader=Reader("ckpt/step_100"))

DCP's planners stay in charge of who writes and reads what; everything on disk is shardfmt's
(safetensors, a JSON manifest, ``COMMITTED``): a checkpoint written so loads with
``shardfmt.load``, validates and converts, and ``Reader`` reads any shardfmt checkpoint.
Nothing is pickled on disk and nothing read from disk is unpickled (``writer``, ``reader``).
Names: ``names``; ``planner.SavePlanner`` keeps values whole, as ``shardfmt.save`` names them. Scale: DCP hands every rank the whole ``Metadata`` and checks the global plan
on one rank, so the per-rank scale of format 2 holds only through shardfmt's own API.
"""

from shardfmt.dcp.planner import SavePlanner
from shardfmt.dcp.reader import Reader
from shardfmt.dcp.writer import Writer

__all__ = ["Reader", "SavePlanner", "Writer"]
