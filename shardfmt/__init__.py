"""shardfmt: a distributed, sharded, pickle-free checkpoint format for PyTorch.

Public API only; the implementation lives in the submodules.
"""

from shardfmt._version import __version__  # noqa: E402
from shardfmt.api import LoadReport, load, save  # noqa: E402
from shardfmt.errors import (
    AccessDeniedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    DcpImportError,
    DTypeError,
    EncodingError,
    FormatVersionError,
    HeaderError,
    IntegrityError,
    ManifestError,
    MissingKeyError,
    PlanError,
    ShapeError,
    ShardfmtError,
    SpecialFileError,
    StateDictError,
    StorageError,
    UnsafePickleError,
)
from shardfmt.format.manifest import Manifest  # noqa: E402
from shardfmt.io.storage import io_stats  # noqa: E402
from shardfmt.layout.state import IfSaved, PerRank, ShardedTensor  # noqa: E402
from shardfmt.loading.reader import open_checkpoint, read_manifest  # noqa: E402
from shardfmt.saving.async_save import AsyncSave, Stager, async_save  # noqa: E402
from shardfmt.saving.writer import CheckpointWriter, ShardData  # noqa: E402
from shardfmt.training.checkpointer import Checkpointer, CompatibilityError  # noqa: E402
from shardfmt.training.sampler import ResumableSampler  # noqa: E402
from shardfmt.training.train_state import get_state_dict, set_state_dict  # noqa: E402
from shardfmt.validation import Problem, ValidationReport, validate  # noqa: E402

__all__ = [
    "__version__",
    "save",
    "load",
    "get_state_dict",
    "set_state_dict",
    "async_save",
    "AsyncSave",
    "Stager",
    "LoadReport",
    "read_manifest",
    "open_checkpoint",
    "validate",
    "ValidationReport",
    "Problem",
    "Manifest",
    "ShardedTensor",
    "Checkpointer",
    "CompatibilityError",
    "ResumableSampler",
    "PerRank",
    "IfSaved",
    "CheckpointWriter",
    "ShardData",
    "ShardfmtError",
    "ManifestError",
    "FormatVersionError",
    "HeaderError",
    "IntegrityError",
    "SpecialFileError",
    "CommitError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "StateDictError",
    "DTypeError",
    "ShapeError",
    "MissingKeyError",
    "EncodingError",
    "PlanError",
    "StorageError",
    "AccessDeniedError",
    "io_stats",
    "DcpImportError",
    "UnsafePickleError",
]

