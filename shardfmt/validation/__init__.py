"""The validator: every finding about a checkpoint, as data (it never logs-and-returns).

Quick checks (default): COMMITTED present and parseable; manifest.json hashes to the digest
COMMITTED records; format version supported (a later version's checkpoint gets the one finding
"format_version": this reader cannot judge it); every field well-formed (the field parser, which
rejects first); then the JSON Schema on a bounded sample of the manifest (``schema_sample``);
then the version's own checks: every file against its record and header, derived digests,
tilings (``v1``; ``v2`` walks the rank table part by part, in bounded memory). ``deep=True``
additionally re-hashes every chunk of every file and reports each mismatch with its file and
byte range.
"""

from __future__ import annotations

from shardfmt.errors import CheckpointNotFoundError, FormatVersionError, ShardfmtError, StorageError
from shardfmt.format import hashing
from shardfmt.format.manifest import COMMITTED_NAME, MANIFEST_NAME
from shardfmt.format.parse import load_json, manifest_from_obj
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.loading.reader import read_commit, read_manifest_bytes, resolve_path
from shardfmt.validation.report import Problem, ValidationReport
from shardfmt.validation.schema import (
    SCHEMA_SAMPLE,
    manifest_schema,
    schema_problems,
    schema_sample,
)
from shardfmt.validation.v1 import check_v1
from shardfmt.validation.v2 import Progress, check_v2

__all__ = ["Problem", "ValidationReport", "SCHEMA_SAMPLE", "check_files", "manifest_schema", "schema_sample", "validate"]


def check_files(storage: Storage, path: str, m, *, deep: bool) -> list[Problem]:
    """Check the files under ``path`` against the manifest ``m`` (sizes, headers; v2: the rank
    table and rank indexes too; with ``deep``, every chunk's hash) without requiring a commit
    marker: how a copy is verified before its commit."""
    problems: list[Problem] = []
    (check_v1 if m.format_version == 1 else check_v2)(storage, path, m, problems, deep=deep)
    return problems


def validate(path: str, *, deep: bool = False, storage_options: dict | None = None,
             storage: Storage | None = None, progress: Progress | None = None) -> ValidationReport:
    """Check the checkpoint at ``path`` and return every problem found.

    ``progress(nbytes)`` is called with each data file's size once that file is checked (a
    progress bar's feed: ``shardfmt validate --deep`` shows one).

    Raises ``CheckpointNotFoundError``/``StorageError`` only when ``path`` cannot be reached
    at all or names no checkpoint (``reader.not_a_checkpoint``: a Checkpointer root, a Hugging
    Face folder); everything wrong with the checkpoint itself is a Problem in the report.
    """
    if storage is None:
        storage, path = get_storage(path, storage_options)
    path = resolve_path(storage, path)
    problems: list[Problem] = []

    def done(manifest=None) -> ValidationReport:
        return ValidationReport(path=path, deep=deep, problems=tuple(problems), manifest=manifest)

    try:
        commit = read_commit(storage, path)
    except (CheckpointNotFoundError, StorageError):
        raise  # the path cannot be reached or names no checkpoint (a root, a Hugging Face folder; a
        # COMMITTED that is a FIFO, a link or a directory, or none next to a manifest, is a problem)
    except FormatVersionError as e:  # a later version's marker: this reader cannot judge the rest
        problems.append(Problem(code="format_version", message=str(e), file=COMMITTED_NAME))
        return done()
    except ShardfmtError as e:
        problems.append(Problem(code="not_committed", message=str(e), file=COMMITTED_NAME))
        commit = None
    try:
        raw = read_manifest_bytes(storage, path)
    except StorageError:
        raise
    except ShardfmtError as e:
        problems.append(Problem(code="manifest_missing", message=str(e), file=MANIFEST_NAME))
        return done()
    if commit is not None:
        got = hashing.digest_bytes(raw)
        if got != commit.manifest_digest:
            problems.append(Problem(code="manifest_digest", file=MANIFEST_NAME,
                                    message=f"hashes to {got}, COMMITTED records {commit.manifest_digest}"))
    try:
        obj = load_json(raw, source=MANIFEST_NAME)
    except ShardfmtError as e:
        problems.append(Problem(code="manifest_json", message=str(e), file=MANIFEST_NAME))
        return done()
    try:
        manifest = manifest_from_obj(obj, source=MANIFEST_NAME, size=len(raw))
    except FormatVersionError as e:  # a later version's: its digest and fields are not this reader's to judge
        problems[:] = [p for p in problems if p.code == "not_committed"]
        problems.append(Problem(code="format_version", message=str(e), file=MANIFEST_NAME))
        return done()
    except ShardfmtError as e:  # rejected: the schema pass would only repeat it, at a cost
        problems.append(Problem(code="manifest_field", message=str(e), file=MANIFEST_NAME))
        return done()
    problems.extend(schema_problems(obj, manifest.format_version))
    if commit is not None and manifest.save_id != commit.save_id:
        problems.append(Problem(code="save_id", file=COMMITTED_NAME,
                                message=f"save_id {commit.save_id!r} != manifest save_id {manifest.save_id!r}"))
    if commit is not None and manifest.format_version != commit.format_version:
        problems.append(Problem(code="not_committed", file=COMMITTED_NAME,
                                message=f"a version-{commit.format_version} marker commits a version-"
                                        f"{manifest.format_version} manifest (spec section 4.9)"))
    check = check_v1 if manifest.format_version == 1 else check_v2
    check(storage, path, manifest, problems, deep=deep, progress=progress)
    return done(manifest)
