"""Optimizer updates as n-ary elementwise joins: one pass over a chunk of a weight.

Adam's update of one weight reads the gradient, the weight and its two moments and writes the
three new ones. Written as separate elementwise steps it is about a dozen passes over memory;
here it is one join, ``adam`` (or ``adamw``, with decoupled weight decay), whose output
stacks the three new tensors along a leading ``slot`` axis (0: weight, 1: first moment,
2: second moment), so the whole update is one fused kernel per chunk
(``torch._fused_adam_`` where this torch has it, the same formula in torch ops otherwise).

Operands, in order: gradient, weight, exp_avg, exp_avg_sq (all with the weight's labels),
the slot indices (a vector of ``0, 1, 2`` over the output's first label) and six scalars:
lr, beta1, beta2, eps, weight_decay, step. As an einsum over a matrix weight::

    ij,ij,ij,ij,s,,,,,,->sij    join="adam"

Each output element is a function of the operands' elements at its position (the slot index
picks which of the three values), so the join is elementwise and any chunking of the labels
is correct; a chunk holding all three slots computes them in one pass.

>>> g, w = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])
>>> m, v = torch.zeros(2), torch.zeros(2)
>>> scalars = [torch.tensor(x) for x in (0.1, 0.9, 0.999, 1e-8, 0.0, 1.0)]
>>> out = optimizer_update(JoinName.ADAM, [g, w, m, v, torch.arange(3.0), *scalars])
>>> [round(x, 4) for x in out[0].tolist()], [round(x, 4) for x in out[1].tolist()]
([0.4, 0.6], [0.1, -0.2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tensorql_kernels.algebra import UPDATE_JOINS, JoinName

__all__ = ["UPDATE_JOINS", "check_update_labels", "optimizer_update"]
UPDATE_ARITY = 11  # gradient, weight, exp_avg, exp_avg_sq, slots, 6 scalars
SLOTS = 3  # weight, exp_avg, exp_avg_sq

_FUSED = {JoinName.ADAM: getattr(torch, "_fused_adam_", None),
          JoinName.ADAMW: getattr(torch, "_fused_adamw_", None)}
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_update_labels(labels: Sequence[Sequence[str]], out_labels: Sequence[str]) -> str | None:
    """What is wrong with an update join's labels (None when they are right): four operands
    with the weight's labels, the slot vector over the output's first label, six scalars,
    and an output of the slot label followed by the weight's."""
    if len(labels) != UPDATE_ARITY:
        return f"takes {UPDATE_ARITY} operands, got {len(labels)}"
    weight = tuple(labels[1])
    if any(tuple(lab) != weight for lab in labels[:4]):
        return "the gradient, weight and moments must carry the same labels"
    if len(labels[4]) != 1 or tuple(out_labels) != (labels[4][0], *weight):
        return "the output must be the slot label followed by the weight's labels"
    if any(len(lab) for lab in labels[5:]):
        return "the last six operands (lr, beta1, beta2, eps, weight_decay, step) are scalars"
    return None


def optimizer_update(join: str, operands: Sequence[torch.Tensor],
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk of the ``adam`` / ``adamw`` join: the new weight and moments stacked along
    the slot axis (only the slots the chunk's slot operand names), written into ``out``
    when given."""
    g, w, m, v, slots, *scalars = operands
    # on a GPU each float() of a 0-d operand is a host read (six per chunk update; the fake
    # CUDA of the tests counts it as a sync, tests/exec/test_fake_cuda.py::OPTIMIZER_SYNC)
    lr, beta1, beta2, eps, weight_decay, step = (float(s) for s in scalars)
    # the slot operand holds distinct slot indices: all of them when the slot axis is whole
    # (as the optimizer plans it), known without reading the values back from a device
    whole = slots.numel() == SLOTS
    wanted = list(range(SLOTS)) if whole else [int(k) for k in slots.tolist()]
    # the fused kernel wants each of the three contiguous (a row block of a larger result
    # is, even when the stacked block is not)
    direct = out is not None and whole and all(out[k].is_contiguous() for k in range(SLOTS))
    if out is not None and whole and not direct and w.dim() > 0:
        _update_through_scratch(join, g, w, m, v, out, lr=lr, beta1=beta1, beta2=beta2,
                                eps=eps, weight_decay=weight_decay, step=step)
        return out
    packed = out if direct else torch.empty((SLOTS, *w.shape), dtype=w.dtype, device=w.device)
    packed[0].copy_(w)
    packed[1].copy_(m)
    packed[2].copy_(v)
    _update_in_place(join, packed[0], g.contiguous(), packed[1], packed[2], lr=lr,
                     beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    if not whole:
        packed = packed[torch.tensor(wanted, dtype=torch.long, device=packed.device)]
    return packed if out is None or direct else out.copy_(packed)


# Rows of a strided result block updated at a time through a contiguous scratch block:
# about this many elements, so the scratch stays in cache between its copies and the update.
SCRATCH_ELEMS = 1 << 16


def _update_through_scratch(join: str, g: torch.Tensor, w: torch.Tensor, m: torch.Tensor,
                            v: torch.Tensor, out: torch.Tensor, **hyper: float) -> None:
    """The update into ``out`` whose slots are not contiguous (a column block of a larger
    result): block by block of rows, the weight and moments are copied into a contiguous
    scratch block, updated there and copied out, so memory sees each input read once and
    each output written once."""
    rows = w.shape[0]
    step = max(1, SCRATCH_ELEMS // max(1, w[0].numel()))
    scratch = torch.empty((SLOTS, min(step, rows), *w.shape[1:]), dtype=w.dtype,
                          device=w.device)
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        block = scratch[:, :n]
        for k, source in enumerate((w, m, v)):
            block[k].copy_(source.narrow(0, lo, n))
        _update_in_place(join, block[0], g.narrow(0, lo, n).contiguous(), block[1], block[2],
                         **hyper)
        out[:, lo:lo + n].copy_(block)


def _update_in_place(join: str, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
                     v: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: float) -> None:
    """torch.optim.Adam's (AdamW's) update of ``p``, ``m`` and ``v`` in place: torch's fused
    kernel for the device of ``p`` (its step counter lives on that device too, as the CUDA
    kernel requires), the same formula in torch ops where there is none."""
    fused = _FUSED[join]
    if fused is not None and p.dtype in _FUSED_DTYPES and g.dtype == p.dtype:
        steps = [torch.full((), step, dtype=torch.float32, device=p.device)]
        fused([p], [g], [m], [v], [], steps, lr=lr,
              beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
              maximize=False)
        return
    if weight_decay and join == JoinName.ADAMW:
        p.mul_(1.0 - lr * weight_decay)
    elif weight_decay:
        g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))
