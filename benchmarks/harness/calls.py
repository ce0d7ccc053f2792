"""The interface between the harness and a candidate: ``Env`` (one per rank process) and
``Call`` (one per measured call). A candidate is ``run(call) -> dict | None``; the dict's
numbers become metrics of the measurement (``blocked``, ``bytes_read``...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..states import Built


@dataclass(slots=True, kw_only=True)
class Env:
    """A rank process: who it is, where the state lives, and what it keeps between calls."""

    rank: int
    world: int
    device: torch.device
    fsync: bool
    mesh: Any = None                       # the 1-D DeviceMesh of the world (None: one process)
    s3_endpoint: str | None = None
    cache: dict = field(default_factory=dict)  # stagers, host buffers: reused by every round

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def host(self, key: str, like) -> list[torch.Tensor] | None:
        """Pre-faulted host buffers shaped as ``like`` (pinned when the state is on a GPU), made once."""
        if key not in self.cache:
            self.cache[key] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda).zero_() for t in like]
        return self.cache[key]

    def bounce(self, key: str, like) -> list[torch.Tensor] | None:
        """Host buffers the floors copy GPU pieces through; None on CPU."""
        return self.host(key, like) if self.cuda else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One measured call: what to save or fill (``built``), where (``path``), from where (``src``)."""

    env: Env
    phase: str
    layout: str
    built: Built | None
    path: str
    src: str = ""
    src_world: int = 1
