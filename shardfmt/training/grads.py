"""Gradients in a checkpoint: a save in the middle of a step that resumes exactly (issue 20, item 5).

A checkpoint holds parameters and optimizer state; the gradients of a step not yet applied (a
gradient accumulation between micro-steps) are lost with a crash, and a resumed run redoes the
step from its first micro-step (``midstep`` warns). With ``Checkpointer(save_grads=True)`` every
save also holds each model parameter's set ``.grad`` under ``GRADS_KEY`` (``{entry: {parameter
name: grad}}``, the names ``named_parameters`` gives): tensors like the weights, so they reshard
like them (a DTensor's gradient is a DTensor placed as its parameter). A restore loads each
saved gradient into a fresh tensor shaped, typed and placed like its parameter (an ``IfSaved``
slot: a gradient the checkpoint does not hold is not missing) and sets ``.grad``: to the saved
values where the checkpoint holds them, None elsewhere, as the saving run had them. The
micro-step counter belongs with them: ``save(..., metadata={"micro_step": k})`` and
``Checkpointer.restored_metadata`` after the restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardfmt.layout.state import IfSaved

GRADS_KEY = "_shardfmt_grads"


def _models(state: Mapping[str, Any]):
    return [(name, obj) for name, obj in state.items() if isinstance(obj, torch.nn.Module)]


def set_grads(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """What a save holds: per model entry, its parameters' set gradients (entries without any left out)."""
    out = {}
    for name, model in _models(state):
        got = {p_name: p.grad.detach() for p_name, p in model.named_parameters() if p.grad is not None}
        if got:
            out[name] = got
    return out


def grad_slots(state: Mapping[str, Any]) -> IfSaved:
    """What a restore loads into: a fresh tensor like each model parameter, filled if saved."""
    return IfSaved({name: {p_name: torch.empty_like(p.detach()) for p_name, p in model.named_parameters()}
                    for name, model in _models(state)})


def apply_grads(state: Mapping[str, Any], loaded: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Set each model parameter's ``.grad`` to its loaded gradient, or None where none was saved."""
    for name, model in _models(state):
        got = loaded.get(name, {})
        for p_name, p in model.named_parameters():
            p.grad = got.get(p_name)


def holds_grads(unexpected: tuple[str, ...]) -> bool:
    """Whether a load's unrequested keys show saved gradients (a restore without ``save_grads``)."""
    return any(k.startswith(GRADS_KEY + ".") for k in unexpected)


__all__ = ["GRADS_KEY", "apply_grads", "grad_slots", "holds_grads", "set_grads"]
