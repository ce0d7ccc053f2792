"""shardfmt: a distributed, sharded, pickle-free checkpoint format for PyTorch.

The public surface, re-exported from the layers below (``format`` <- ``layout`` <- ``io`` <-
``commit`` <- ``saving`` / ``loading`` <- ``api`` <- ``training``); every error type is in
``shardfmt.errors``. Lower-level pieces (manifest records, the writer, the planner, storage
backends) are importable from their modules and are not part of the stable surface.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from shardfmt import errors
from shardfmt._version import __version__

# name -> the module it lives in. Imported at first use, so that ``import shardfmt`` (and the
# command line's ``--help`` and ``--version``) never imports torch (PEP 562).
_EXPORTS = {
    "save": "shardfmt.api", "load": "shardfmt.api", "skip_load": "shardfmt.api", "LoadReport": "shardfmt.api",
    "async_save": "shardfmt.saving.async_save", "AsyncSave": "shardfmt.saving.async_save",
    "Stager": "shardfmt.saving.async_save",
    "read_manifest": "shardfmt.loading.reader",
    "validate": "shardfmt.validation",
    "ShardedTensor": "shardfmt.layout.state", "FlatShard": "shardfmt.layout.state",
    "flat_group": "shardfmt.layout.state", "PerRank": "shardfmt.layout.state", "IfSaved": "shardfmt.layout.state",
    "get_state_dict": "shardfmt.training.train_state", "set_state_dict": "shardfmt.training.train_state",
    "Checkpointer": "shardfmt.training.checkpointer",
    "ResumableSampler": "shardfmt.training.sampler",
}

if TYPE_CHECKING:
    from shardfmt.api import LoadReport, load, save, skip_load
    from shardfmt.layout.state import FlatShard, IfSaved, PerRank, ShardedTensor, flat_group
    from shardfmt.loading.reader import read_manifest
    from shardfmt.saving.async_save import AsyncSave, Stager, async_save
    from shardfmt.training.checkpointer import Checkpointer
    from shardfmt.training.sampler import ResumableSampler
    from shardfmt.training.train_state import get_state_dict, set_state_dict
    from shardfmt.validation import validate


_SUBMODULES = frozenset({"api", "cli", "commit", "demo", "format", "io", "layout", "loading", "saving", "training",
                         "validation"})

if not TYPE_CHECKING:  # (a type checker sees the names imported above, and no catch-all)

    def __getattr__(name: str):
        if name in _SUBMODULES:  # ``shardfmt.saving.writer`` after a bare ``import shardfmt``: the whole
            for module in set(_EXPORTS.values()):  # surface, as an eager import of it would have loaded
                importlib.import_module(module)
            return importlib.import_module(f"shardfmt.{name}")
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'shardfmt' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # once: later lookups find it without this function
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


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
