"""The one DTensor adapter: a DTensor's placements as a ``Layout``, for save and load alike.

Pure apart from asking the DTensor and its mesh; works the same whether or not a process
group exists (a DTensor on a mesh this process is not part of holds nothing).
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from shardfmt.errors import StateDictError
from shardfmt.format.manifest import Placement
from shardfmt.layout.topology import Layout, Replicate, Shard, StridedShard


def dtensor_layout(v) -> tuple[Layout, dict[str, int], dict[str, int]]:
    """Return the Layout of a DTensor, this rank's mesh coordinates and the mesh sizes."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    key = (v.device_mesh, tuple(v.placements), v.dim(), rank)
    try:
        hash(key)
    except TypeError:  # a placement type that cannot be hashed: work it out every time
        layout, coords, sizes = _mesh_layout.__wrapped__(*key)
    else:
        layout, coords, sizes = _mesh_layout(*key)
    return layout, dict(coords), dict(sizes)


@functools.lru_cache(maxsize=1024)
def _mesh_layout(mesh, placements: tuple, ndim: int, rank: int) -> tuple[Layout, tuple, tuple]:
    """``dtensor_layout`` for one (mesh, placements, ndim) as seen by global ``rank``: states hold
    thousands of DTensors on a few meshes and layouts, so each is worked out once."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    names = tuple(mesh.mesh_dim_names or (f"mesh{i}" for i in range(mesh.ndim)))
    places = []
    for p in placements:
        if isinstance(p, _StridedShard):
            places.append(StridedShard(p.dim, int(p.split_factor)))
        elif isinstance(p, TShard):
            places.append(Shard(p.dim if p.dim >= 0 else p.dim + ndim))
        elif isinstance(p, TReplicate):
            places.append(Replicate())
        elif isinstance(p, Partial):
            raise StateDictError("Partial placement (pending reduction) cannot be saved; "
                                 "redistribute to Shard or Replicate first")
        else:
            raise StateDictError(f"unsupported DTensor placement {p!r}")
    coord = mesh.get_coordinate()
    if coord is None:
        return Layout(names, tuple(places)), (), ()
    return Layout(names, tuple(places)), tuple(zip(names, coord)), tuple(zip(names, mesh.shape))


def placement_record(layout: Layout | None) -> Placement | None:
    """Return the manifest's record of a Layout (None for none)."""
    if layout is None:
        return None
    return Placement(mesh_dims=layout.mesh_dims, placements=tuple(tuple(p.to_json()) for p in layout.placements),
                     stage=layout.stage)
