"""Every RNG a training step draws from, captured and restored as typed JSON (per rank)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """Return python, numpy, torch CPU and every CUDA device's RNG state."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
        # the device this rank trains on: resumed on a node where the rank has another index
        # (8 GPUs a node -> 4), it gets its own stream back, not the one of the same index
        state["cuda_current"] = torch.cuda.get_rng_state(torch.cuda.current_device()).numpy().tobytes()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every RNG back as ``capture`` saw it."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in cuda[:n]])
    mine = state.get("cuda_current")
    if mine is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(mine), dtype=torch.uint8), torch.cuda.current_device())
