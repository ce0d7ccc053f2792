"""reshard: topology, the pure load planner, and offline tools: ``reshard.convert.convert`` (a
checkpoint for a new mesh), ``reshard.hf.export_hf`` / ``import_hf`` (the Hugging Face layout)."""

import shardfmt as _shardfmt  # noqa: F401  (import order: shardfmt's API imports reshard's planner)

from .geometry import Box, ByteRange, intersect
from .planner import CopyItem, LoadPlan, PhysicalRead, TargetSlice, plan_load

__all__ = [
    "Box",
    "ByteRange",
    "CopyItem",
    "LoadPlan",
    "PhysicalRead",
    "TargetSlice",
    "intersect",
    "plan_load",
]
