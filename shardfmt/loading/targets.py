"""What a rank of a mesh reads: every slice it holds, as the saved layout or a new one says.

Pure: a manifest, a mesh and a rank in, read targets out (no files, no process group).
"""

from __future__ import annotations

from shardfmt.layout.topology import Mesh, count_layers, held_boxes, layout_from_record, retarget
from shardfmt.loading.planner import TargetSlice


def targets_for_rank(manifest, mesh: Mesh, rank: int, *, layouts=None) -> list[TargetSlice]:
    """Every slice ``rank`` of ``mesh`` holds, each tensor laid out as it was saved, or as
    ``layouts`` (fqn -> Layout on ``mesh``, e.g. from a rules file) says where it has an entry."""
    coords = mesh.coords(rank)
    sizes = dict(mesh.dims)
    n_layers = count_layers(manifest.tensors)
    out: list[TargetSlice] = []
    for fqn in sorted(manifest.tensors):
        name, rec = manifest.resolve(fqn)
        if rec.view is not None or name != fqn:
            continue  # aliases and views are filled from what they point at
        lay = layouts.get(fqn) if layouts is not None else None
        if lay is None:
            lay = retarget(fqn, layout_from_record(rec.placement), mesh, num_layers=n_layers)
        for hb in held_boxes(rec.shape, lay, coords, sizes):
            out.append(TargetSlice(index=len(out), fqn=fqn, box=hb.box))
    return out
