"""Model and optimizer state in and out of ``save``/``load``, optimizer state keyed by parameter name.

``get_state_dict(model, optimizer)`` returns ``{"model": ..., "optim": ...}`` built with
``torch.distributed.checkpoint.state_dict`` (DCP): FSDP2/DTensor parameters give DTensor
entries, and the optimizer's per-parameter state is keyed by the parameter's FQN, so it
reshards like the weights. ``set_state_dict(model, optimizer, state)`` applies such a dict
once ``load`` has filled it. The protocol, in one process or on every rank::

    1) state = get_state_dict(model, optimizer)   # a fresh optimizer: state made to load into
    2) load(state, path)                          # or save(state, path)
    3) set_state_dict(model, optimizer, state)

A fresh optimizer has no state to load into: like DCP, ``get_state_dict`` makes it with a
zero-gradient step at lr=0, then wraps each parameter's made-up state in ``IfSaved`` and
clears the optimizer's own state again, so the optimizer stays fresh. ``save`` never writes
an ``IfSaved`` subtree (an optimizer that never stepped saves no per-parameter state);
``load`` keeps only the parameters' states the checkpoint holds, so parameters that had none
at save (frozen, never used, never stepped) get none back: the next step is the one the
saving run would have taken.
"""

from __future__ import annotations

from typing import Any

import torch

from shardfmt.errors import StateDictError
from shardfmt.layout.state import IfSaved


def get_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Return ``{"model": model state, "optim": optimizer state keyed by parameter FQN}``
    ("optim" only with an optimizer), ready to ``save`` or to ``load`` into."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        out["optim"] = optimizer_state_dict(model, optimizer)
    return out


def set_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   state: dict[str, Any]) -> None:
    """Apply ``state["model"]`` (and ``state["optim"]`` with an optimizer), as ``get_state_dict``
    made it and ``load`` filled it, to ``model`` and ``optimizer``; other keys are left alone."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    for key in ("model", "optim") if optimizer is not None else ("model",):
        if not isinstance(state, dict) or not isinstance(state.get(key), dict):
            raise StateDictError(f"set_state_dict: state[{key!r}] must be the dict shardfmt.get_state_dict made")
    if optimizer is not None:
        set_optimizer_state(model, optimizer, state["optim"])
    set_model_state_dict(model, state["model"])


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter FQN; a fresh optimizer's made-up state is
    wrapped per parameter in ``IfSaved`` and the optimizer left fresh."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if optimizer.state:
        return get_optimizer_state_dict(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]  # DCP makes no state while any parameter has a gradient
    try:
        for p in params:
            p.grad = None
        osd = get_optimizer_state_dict(model, optimizer)
    finally:
        optimizer.state.clear()  # made only to have tensors to load into
        for p, g in zip(params, grads):
            p.grad = g
    return {**osd, "state": {k: IfSaved(v) for k, v in osd["state"].items()}}


def set_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Apply an optimizer state dict keyed by parameter FQN; parameters without state in it get none.

    An ``IfSaved`` that no ``load`` resolved is made-up state, not the checkpoint's: it is dropped.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    groups = osd.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise StateDictError("set_state_dict: the optimizer state has no list of param_groups")
    by_index = sorted({repr(p) for g in groups for p in g.get("params", []) if not isinstance(p, str)})
    if by_index:
        raise StateDictError(f"set_state_dict: the optimizer state names its parameters by index ({', '.join(by_index[:5])}): "
                             "it was saved from optimizer.state_dict(), not from shardfmt.get_state_dict, and its "
                             "per-parameter state cannot be matched by name (load it into optimizer.state_dict() "
                             "of an optimizer that has state)")
    state = {k: v for k, v in osd.get("state", {}).items() if not isinstance(v, IfSaved)}
    if not state:  # DCP matches groups by parameter name only when some parameter has state
        groups = _in_optimizer_order(model, optimizer, groups)
    # strict=False: a parameter that requires grad may have had no state at save (never used)
    set_optimizer_state_dict(model, optimizer, {**osd, "state": state, "param_groups": groups},
                             options=StateDictOptions(strict=False))


def _in_optimizer_order(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[dict]) -> list[dict]:
    """``groups`` (named by FQN) reordered to match ``optimizer``'s groups by their first
    parameter; as they are where they do not match (torch then refuses the sizes)."""
    now = optimizer_state_dict(model, optimizer)["param_groups"]
    where = {p: i for i, g in enumerate(groups) for p in g.get("params", [])}
    order = [where.get(g["params"][0]) if g.get("params") else None for g in now]
    if None in order or sorted(order) != list(range(len(groups))):
        return groups
    return [groups[i] for i in order]
