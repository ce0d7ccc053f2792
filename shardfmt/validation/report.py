"""A validator's findings, as data: one ``Problem`` per finding, a ``ValidationReport`` for all."""

from __future__ import annotations

from dataclasses import dataclass

from shardfmt.format.manifest import Manifest


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One finding: what is wrong and where (file, tensor, byte range when known)."""

    code: str
    message: str
    file: str | None = None
    tensor: str | None = None
    byte_range: tuple[int, int] | None = None

    def to_json(self) -> dict:
        out = {"code": self.code, "message": self.message}
        if self.file is not None:
            out["file"] = self.file
        if self.tensor is not None:
            out["tensor"] = self.tensor
        if self.byte_range is not None:
            out["byte_range"] = list(self.byte_range)
        return out

    def __str__(self) -> str:
        where = " ".join(x for x in (self.file, f"tensor {self.tensor!r}" if self.tensor else None,
                                     f"bytes [{self.byte_range[0]}, {self.byte_range[1]})" if self.byte_range else None)
                         if x)
        return f"[{self.code}] {where + ': ' if where else ''}{self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationReport:
    """The validator's verdict: ``ok`` when ``problems`` is empty."""

    path: str
    deep: bool
    problems: tuple[Problem, ...]
    manifest: Manifest | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsupported(self) -> bool:
        """Whether the one finding is a format version this reader cannot read: not a verdict."""
        return bool(self.problems) and all(p.code == "format_version" for p in self.problems)

    def to_json(self) -> dict:
        return {"path": self.path, "deep": self.deep, "ok": self.ok,
                "problems": [p.to_json() for p in self.problems]}
