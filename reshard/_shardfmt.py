"""The shardfmt internals the offline tools build on, imported here and nowhere else in reshard.

The tools stream slices between files, so they use more than shardfmt's top-level API: the
format's records and safetensors header, the layout math, the byte stores, the load planner
and executor, and the save writer. When one of these moves inside shardfmt, this file is the
one to re-point. Errors come from ``shardfmt.errors`` (public) and ``reshard.errors``. The
command line's parser (``reshard.cli``) imports no torch, so it takes what it shares with
``shardfmt``'s command line from the torch-free modules directly: ``shardfmt.cli.output`` and
``shardfmt.cli.parser``, the release (``shardfmt._version``) and the load defaults
(``shardfmt.loading.options``).
"""

from __future__ import annotations

from shardfmt.commit.protocol import commit_strategy
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.dtypes import dtype_code, torch_dtype
from shardfmt.format.hashing import digest_bytes
from shardfmt.format.manifest import (
    FileRecord,
    Manifest,
    Placed,
    Placement,
    ShardRecord,
    TensorRecord,
    Topology,
    ValueRecord,
)
from shardfmt.format.parse import check_step
from shardfmt.format.safetensors import (
    PREFIX_BYTES,
    EncodedHeader,
    decode_header,
    encode_header,
    header_length,
)
from shardfmt.format.tensor_bytes import BufferFile, byte_pieces, byte_view
from shardfmt.io.fsspec import FsspecStorage
from shardfmt.io.registry import get_storage, parse_storage_options
from shardfmt.io.store import Storage
from shardfmt.layout.dtensor import placement_record
from shardfmt.layout.geometry import Box, box_spans, intersect, is_run, row_major_strides
from shardfmt.layout.placed import written_by
from shardfmt.layout.rules import Rules, load_rules, plan_layouts
from shardfmt.layout.tiling import tiling_problems
from shardfmt.layout.topology import MAX_WORLD, Layout, Mesh, TopologyError
from shardfmt.loading.executor import Executor
from shardfmt.loading.options import DEFAULT_MAX_GAP, DEFAULT_MAX_READ, DEFAULT_WORKERS, LoadOptions
from shardfmt.loading.planner import TargetSlice, plan_load
from shardfmt.loading.reader import check_headers, open_checkpoint
from shardfmt.loading.targets import ReadTarget, plan_reads, targets_for_rank
from shardfmt.saving.messages import HeldTensor, RankState
from shardfmt.saving.plan import assign_writers, auto_chunk_size
from shardfmt.saving.shard_file import FileStream, ShardData, ShardSpec, file_order
from shardfmt.saving.writer import CheckpointWriter
from shardfmt.validation import validate

__all__ = [
    "DEFAULT_MAX_GAP", "DEFAULT_MAX_READ", "DEFAULT_WORKERS", "MAX_WORLD", "PREFIX_BYTES", "Box", "BufferFile", "EncodedHeader",
    "CheckpointWriter", "Executor", "FileRecord", "FileStream", "Layout", "LoadOptions", "Manifest", "Mesh", "Placed", "Placement", "Rules",
    "FsspecStorage", "HeldTensor", "RankState", "ReadTarget", "ShardData", "ShardRecord", "ShardSpec", "Storage", "TargetSlice", "TensorRecord", "Topology", "TopologyError",
    "ValueRecord", "assign_writers", "auto_chunk_size", "box_spans", "byte_pieces", "byte_view", "check_headers", "check_step", "commit_strategy",
    "decode_header", "digest_bytes", "dtype_code", "encode_header", "file_order", "get_storage", "hashing",
    "header_length", "intersect", "is_run", "jsonvalue", "load_rules", "open_checkpoint", "parse_storage_options",
    "placement_record", "plan_layouts", "plan_load", "plan_reads", "row_major_strides", "targets_for_rank",
    "tiling_problems", "torch_dtype", "validate", "written_by",
]
