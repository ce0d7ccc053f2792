"""``import_dcp``: a DCP directory -> a committed shardfmt checkpoint (protocol: ``reshard.dcp``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from reshard._shardfmt import (
    CheckpointWriter,
    Manifest,
    ShardData,
    Storage,
    Topology,
    check_step,
    get_storage,
    hashing,
    jsonvalue,
)
from reshard.dcp.items import ItemReader, Unloadable
from reshard.dcp.metadata import DcpMetadata, parse_metadata
from reshard.dcp.plan import (
    DEFAULT_MEMORY_BUDGET,
    RANK_FILE,
    ChunkItem,
    ImportPlan,
    fill,
    plan_import,
)
from reshard.errors import DcpImportError, SourceNotFoundError
from reshard.options import DCP_TRUST_PICKLE_HELP as TRUST_PICKLE_HELP
from reshard.overlap import refuse_overlap
from reshard.parse import parse_size
from shardfmt.errors import CheckpointNotFoundError, EncodingError

METADATA_LIMIT = 1 << 31  # largest .metadata read



@dataclass(frozen=True, slots=True, kw_only=True)
class ImportReport:
    """What ``import_dcp`` wrote: the committed manifest and the values it skipped (key, why)."""

    manifest: Manifest
    skipped: tuple[tuple[str, str], ...]
    bytes_read: int


def _chunk_tensor(reader: ItemReader, it: ChunkItem) -> torch.Tensor:
    what = f"tensor {it.fqn!r} chunk at offsets {list(it.offsets)}"
    t = reader.load(it.location, what)
    if not isinstance(t, torch.Tensor):
        raise DcpImportError(f"{reader.path(it.location)}: {what} holds a {type(t).__name__}, not a tensor")
    if t.dtype != it.dtype or tuple(t.shape) != it.sizes:
        raise DcpImportError(f"{reader.path(it.location)}: {what} holds {t.dtype} {list(t.shape)}, the metadata "
                             f"says {it.dtype} {list(it.sizes)}")
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone()  # keep only this chunk's bytes alive
    return t


def _read_values(reader: ItemReader, plan: ImportPlan, *, skip_unsupported: bool
                 ) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    values: dict[str, Any] = {}
    skipped: list[tuple[str, str]] = []
    for group in plan.values:
        try:
            value = fill(group.template, {k: reader.load(loc, f"value {k!r}") for k, loc in group.items})
            jsonvalue.encode(value, where=group.name)
        except (Unloadable, EncodingError) as e:  # corrupt items are never skipped
            if not skip_unsupported:
                raise DcpImportError(f"{e} (shardfmt stores typed JSON only; pass skip_unsupported_values=True, "
                                     "CLI --skip-unsupported-values, to import without it)") from None
            skipped.append((group.name, str(e)))
            warnings.warn(f"import-dcp: skipped value {group.name!r}: {e}", stacklevel=3)
            continue
        values[group.name] = value
    return values, skipped


def import_dcp(
    src: str,
    dst: str,
    *,
    trust_pickle: bool,
    storage_options: dict | None = None,
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool = False,
    skip_unsupported_values: bool = False,
    extension_registry=None,
    chunk_size: int = hashing.DEFAULT_CHUNK_SIZE,
    sync: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ImportReport:
    """Import the DCP directory ``src`` as a committed shardfmt checkpoint at ``dst``.

    ``trust_pickle`` must be True (see ``TRUST_PICKLE_HELP``). ``metadata`` is the manifest's
    user metadata; by default it records the source (``{"imported_from": {"format":
    "torch.distributed.checkpoint", "version": ...}}``). ``extension_registry`` is DCP's
    ``ExtensionRegistry`` used to undo stream transforms (torch's default when None).
    ``storage_options`` apply to both ``src`` and ``dst``. ``progress`` is told the tensor bytes of
    each part as it is written. ``memory_budget``: bytes, or a size
    such as ``"1GiB"`` (``reshard.parse.parse_size``).
    """
    if trust_pickle is not True:
        raise DcpImportError(f"{src}: refusing to read DCP metadata without trust_pickle=True. {TRUST_PICKLE_HELP}")
    check_step(step)
    memory_budget = parse_size(memory_budget, what="memory_budget")
    storage, root = get_storage(src, storage_options)
    refuse_overlap(storage, root, dst, storage_options)
    meta_path = storage.join(root, ".metadata")
    meta = _read_metadata(storage, root, meta_path, src)
    listed = [n for n in storage.listdir(root) if RANK_FILE.fullmatch(n)]
    plan = plan_import(meta, _file_sizes(storage, root, meta), where=meta_path, memory_budget=memory_budget,
                       extra_files=listed)

    reader = ItemReader(storage, root, extension_registry)
    try:
        values, skipped = _read_values(reader, plan, skip_unsupported=skip_unsupported_values)
        if metadata is None:
            metadata = {"imported_from": {"format": "torch.distributed.checkpoint", "version": meta.version}}
        with CheckpointWriter(dst, storage_options=storage_options, overwrite=overwrite, chunk_size=chunk_size,
                              sync=sync) as writer:
            for part in plan.parts:
                shards = [ShardData(fqn=it.fqn, data=_chunk_tensor(reader, it), global_shape=it.global_shape,
                                    offsets=it.offsets) for it in part.items]
                writer.write_rank(part.rank, shards, part=part.part)
                if progress is not None:
                    progress(sum(s.data.nbytes for s in shards))
                del shards
            for key, value in values.items():
                writer.add_value(key, value)
            manifest = writer.commit(step=step, metadata=metadata, topology=Topology(world_size=plan.world_size))
    finally:
        reader.close()
    return ImportReport(manifest=manifest, skipped=tuple(skipped), bytes_read=reader.bytes_read)


def _read_metadata(storage: Storage, root: str, meta_path: str, src: str) -> DcpMetadata:
    """Read ``.metadata`` through the restricted unpickler (a missing one: not a DCP directory)."""
    try:
        data = storage.read_bytes(meta_path, limit=METADATA_LIMIT, within=root)
    except CheckpointNotFoundError:
        raise SourceNotFoundError(f"{src}: no .metadata file: not a torch.distributed.checkpoint directory, or its "
                             "save did not finish (DCP writes .metadata last)") from None
    return parse_metadata(data, where=meta_path)


def _file_sizes(storage: Storage, root: str, meta: DcpMetadata) -> dict[str, int]:
    """The size of every file the metadata names (a missing one is refused, naming a key it holds)."""
    sizes: dict[str, int] = {}
    for (fqn, _), loc in meta.locations.items():
        if loc.relative_path not in sizes:
            try:
                sizes[loc.relative_path] = storage.size(storage.join(root, loc.relative_path), within=root)
            except CheckpointNotFoundError:
                raise DcpImportError(f"{storage.join(root, loc.relative_path)}: missing (.metadata stores "
                                     f"{fqn!r} in it)") from None
    return sizes


__all__ = ["METADATA_LIMIT", "TRUST_PICKLE_HELP", "ImportReport", "import_dcp"]
