"""How the Checkpointer's ranks agree: rank 0's choice broadcast, every rank's outcome gathered.

Messages are small JSON values (orjson) on the gloo control group of ``saving.coordinator``,
never on the training's own collectives. Without a process group of more than one rank (not
initialized, or a world of one) every call is local: ``broadcast`` returns its argument and
``all_gather`` a list of it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import warnings
from typing import Any

import orjson
import torch

from shardfmt.saving.coordinator import all_gather_bytes, broadcast_bytes, control_group


@dataclasses.dataclass(frozen=True, slots=True)
class Ranks:
    """The ranks of ``process_group`` (None: the default group), with ``timeout`` on their agreements."""

    process_group: Any = None
    timeout: _dt.timedelta | None = None

    def distributed(self) -> bool:
        """True when more than one rank takes part (asked on each call: the group may start later)."""
        d = torch.distributed
        return d.is_available() and d.is_initialized() and d.get_world_size(self.process_group) > 1

    def rank(self) -> int:
        return torch.distributed.get_rank(self.process_group) if self.distributed() else 0

    def world(self) -> int:
        return torch.distributed.get_world_size(self.process_group) if self.distributed() else 1

    def broadcast(self, obj: Any) -> Any:
        """Return rank 0's ``obj`` on every rank (other ranks' ``obj`` is ignored)."""
        if not self.distributed():
            return obj

        g = control_group(self.process_group, self.timeout)
        return orjson.loads(broadcast_bytes(orjson.dumps(obj) if self.rank() == 0 else None, 0, g))

    def all_reduce_sum(self, vector: torch.Tensor) -> torch.Tensor:
        """Every rank's float64 ``vector`` summed, on every rank (a gloo all-reduce of the control group)."""
        if not self.distributed():
            return vector
        g = control_group(self.process_group, self.timeout)
        out = vector.to(torch.float64).clone()
        torch.distributed.all_reduce(out, group=g)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, in rank order."""
        if not self.distributed():
            return [obj]

        g = control_group(self.process_group, self.timeout)
        return [orjson.loads(b) for b in all_gather_bytes(orjson.dumps(obj), g)]


def job_warning(message: str, *, rank: int, stacklevel: int = 2) -> None:
    """Warn once for the whole job about what every rank finds alike (a changed world size, a
    checkpoint all ranks fall back from): on ``rank`` 0 of the Checkpointer's ranks (``Ranks.rank``)."""
    if rank == 0:
        warnings.warn(message, stacklevel=stacklevel + 1)
