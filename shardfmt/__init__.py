"""shardfmt: a distributed, sharded, pickle-free checkpoint format for PyTorch.

The public surface, re-exported from the layers below (``format`` <- ``layout`` <- ``io`` <-
``commit`` <- ``saving`` / ``loading`` <- ``api`` <- ``training``); every error type is in
``shardfmt.errors``. Lower-level pieces (manifest records, the writer, the planner, storage
backends) are importable from their modules and are not part of the stable surface.
"""

from shardfmt import errors
from shardfmt._version import __version__
from shardfmt.api import LoadReport, load, save, skip_load
from shardfmt.layout.state import FlatShard, IfSaved, PerRank, ShardedTensor, flat_group
from shardfmt.loading.reader import read_manifest
from shardfmt.saving.async_save import AsyncSave, Stager, async_save
from shardfmt.training.checkpointer import Checkpointer
from shardfmt.training.sampler import ResumableSampler
from shardfmt.training.train_state import get_state_dict, set_state_dict
from shardfmt.validation import validate

__all__ = [
    "__version__",
    "errors",
    # one checkpoint
    "save",
    "load",
    "skip_load",
    "async_save",
    "AsyncSave",
    "Stager",
    "LoadReport",
    "read_manifest",
    "validate",
    # what a state dict may hold
    "ShardedTensor",
    "FlatShard",
    "flat_group",
    "PerRank",
    "IfSaved",
    "get_state_dict",
    "set_state_dict",
    # a training job
    "Checkpointer",
    "ResumableSampler",
]
