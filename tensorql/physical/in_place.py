"""Outputs computed in place over the constants they replace (a training step's updates).

An optimizer's step reads each weight and its moments (in-memory constants) and computes
their new values; written into fresh buffers, every step copies them there first (the fused
Adam kernel updates in place), which costs more than the update itself. Written into the
constants' own storage instead, each update task must run after every other task that reads
what it overwrites -- a gradient product ``dY @ W.T`` of the layer below may still be reading
``W`` when ``W``'s own gradient, and so its update, is ready.

:func:`order_in_place` makes a plan safe for that: each task of the output waits, besides its
inputs, for every reader of the constants' chunks that is not already its ancestor (and,
through kernels that may hand back a view, for the readers of those views). It leaves an
output as it is where that cannot be made safe: several devices, a reader that depends on the
output, or a task of the output reading any other part of the constants than the chunk it
writes.

>>> import torch
>>> from tensorql.exec.taskgraph import ChunkRef, Task
>>> w = torch.ones(4)
>>> k = AfterReaders(ConstChunk(w, (slice(0, 2),)), arity=0)
>>> k.run([torch.zeros(1)], None).tolist()   # the ordering input is not handed to the kernel
[1.0, 1.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorql.algebra import JoinName
from tensorql.exec.taskgraph import ChunkRef, Task
from tensorql.physical.kernels import (
    ConstChunk,
    ContractChunk,
    ContractSeries,
    FusedPointwise,
    MapChunk,
    SliceChunk,
    SoftmaxChunk,
)
from tensorql.physical.planner import PhysicalPlan, Step


@dataclass(frozen=True, eq=False)
class AfterReaders:
    """``kernel`` run on the first ``arity`` inputs of its task; the task's further inputs
    only order it after the tasks that write them (readers of what it overwrites)."""

    kernel: Any
    arity: int

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.run(inputs[:self.arity], acc)

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return self.kernel.combine(acc, partial)

    def bind(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> Any:
        """The kernel's bound calls on its own inputs (:mod:`tensorql.exec.tape`), or None."""
        bind = getattr(self.kernel, "bind", None)
        return None if bind is None else bind(inputs[:self.arity], out)

    def __getattr__(self, name: str) -> Any:
        if name == "run_into":  # only when the kernel has one (the executor asks hasattr)
            run_into = self.kernel.run_into

            def ordered_run_into(inputs: Sequence[torch.Tensor],
                                 out: torch.Tensor) -> torch.Tensor:
                return run_into(inputs[:self.arity], out)
            return ordered_run_into
        if name in ("kernel", "arity"):
            raise AttributeError(name)
        return getattr(self.kernel, name)


def order_in_place(plan: PhysicalPlan, outputs: dict[int, Sequence[torch.Tensor]]
                   ) -> tuple[PhysicalPlan, frozenset[int]]:
    """``plan`` with output ``k``'s tasks ordered after every reader of ``outputs[k]``'s
    constants, so output ``k`` may be computed into the storage those constants view, and
    the outputs for which that was safe (see the module's docstring); the others keep their
    tasks."""
    if plan.devices != 1 or not outputs:
        return plan, frozenset()
    tasks = [task for step in plan.steps for task in step.tasks]
    readers: dict[ChunkRef, list[Task]] = {}
    writers: dict[ChunkRef, list[Task]] = {}
    for task in tasks:
        writers.setdefault(task.output, []).append(task)
        for ref in set(task.inputs):
            readers.setdefault(ref, []).append(task)
    replaced: dict[int, Step] = {}
    done = set()
    for k, constants in outputs.items():
        step = plan.output_steps[k]
        ordered = _ordered_step(step, constants, tasks, readers, writers)
        if ordered is not None:
            replaced[step.id] = ordered
            done.add(k)
    if not replaced:
        return plan, frozenset()
    steps = tuple(replaced.get(step.id, step) for step in plan.steps)
    return dataclasses.replace(plan, steps=steps), frozenset(done)


