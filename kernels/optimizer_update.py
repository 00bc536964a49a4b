"""Optimizer updates as n-ary elementwise joins: one pass over a chunk of a weight.

Adam's update of one weight reads the gradient, the weight and its two moments and writes the
three new ones. Written as separate elementwise steps it is about a dozen passes over memory;
here it is one join, ``adam`` (or ``adamw``, with decoupled weight decay), whose output
stacks the three new tensors along a leading ``slot`` axis (0: weight, 1: first moment,
2: second moment), so the whole update is one fused kernel per chunk
(``torch._fused_adam_`` where this torch has it, the same formula in torch ops otherwise).

Operands, in order: gradient, weight, exp_avg, exp_avg_sq (all with the weight's labels),
the slot indices (a vector of ``0, 1, 2`` over the output's first label) and the scalars:
lr and step, and between them beta1, beta2, eps and weight_decay unless the join carries
them itself. The joins ``adam`` / ``adamw`` read all six from operands; the optimizers use
a join that carries the four fixed for their life (``update_join``: its name spells them,
e.g. ``adam(beta1=0.9,beta2=0.999,eps=1e-08,weight_decay=0.0)``), so that lr and step are
its only scalar operands -- and on a GPU the fused kernel reads both on the device: an
update reads nothing back on the host. As einsums over a matrix weight::

    ij,ij,ij,ij,s,,,,,,->sij    join="adam"
    ij,ij,ij,ij,s,,->sij        join=update_join(False, 0.9, 0.999, 1e-8, 0.0)

Each output element is a function of the operands' elements at its position (the slot index
picks which of the three values), so the join is elementwise and any chunking of the labels
is correct; a chunk holding all three slots computes them in one pass.

>>> g, w = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])
>>> m, v = torch.zeros(2), torch.zeros(2)
>>> scalars = [torch.tensor(x, dtype=torch.float64) for x in (0.1, 0.9, 0.999, 1e-8, 0.0, 1.0)]
>>> out = optimizer_update(JoinName.ADAM, [g, w, m, v, torch.arange(3.0), *scalars])
>>> [round(x, 4) for x in out[0].tolist()], [round(x, 4) for x in out[1].tolist()]
([0.4, 0.6], [0.1, -0.2])
>>> carried = update_join(False, 0.9, 0.999, 1e-8, 0.0)
>>> same = optimizer_update(carried, [g, w, m, v, torch.arange(3.0), *scalars[::5]])
>>> torch.equal(same, out)
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensorql_kernels.algebra import UPDATE_JOINS, JoinName, UpdateRule, join_of, update_join

__all__ = ["UPDATE_JOINS", "check_update_labels", "optimizer_update", "update_join"]
TENSOR_OPERANDS = 5  # gradient, weight, exp_avg, exp_avg_sq, slots; then the scalars
SLOTS = 3  # weight, exp_avg, exp_avg_sq

# by the update's kind (UpdateRule.kind)
_FUSED = {JoinName.ADAM: getattr(torch, "_fused_adam_", None),
          JoinName.ADAMW: getattr(torch, "_fused_adamw_", None)}
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_update_labels(labels: Sequence[Sequence[str]], out_labels: Sequence[str],
                        rule: UpdateRule | None = None) -> str | None:
    """What is wrong with the labels of an update join of ``rule`` (default: ``adam``'s;
    None when they are right): four operands with the weight's labels, the slot vector over
    the output's first label, the rule's scalars, and an output of the slot label followed
    by the weight's."""
    scalars = (rule or UpdateRule(decoupled=False)).scalars
    arity = TENSOR_OPERANDS + len(scalars)
    if len(labels) != arity:
        return f"takes {arity} operands, got {len(labels)}"
    weight = tuple(labels[1])
    if any(tuple(lab) != weight for lab in labels[:4]):
        return "the gradient, weight and moments must carry the same labels"
    if len(labels[4]) != 1 or tuple(out_labels) != (labels[4][0], *weight):
        return "the output must be the slot label followed by the weight's labels"
    if any(len(lab) for lab in labels[TENSOR_OPERANDS:]):
        return f"the last {len(scalars)} operands ({', '.join(scalars)}) are scalars"
    return None


