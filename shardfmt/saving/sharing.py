"""What a save stores: tensors checked as saveable, and tensors that share memory found out.

Tensors of one storage with the same view are aliases (stored once); different views of one
storage are saved as one storage span plus view records (stride, offset), so a load restores
the sharing. Pure apart from asking the tensors where their memory is.
"""

from __future__ import annotations

import torch

from shardfmt.errors import StateDictError
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.manifest import MAX_NDIM, ViewRecord, view_reach


def check_saveable(fqn: str, t: torch.Tensor) -> None:
    if t.device.type == "meta":
        raise StateDictError(f"{fqn}: a meta tensor has no data to save")
    if t.is_nested:
        raise StateDictError(f"{fqn}: nested tensors cannot be saved; save their components "
                             "(unbind()) as separate tensors")
    if t.is_sparse or t.layout != torch.strided:
        raise StateDictError(f"{fqn}: only dense (strided) tensors can be saved, got layout {t.layout}")
    dtype_code(t.dtype, what=fqn)
    if t.dim() > MAX_NDIM:
        raise StateDictError(f"{fqn}: {t.dim()} dims exceed the format's limit of {MAX_NDIM}")


def _storage_key(t: torch.Tensor) -> tuple | None:
    if t.numel() == 0:
        return None
    ptr = t.untyped_storage().data_ptr()
    return None if ptr == 0 else (t.device.type, t.device.index, ptr)


def plan_sharing(plain: dict[str, torch.Tensor]):
    """Split plain tensors into stored ones, aliases and views of shared storages."""
    groups: dict[tuple, list[str]] = {}
    for fqn, t in plain.items():
        key = _storage_key(t)
        if key is not None:
            groups.setdefault(key, []).append(fqn)
    stored = dict(plain)
    aliases: dict[str, str] = {}
    views: dict[str, tuple[str, ViewRecord]] = {}
    storages: dict[str, torch.Tensor] = {}
    for names in sorted((sorted(v) for v in groups.values() if len(v) > 1), key=lambda v: v[0]):
        ts = [plain[n] for n in names]
        sig = {(t.dtype, t.storage_offset(), tuple(t.shape), t.stride()) for t in ts}
        if len(sig) == 1:
            for n in names[1:]:
                aliases[n] = names[0]
                del stored[n]
            continue
        if len({t.dtype for t in ts}) != 1:
            continue  # reinterpreted bytes of different dtypes: store each on its own
        lo = min(t.storage_offset() for t in ts)
        hi = max(t.storage_offset() + view_reach(t.shape, t.stride()) for t in ts)
        base_name = f".storage.{names[0]}"  # a leading dot: never a user FQN; unique per group
        storages[base_name] = torch.as_strided(ts[0], (hi - lo,), (1,), lo)
        for n, t in zip(names, ts):
            views[n] = (base_name, ViewRecord(base=base_name, storage_offset=t.storage_offset() - lo,
                                              stride=tuple(t.stride())))
            del stored[n]
    return stored, aliases, views, storages
