"""The offline tools' errors: each a ``ShardfmtError`` (the CLI's exit 1), and a ``ValueError``
too where it is a bad argument (the CLI's exit 2).

The tools' errors live here, not in ``shardfmt.errors``: shardfmt never imports reshard.
"""

from __future__ import annotations

from shardfmt.errors import CheckpointNotFoundError, ShardfmtError


class DcpImportError(ShardfmtError):
    """A torch.distributed.checkpoint directory cannot be imported (missing, truncated or unsupported)."""

    kind = "cannot import the DCP checkpoint"


class DeepSpeedImportError(ShardfmtError):
    """A DeepSpeed ZeRO checkpoint directory cannot be imported (missing, truncated, inconsistent or unsupported)."""

    kind = "cannot import the DeepSpeed checkpoint"


class UnsafePickleError(DcpImportError, DeepSpeedImportError):
    """A pickle asks for a global outside the allowlist: refused before anything of it runs (either importer)."""

    kind = "unsafe pickle refused"


class SourceNotFoundError(DcpImportError, DeepSpeedImportError, CheckpointNotFoundError):
    """An import's source is not there, or holds no checkpoint of its kind (no DCP ``.metadata``,
    no DeepSpeed ``latest`` or tag directory): a path that names no checkpoint (the CLI's exit 2)."""

    kind = "no checkpoint to import"


class BudgetError(ShardfmtError, ValueError):
    """The memory budget is malformed or too small for what must be held at once."""

    kind = "memory budget"


class OverlapError(ShardfmtError, ValueError):
    """The destination is the source, holds it or lies inside it: writing it would destroy or
    change what is being read."""

    kind = "destination overlaps the source"


class HFError(ShardfmtError):
    """An HF directory is malformed, or an export cannot be made as asked."""

    kind = "Hugging Face layout"


class ConfigError(HFError, ValueError):
    """The config file given to export (``config=``, ``--config``) cannot be read or is not a
    JSON object: a bad argument."""

    kind = "bad config"


__all__ = ["BudgetError", "ConfigError", "DcpImportError", "DeepSpeedImportError", "HFError", "OverlapError", "SourceNotFoundError", "UnsafePickleError"]
