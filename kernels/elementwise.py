"""Elementwise chunk kernels: the unary functions the lazy API lowers to ``Map`` nodes.

>>> import torch
>>> apply_map("relu", torch.tensor([-1.0, 2.0])).tolist()
[0.0, 2.0]
>>> apply_map("rdiv", torch.tensor([2.0, 4.0]), 1.0).tolist()
[0.5, 0.25]
"""

from __future__ import annotations

import torch

# name -> (function of (x, scalar), needs a scalar)
_MAPS = {
    "cast": (lambda x, c: x, False),  # the value as is; the map's dtype converts it
    "exp": (lambda x, c: torch.exp(x), False),
    "log": (lambda x, c: torch.log(x), False),
    "relu": (lambda x, c: torch.relu(x), False),
    "neg": (lambda x, c: torch.neg(x), False),
    "abs": (lambda x, c: torch.abs(x), False),
    "sqrt": (lambda x, c: torch.sqrt(x), False),
    "rsqrt": (lambda x, c: torch.rsqrt(x), False),
    "square": (lambda x, c: torch.square(x), False),
    "tanh": (lambda x, c: torch.tanh(x), False),
    "sigmoid": (lambda x, c: torch.sigmoid(x), False),
    "silu": (lambda x, c: torch.nn.functional.silu(x), False),
    "scale": (lambda x, c: torch.mul(x, c), True),
    "shift": (lambda x, c: torch.add(x, c), True),
    "rsub": (lambda x, c: torch.sub(c, x), True),
    "rdiv": (lambda x, c: torch.div(c, x), True),
    "pow": (lambda x, c: torch.pow(x, c), True),
    "maximum": (lambda x, c: torch.clamp_min(x, c), True),
    "minimum": (lambda x, c: torch.clamp_max(x, c), True),
}

MAP_FUNCTIONS = tuple(sorted(_MAPS))
SCALAR_MAPS = frozenset(name for name, (_, scalar) in _MAPS.items() if scalar)
# Maps whose result is floating even on integer input.
FLOAT_MAPS = frozenset({"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "rdiv"})


def apply_map(name: str, x: torch.Tensor, scalar: float | None = None) -> torch.Tensor:
    """Apply map ``name`` to a chunk (a new tensor; never in place on the input)."""
    fn, _ = _MAPS[name]
    if name in FLOAT_MAPS and not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    return fn(x, scalar)
