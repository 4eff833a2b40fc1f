"""Helpers shared by the delta tests (imported by name: conftest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CHUNK", "bits_equal", "flat", "make_state", "states_equal", "train_step"]

#: Small chunks, so kilobyte-sized test states span many chunks.
CHUNK = 16 * 1024

State = dict[str, Any]


def make_state(seed: int = 0, *, layers: int = 6, width: int = 64) -> State:
    """A model + AdamW-like optimizer state: weights, biases, moments and step counters."""
    g = torch.Generator().manual_seed(seed)
    model = {}
    for i in range(layers):
        model[f"layer{i}.weight"] = torch.randn(width, width, generator=g)
        model[f"layer{i}.bias"] = torch.randn(width, generator=g)
    opt_state = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(width, width, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(width, width, generator=g) * 1e-6,
        }
        for i in range(layers)
    }
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": [{"lr": 1e-3}]},
            "step": 0}


def train_step(state: State, *, trainable: Callable[[int], bool] = lambda i: True,
               seed: int = 0, lr: float = 1e-3) -> State:
    """A new state after one AdamW-like step on the trainable layers (frozen ones unchanged)."""
    g = torch.Generator().manual_seed(seed)
    out: State = {"model": {}, "optimizer": {"state": {}, "param_groups": [{"lr": lr}]},
                  "step": state["step"] + 1}
    layers = len(state["optimizer"]["state"])
    for i in range(layers):
        w, b = state["model"][f"layer{i}.weight"], state["model"][f"layer{i}.bias"]
        mom = state["optimizer"]["state"][i]
        if trainable(i):
            grad = torch.randn(w.shape, generator=g) * 1e-2
            exp_avg = 0.9 * mom["exp_avg"] + 0.1 * grad
            exp_avg_sq = 0.999 * mom["exp_avg_sq"] + 0.001 * grad * grad
            w = w - lr * exp_avg / (exp_avg_sq.sqrt() + 1e-8)
            b = b - lr * torch.randn(b.shape, generator=g) * 1e-2
            mom = {"step": mom["step"] + 1, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        out["model"][f"layer{i}.weight"] = w.clone()
        out["model"][f"layer{i}.bias"] = b.clone()
        out["optimizer"]["state"][i] = {k: v.clone() for k, v in mom.items()}
    return out


def flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensor leaves by path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flat(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(flat(v, f"{prefix}/{i}" if prefix else str(i)))
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact comparison (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ua = a.detach().contiguous().reshape(-1).view(torch.uint8)
    ub = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(ua, ub))


def states_equal(a: Any, b: Any) -> bool:
    """Every tensor bit-equal, same keys."""
    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(bits_equal(fa[k], fb[k]) for k in fa)