def optimizer_update(join: str, operands: Sequence[torch.Tensor],
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk of an update join (``adam``, ``adamw`` or one of :func:`update_join`): the
    new weight and moments stacked along the slot axis (only the slots the chunk's slot
    operand names), written into ``out`` when given.

    No value of an operand on a device is read back on the host: lr and step go to the
    fused kernel as device tensors, the slot operand selects slots on the device. (The
    general joins' beta1, beta2, eps and weight_decay are read on the host, as the fused
    kernel takes them: operands on a device cost a read each; the optimizers use joins
    carrying them.)"""
    rule = join_of(join).rule
    g, w, m, v, slots, *scalars = operands
    if rule.hyper is not None:
        hyper = rule.hyper
    else:
        hyper = tuple(float(s) for s in scalars[1:5])  # type: ignore[assignment]
    lr, step = _scalar(scalars[0]), _scalar(scalars[-1])
    update = _AdamStep(rule.decoupled, *hyper, lr=lr, step=step)
    # the slot operand holds distinct slot indices: all of them when the slot axis is whole
    # (as the optimizer plans it), known without reading the values
    whole = slots.numel() == SLOTS
    # the fused kernel wants each of the three contiguous (a row block of a larger result
    # is, even when the stacked block is not)
    direct = out is not None and whole and all(out[k].is_contiguous() for k in range(SLOTS))
    if out is not None and whole and all(map(_same_memory, out, (w, m, v))):
        _update_in_place(update, g, out)  # ``out`` is the weight and moments themselves
        return out
    if out is not None and whole and not direct and w.dim() > 0:
        _update_through_scratch(update, g, w, m, v, out)
        return out
    packed = out if direct else torch.empty((SLOTS, *w.shape), dtype=w.dtype, device=w.device)
    packed[0].copy_(w)
    packed[1].copy_(m)
    packed[2].copy_(v)
    update.apply(packed[0], g.contiguous(), packed[1], packed[2])
    if not whole:  # the chunk's slots, picked on the device
        packed = packed.index_select(0, slots.to(device=packed.device, dtype=torch.long))
    return packed if out is None or direct else out.copy_(packed)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same storage (one view twice).

    >>> x = torch.zeros(2, 3)
    >>> _same_memory(x[:, 1:], x[:, 1:]), _same_memory(x[:, 1:], x[:, :2])
    (True, False)
    """
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() \
        and a.device == b.device


def _update_in_place(update: _AdamStep, g: torch.Tensor, out: torch.Tensor) -> None:
    """The update of ``out``'s weight and moments where they are (the plan made this chunk's
    update the last reader of them): one fused call; a 2-D column block of a larger weight,
    whose rows are contiguous but not the block, as its rows."""
    p, m, v = out[0], out[1], out[2]
    if all(x.is_contiguous() for x in (p, m, v)):
        update.apply(p, g.contiguous(), m, v)
        return
    if p.dim() == 2 and all(x.stride(1) == 1 for x in (p, m, v)):
        g = g.contiguous()
        update.apply_many(p.unbind(0), g.unbind(0), m.unbind(0), v.unbind(0))
        return
    scratch = torch.empty((SLOTS, *p.shape), dtype=p.dtype, device=p.device)
    scratch.copy_(out)
    update.apply(scratch[0], g.contiguous(), scratch[1], scratch[2])
    out.copy_(scratch)


def _scalar(x: torch.Tensor) -> float | torch.Tensor:
    """A 0-d operand as the update reads it: a host tensor's value (reading host memory
    costs nothing), a device tensor as it is (read by the kernel, on the device)."""
    return float(x) if x.device.type == "cpu" else x


# Rows of a strided result block updated at a time through a contiguous scratch block:
# about this many elements, so the scratch stays in cache between its copies and the update.
SCRATCH_ELEMS = 1 << 16


def _update_through_scratch(update: _AdamStep, g: torch.Tensor, w: torch.Tensor,
                            m: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
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
        update.apply(block[0], g.narrow(0, lo, n).contiguous(), block[1], block[2])
        out[:, lo:lo + n].copy_(block)


@dataclass(frozen=True, eq=False)
class _AdamStep:
    """torch.optim.Adam's (AdamW's, ``decoupled``) update with these hyperparameters; lr
    and step are numbers or 0-d tensors on the weight's device."""

    decoupled: bool
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    lr: float | torch.Tensor
    step: float | torch.Tensor

    def apply(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
              v: torch.Tensor) -> None:
        """``p``, ``m`` and ``v`` updated in place: torch's fused kernel for the device of
        ``p`` (lr a float32 tensor on that device or a number; the step counter a float32
        tensor on that device, as the CUDA kernel reads them), the same formula in torch
        ops where there is none."""
        self.apply_many([p], [g], [m], [v])

    def apply_many(self, ps: Sequence[torch.Tensor], gs: Sequence[torch.Tensor],
                   ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> None:
        """:meth:`apply` to each ``(p, g, m, v)`` of the lists (contiguous tensors of one
        device and dtype), in one fused call where there is one."""
        p0, g0 = ps[0], gs[0]
        fused = _FUSED[JoinName.ADAMW if self.decoupled else JoinName.ADAM]
        if fused is not None and p0.dtype in _FUSED_DTYPES and g0.dtype == p0.dtype:
            lr, step = self.lr, self.step
            if isinstance(lr, torch.Tensor):
                lr = lr.to(device=p0.device, dtype=torch.float32)
            counter = step.to(device=p0.device, dtype=torch.float32) \
                if isinstance(step, torch.Tensor) \
                else torch.full((), step, dtype=torch.float32, device=p0.device)
            fused(list(ps), list(gs), list(ms), list(vs), [], [counter] * len(ps), lr=lr,
                  beta1=self.beta1, beta2=self.beta2, weight_decay=self.weight_decay,
                  eps=self.eps, amsgrad=False, maximize=False)
            return
        for p, g, m, v in zip(ps, gs, ms, vs):
            self._in_torch_ops(p, g, m, v)

    def _in_torch_ops(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
                      v: torch.Tensor) -> None:
        """The fused kernel's formula in torch ops: with numbers as torch.optim's
        single-tensor Adam computes it, with tensors (lr, step on a device) in 0-d tensor
        ops on that device."""
        lr, step, wd = self.lr, self.step, self.weight_decay
        # 0-d tensors: the factors in the update's own precision (at least float32: in
        # bfloat16, beta2 = 0.999 rounds to 1 and the bias correction to 0)
        opmath = torch.promote_types(p.dtype, torch.float32)
        if isinstance(lr, torch.Tensor):
            lr = lr.to(device=p.device, dtype=opmath)
        if isinstance(step, torch.Tensor):
            step = step.to(device=p.device, dtype=opmath)
        if wd and self.decoupled:
            p.mul_(1.0 - lr * wd)
        elif wd:
            g = g.add(p, alpha=wd)
        m.lerp_(g, 1.0 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        correction1 = 1.0 - self.beta1 ** step
        correction2 = 1.0 - self.beta2 ** step
        if isinstance(correction1, torch.Tensor) or isinstance(lr, torch.Tensor):
            denom = (v.sqrt() / correction2 ** 0.5).add_(self.eps)
            p.addcdiv_(m, denom.mul_(correction1 / -lr))
            return
        denom = (v.sqrt() / math.sqrt(correction2)).add_(self.eps)
        p.addcdiv_(m, denom, value=-lr / correction1)
