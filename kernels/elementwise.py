"""Elementwise chunk kernels: the unary functions the lazy API lowers to ``Map`` nodes.

>>> import torch
>>> apply_map("relu", torch.tensor([-1.0, 2.0])).tolist()
[0.0, 2.0]
>>> apply_map("rdiv", torch.tensor([2.0, 4.0]), 1.0).tolist()
[0.5, 0.25]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# name -> (function of (x, scalar), needs a scalar)
_MAPS = {
    "cast": (lambda x, c: x, False),  # the value as is; the map's dtype converts it
    "exp": (lambda x, c: _exp(x), False),
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

# Below these the exponential is not a normal number of the dtype (log of the smallest
# normal): torch's vectorised exp takes a path ~20x slower for such inputs (a softmax's masked
# scores of -1e9 hit it on every masked entry), so they are computed as 0 directly -- the
# subnormal results (< 1.2e-38 in float32) are flushed to zero, as fast-math GPU kernels do.
_EXP_NORMAL_FLOOR = {torch.float32: -87.3365, torch.float64: -708.3964}


def _exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)``, subnormal results flushed to zero (see ``_EXP_NORMAL_FLOOR``). On the CPU
    the flush is skipped when no input is below the floor (a host read of a host tensor);
    elsewhere reading the minimum back would stall the host on the device every call, so the
    device masks unconditionally (its exp has no slow path to avoid): the same values.

    >>> _exp(torch.tensor([0.0, -1e9, -90.0, 1.0])).tolist()
    [1.0, 0.0, 0.0, 2.7182817459106445]
    >>> _exp(torch.zeros(3, device="meta")).device  # no host read of device memory
    device(type='meta')
    """
    floor = _EXP_NORMAL_FLOOR.get(x.dtype)
    if floor is None or x.numel() == 0:
        return torch.exp(x)
    if x.device.type != "cpu":
        return torch.exp(x).masked_fill_(x < floor, 0.0)
    if float(torch.amin(x)) >= floor:
        return torch.exp(x)
    return torch.exp(torch.clamp_min(x, floor)).masked_fill_(x < floor, 0.0)


def warm_transcendentals() -> None:
    """Call torch's float32 transcendental kernels once, on one thread and a few elements,
    before any lane runs one.

    Why: the first large ``torch.exp`` of a process, entered by two threads at once (a lane
    and its OpenMP partner, once the pool is up), now and then computed the calling thread's
    half with a low-accuracy exp: about 1 fresh process in 42 on the 2-core Intel host
    (torch 2.13 CPU), 76,123 of 2^20 elements wrong by up to 1.5e-4, an error that follows
    ``frac(x * log2(e))`` like a low-degree polynomial, and a rerun in the same process exact
    (``bench/gpu_probe.py``'s fused chain; see docs/runtime.md, "A first-call race in torch's
    exp"). With this warm-up first, 0 of 270 such processes went wrong. It is a mitigation of
    a race inside torch, not a proof of its cause.

    >>> warm_transcendentals()  # idempotent and cheap (microseconds)
    """
    x = torch.linspace(-1.0, 1.0, 16)
    positive = x.abs() + 1.0
    for fn in (torch.exp, torch.tanh, torch.sigmoid):
        fn(x)
    for fn in (torch.log, torch.rsqrt, torch.sqrt):
        fn(positive)
    torch.nn.functional.silu(x)


warm_transcendentals()

MAP_FUNCTIONS = tuple(sorted(_MAPS))
SCALAR_MAPS = frozenset(name for name, (_, scalar) in _MAPS.items() if scalar)
# Maps whose result is floating even on integer input.
FLOAT_MAPS = frozenset({"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "rdiv"})


# the maps with a torch function that writes into a given tensor (``out=``), as
# (x, scalar, out) -> out: the same values as ``_MAPS``' (exp is not one: its subnormal
# flush reads its input's minimum back first)
_OUT_MAPS = {
    "log": lambda x, c, o: torch.log(x, out=o),
    "relu": lambda x, c, o: torch.clamp_min(x, 0, out=o),
    "neg": lambda x, c, o: torch.neg(x, out=o),
    "abs": lambda x, c, o: torch.abs(x, out=o),
    "sqrt": lambda x, c, o: torch.sqrt(x, out=o),
    "rsqrt": lambda x, c, o: torch.rsqrt(x, out=o),
    "tanh": lambda x, c, o: torch.tanh(x, out=o),
    "sigmoid": lambda x, c, o: torch.sigmoid(x, out=o),
    "silu": lambda x, c, o: torch._C._nn.silu(x, out=o),
    "scale": lambda x, c, o: torch.mul(x, c, out=o),
    "shift": lambda x, c, o: torch.add(x, c, out=o),
    "maximum": lambda x, c, o: torch.clamp_min(x, c, out=o),
    "minimum": lambda x, c, o: torch.clamp_max(x, c, out=o),
}
# the maps with a form writing into a given tensor (the input itself: in place)
OUT_MAPS = frozenset(_OUT_MAPS)


def bind_map(name: str, x: torch.Tensor, scalar: float | None,
             out: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """A call writing map ``name`` of this very tensor into ``out`` each time it is made (a
    plan run again over the same buffers), or None (a map with no such function, or ``x``
    of another dtype than ``out``, which :func:`apply_map` would convert).

    >>> x, out = torch.tensor([-1.0, 2.0]), torch.empty(2)
    >>> call = bind_map("relu", x, None, out)
    >>> _ = x.mul_(-1.0); call().tolist()
    [1.0, 0.0]
    """
    fn = _OUT_MAPS.get(name)
    if fn is None or x.dtype != out.dtype or not x.is_floating_point():
        return None
    return lambda: fn(x, scalar, out)


def apply_map(name: str, x: torch.Tensor, scalar: float | None = None) -> torch.Tensor:
    """Apply map ``name`` to a chunk (a new tensor; never in place on the input)."""
    fn, _ = _MAPS[name]
    if name in FLOAT_MAPS and not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    return fn(x, scalar)