def _ordered_step(step: Step, constants: Sequence[torch.Tensor], tasks: list[Task],
                  readers: dict[ChunkRef, list[Task]], writers: dict[ChunkRef, list[Task]]
                  ) -> Step | None:
    own = {task.id for task in step.tasks}
    sources = {task.output: task.kernel for task in tasks
               if isinstance(task.kernel, ConstChunk)
               and any(task.kernel.value is c for c in constants)}
    # every reader of the constants' memory, through kernels that may return a view
    hazards: dict[int, Task] = {}
    frontier = list(sources)
    seen = set(frontier)
    while frontier:
        ref = frontier.pop()
        for reader in readers.get(ref, ()):
            if reader.id in own:
                if ref not in sources or not _reads_its_own_chunk(step, reader, sources[ref]):
                    return None  # it would read what another task of the output overwrites
                continue
            hazards[reader.id] = reader
            if not _fresh(reader.kernel) and reader.output not in seen:
                seen.add(reader.output)
                frontier.append(reader.output)
    if not hazards:
        return step
    descendants = _closure((task for task in step.tasks), lambda t: (
        r for ref in (t.output,) for r in readers.get(ref, ())))
    if any(h in descendants for h in hazards):
        return None  # a reader waits for the output: no order lets it read first
    hazard_list = list(hazards.values())
    bit = {h.id: 1 << i for i, h in enumerate(hazard_list)}
    every = (1 << len(hazard_list)) - 1
    masks: dict[int, int] = {}  # task id -> the hazards among its ancestors, as bits
    new_tasks = []
    for task in step.tasks:
        behind = _hazards_behind(task, writers, bit, every, masks)
        after = sorted({h.output for h in hazard_list if not behind & bit[h.id]},
                       key=lambda ref: (ref.step, ref.key))
        extra = tuple(ref for ref in after if ref not in task.inputs)
        if not extra:
            new_tasks.append(task)
            continue
        new_tasks.append(dataclasses.replace(task, inputs=task.inputs + extra,
                                             kernel=AfterReaders(task.kernel,
                                                                 len(task.inputs))))
    return dataclasses.replace(step, tasks=tuple(new_tasks))


def _reads_its_own_chunk(step: Step, task: Task, kernel: ConstChunk) -> bool:
    """Whether the slice of a constant ``task`` reads is the region its output chunk is
    (its trailing dims: an update stacks its slots along a leading one)."""
    region = step.relation.grid.slices(task.output.key)
    shape = tuple(kernel.value.shape)
    if len(shape) > len(region):
        return False
    trailing = region[len(region) - len(shape):]
    read = kernel.slices if kernel.slices is not None else tuple(slice(0, n) for n in shape)
    return tuple((s.start or 0, s.stop) for s in read) == tuple(
        (s.start or 0, s.stop) for s in trailing)


# joins that compute a new tensor from two or more operands (an update join writes its own)
_NEW_TENSOR_JOINS = frozenset({
    JoinName.MUL, JoinName.ADD, JoinName.SUB, JoinName.DIV, JoinName.MAX, JoinName.MIN,
    JoinName.POW, JoinName.LT, JoinName.LE, JoinName.GT, JoinName.GE, JoinName.EQ,
    JoinName.NE, JoinName.WHERE, JoinName.FLOORDIV, JoinName.MOD})


def _fresh(kernel: Any) -> bool:
    """Whether ``kernel`` always returns new memory: a built-in join of two or more operands
    (a product, a sum, a comparison), a map, a softmax, a cut slice, a fused chain ending in
    one of those. Any other kernel (a reshape, a rekey handing its input back whole, a
    user's join, a one-operand einsum that may permute) may return a view of an input."""
    if isinstance(kernel, ContractSeries):
        kernel = kernel.kernel
    if isinstance(kernel, ContractChunk):
        return len(kernel.in_labels) >= 2 and kernel.join in _NEW_TENSOR_JOINS
    if isinstance(kernel, FusedPointwise):
        return _fresh(kernel.ops[-1].kernel)
    return isinstance(kernel, (MapChunk, SoftmaxChunk, SliceChunk))


def _hazards_behind(task: Task, writers: dict[ChunkRef, list[Task]], bit: dict[int, int],
                    every: int, masks: dict[int, int]) -> int:
    """The hazards (as ``bit`` flags) among ``task``'s ancestors, memoised in ``masks`` so the
    tasks of one output share one walk of the graph (a walk per task was quadratic).

    >>> from types import SimpleNamespace as T
    >>> a, b = T(id=1, inputs=(), output="a"), T(id=2, inputs=("a",), output="b")
    >>> c = T(id=3, inputs=("b",), output="c")
    >>> writers = {"a": [a], "b": [b], "c": [c]}
    >>> _hazards_behind(c, writers, {1: 1, 2: 2}, 3, {}), _hazards_behind(a, writers, {1: 1}, 1, {})
    (3, 0)
    """
    if task.id in masks:
        return masks[task.id]
    stack: list[tuple[Task, bool]] = [(task, False)]
    while stack:
        node, expanded = stack.pop()
        if node.id in masks:
            continue
        parents = [w for ref in node.inputs for w in writers.get(ref, ())]
        if not expanded:
            stack.append((node, True))
            stack.extend((p, False) for p in parents if p.id not in masks)
            continue
        mask = 0
        for parent in parents:
            mask |= masks.get(parent.id, 0) | bit.get(parent.id, 0)
            if mask == every:
                break
        masks[node.id] = mask
    return masks[task.id]


def _closure(start: Iterable[Task], step: Any) -> set[int]:
    """Ids of the tasks reachable from ``start`` (themselves excluded) along ``step``."""
    out: set[int] = set()
    stack = list(start)
    while stack:
        for nxt in step(stack.pop()):
            if nxt.id not in out:
                out.add(nxt.id)
                stack.append(nxt)
    return out
