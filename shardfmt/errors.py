"""The project's error types: every failure a user can cause or meet is one of these.

Each error's message names the file, tensor or key and the cause. Callers can catch
``ShardfmtError`` to handle every failure of the format, or a subclass to handle one kind.
"""

from __future__ import annotations


class ShardfmtError(Exception):
    """Base of every error raised by shardfmt and reshard."""

    kind: str | None = None  # what the command lines print before the message (None: nothing)


class ManifestError(ShardfmtError):
    """The manifest is unreadable, malformed, or contradicts itself."""

    kind = "bad manifest"


class FormatVersionError(ManifestError):
    """The checkpoint was written in a format version this reader does not support.

    ``version`` is the checkpoint's ``format_version`` when the error is about one (a required
    extension this reader does not know is reported with its checkpoint's version)."""

    kind = "unsupported format version"

    def __init__(self, message: str, *, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version


class HeaderError(ShardfmtError):
    """A safetensors header is malformed or disagrees with the manifest."""

    kind = "bad file header"


class IntegrityError(ShardfmtError):
    """Bytes on storage do not match their recorded size or hash."""

    kind = "corrupt data"


class SpecialFileError(IntegrityError):
    """A file to read is not a regular file (a FIFO, socket, device or directory), or a file of a
    checkpoint is reached through a symbolic link (spec section 2): refused before it is read."""

    kind = "not a regular file"


class CommitError(ShardfmtError):
    """A checkpoint is not committed, or committing one failed."""

    kind = "not committed"


class CheckpointExistsError(CommitError):
    """A committed checkpoint already exists where a save was asked to write."""

    kind = "already exists"


class CheckpointNotFoundError(ShardfmtError):
    """No checkpoint exists at the given path."""


class StateDictError(ShardfmtError):
    """A state dict cannot be saved or loaded as given (bad key, unsupported value, mismatch)."""

    kind = "state does not fit"


class CompatibilityError(StateDictError):
    """The checkpoint was written for a different model or config."""

    kind = "incompatible checkpoint"


class DTypeError(StateDictError):
    """A dtype cannot be stored, or a target's dtype differs from the checkpoint's."""

    kind = "dtype mismatch"


class ShapeError(StateDictError):
    """A target's shape or slice does not fit the checkpoint's tensor."""

    kind = "shape mismatch"


class MissingKeyError(StateDictError):
    """A key the caller asked for is not in the checkpoint."""

    kind = "missing key"


class EncodingError(StateDictError):
    """A non-tensor value cannot be encoded as typed JSON (never pickled)."""

    kind = "value cannot be stored"


class PlanError(ShardfmtError):
    """A load plan cannot be made: the saved shards do not cover a requested slice."""

    kind = "cannot plan the reads"


class StorageError(ShardfmtError):
    """The storage backend failed (missing path, permission, network, full disk)."""


class AccessDeniedError(StorageError):
    """The storage refused the credentials or the permission (wrong key, read-only bucket)."""

    kind = "access denied"
