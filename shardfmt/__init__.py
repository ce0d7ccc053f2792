"""shardfmt: a distributed, sharded, pickle-free checkpoint format for PyTorch.

Public API only; the implementation lives in the submodules.
"""

__version__ = "0.1.0"

from .api import LoadReport, load, save  # noqa: E402
from .async_save import AsyncSave, Stager, async_save  # noqa: E402
from .checkpointer import Checkpointer, CompatibilityError  # noqa: E402
from .errors import (  # noqa: E402
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
from .manifest import Manifest  # noqa: E402
from .reader import open_checkpoint, read_manifest  # noqa: E402
from .sampler import ResumableSampler  # noqa: E402
from .state import IfSaved, PerRank, ShardedTensor  # noqa: E402
from .storage import io_stats  # noqa: E402
from .train_state import get_state_dict, set_state_dict  # noqa: E402
from .validation import Problem, ValidationReport, validate  # noqa: E402
from .writer import CheckpointWriter, ShardData  # noqa: E402

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

