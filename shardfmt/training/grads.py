"""Gradients in a checkpoint: a save in the middle of a step that resumes exactly (issue 20, item 5).

A checkpoint holds parameters and optimizer state; the gradients of a step not yet applied (a
gradient accumulation between micro-steps) are lost with a crash, and a resumed run redoes the
step from its first micro-step (``midstep`` warns). With ``Checkpointer(save_grads=True)`` every
save also holds each model parameter's set ``.grad`` under ``GRADS_KEY`` (``{entry: {parameter
name: grad}}``, the names ``named_parameters`` gives): tensors like the weights, so they reshard
like them (a DTensor's gradient is a DTensor placed as its parameter; one still ``Partial`` is
reduced first; sparse gradients are not saved, with a warning). A restore loads each saved
gradient into a fresh tensor shaped, typed and placed like its parameter, made only for the
gradients the checkpoint holds, and sets ``.grad``: to the saved values where the checkpoint
holds them, None elsewhere, as the saving run had them. The
micro-step counter belongs with them: ``save(..., metadata={"micro_step": k})`` and
``Checkpointer.restored_metadata`` after the restore.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Mapping
from typing import Any

import torch

from shardfmt.layout.state import IfSaved

GRADS_KEY = "_shardfmt_grads"


_WRAPPERS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")  # compile, FSDP1, checkpointing


def _models(state: Mapping[str, Any]):
    return [(name, obj) for name, obj in state.items() if isinstance(obj, torch.nn.Module)]


def _params(model: torch.nn.Module):
    """(name, parameter), the names without the wrappers' prefixes (as the model's state dict
    names them: a compiled model's gradients restore into the plain one and back)."""
    for name, p in model.named_parameters():
        for w in _WRAPPERS:
            name = name.replace(w, "")
        yield name, p


def set_grads(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """What a save holds: per model entry, its parameters' set gradients (entries without any
    left out). A DTensor gradient still to be reduced (``Partial``) is reduced to its parameter's
    placements first (a collective: every rank saves); a sparse one is left out, with a warning."""
    out = {}
    sparse = []
    for name, model in _models(state):
        got = {}
        for p_name, p in _params(model):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                sparse.append(f"{name}.{p_name}")
                continue
            got[p_name] = _reduced(g.detach(), p)
        if got:
            out[name] = got
    if sparse:
        warnings.warn(f"save_grads: sparse gradients are not saved ({', '.join(sparse[:3])}"
                      f"{' ...' if len(sparse) > 3 else ''}): a run resumed from this checkpoint redoes their step",
                      stacklevel=4)
    return out


def _reduced(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    placements = getattr(g, "placements", None)
    if placements is None or not any(pl.is_partial() for pl in placements):
        return g
    return g.redistribute(g.device_mesh, p.placements)


def grad_slots(state: Mapping[str, Any], saved: Container[str]) -> IfSaved:
    """What a restore loads into: a fresh tensor like each model parameter whose gradient the
    checkpoint holds (``saved``: the checkpoint's tensor names); no memory for the others."""
    return IfSaved({name: {p_name: torch.empty_like(p.detach()) for p_name, p in _params(model)
                           if f"{GRADS_KEY}.{name}.{p_name}" in saved}
                    for name, model in _models(state)})


def apply_grads(state: Mapping[str, Any], loaded: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Set each model parameter's ``.grad`` to its loaded gradient, or None where none was saved."""
    for name, model in _models(state):
        got = loaded.get(name, {})
        for p_name, p in _params(model):
            p.grad = got.get(p_name)


def holds_grads(unexpected: tuple[str, ...]) -> bool:
    """Whether a load's unrequested keys show saved gradients (a restore without ``save_grads``)."""
    return any(k.startswith(GRADS_KEY + ".") for k in unexpected)


__all__ = ["GRADS_KEY", "apply_grads", "grad_slots", "holds_grads", "set_grads"]
