"""The task graph the executor runs: chunk tasks linked by the chunks they read and write.

A ``Task`` reads the chunks named by ``inputs`` and contributes to the chunk ``output``. Several
tasks may contribute to one chunk (partial aggregates): the chunk is complete when all have
run. The executor knows nothing of einsum; a task's ``kernel`` is any object with

* ``run(inputs: list[Tensor], acc: Tensor | None) -> Tensor`` -- compute, folding into ``acc``
  in place when given (the returned tensor must not alias an input), and
* ``combine(acc: Tensor, partial: Tensor) -> Tensor`` -- fold a partial into ``acc``.

>>> ref = ChunkRef(step=0, key=(1, 2))
>>> ref
ChunkRef(step=0, key=(1, 2))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensorql.errors import ExecutionError


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of one plan step's output."""

    step: int
    key: tuple[int, ...]


# Elementwise kernels (``memory_bound`` set) do about 100x less work per "FLOP" counted (an
# element and op) than products do.
MEMORY_BOUND_FACTOR = 100


@dataclass(frozen=True)
class Task:
    """Run ``kernel`` on ``inputs`` and contribute the result to ``output``.

    Lower ``priority`` runs first among ready tasks. ``flops`` is an optional cost estimate the
    event-driven runtime uses for critical-path priorities (0: unknown, inputs' bytes are used).
    ``device`` optionally pins the task to one device index of the runtime (None: placed by the
    runtime's lowering).
    """

    id: int
    inputs: tuple[ChunkRef, ...]
    output: ChunkRef
    kernel: Any
    priority: float = 0.0
    flops: int = 0
    device: int | None = None

    @property
    def is_source(self) -> bool:
        """True for a task without inputs: it reads data at rest (a store or a constant)."""
        return not self.inputs

    @property
    def weighted_flops(self) -> int:
        """``flops`` in product-FLOP equivalents: an elementwise kernel's (``memory_bound``
        set: its FLOPs count elements) scaled by ``MEMORY_BOUND_FACTOR``.

        >>> Task(0, (), ChunkRef(0, ()), None, flops=10).weighted_flops
        10
        """
        factor = MEMORY_BOUND_FACTOR if getattr(self.kernel, "memory_bound", False) else 1
        return self.flops * factor


@dataclass(frozen=True)
class Dependencies:
    """A task graph's dependency structure (see :meth:`TaskGraph.dependencies`); the
    dicts are shared: a run copies what it counts down."""

    contributions: dict[ChunkRef, int]  # how many tasks write each chunk
    readers: dict[ChunkRef, tuple[Task, ...]]  # the tasks reading each chunk, once each
    pending: dict[int, int]  # by task id: how many distinct chunks it reads
    sources: tuple[Task, ...]  # the tasks reading nothing


@dataclass(frozen=True)
class TaskGraph:
    """All tasks of a plan; chunks of ``retain`` steps are returned, others freed when used.

    ``chunk_bytes`` gives the size of every chunk when the planner knows it (the memory plan of
    the event-driven runtime needs it; the threaded executor does not).

    >>> a, b = ChunkRef(0, ()), ChunkRef(1, ())
    >>> g = TaskGraph(tasks=(Task(0, (), a, None), Task(1, (a, a), b, None)),
    ...               retain=frozenset({1}), chunk_bytes={a: 64, b: 64})
    >>> g.contributions()[b], [t.id for t in g.readers()[a]]
    (1, [1])
    """

    tasks: tuple[Task, ...]
    retain: frozenset[int] = field(default_factory=frozenset)
    step_names: dict[int, str] = field(default_factory=dict, compare=False)
    chunk_bytes: dict[ChunkRef, int] = field(default_factory=dict, compare=False)
    # shape and dtype of every chunk when known (a receiver of a chunk sent between
    # processes allocates its buffer from it)
    chunk_meta: dict[ChunkRef, tuple[tuple[int, ...], str]] = field(default_factory=dict,
                                                                     compare=False)
    # memory plans made for this graph, by (devices, budgets, prefetch, results on device):
    # a query run again skips planning (see :meth:`Runtime.plan`)
    programs: dict[tuple, Any] = field(default_factory=dict, init=False, compare=False,
                                       repr=False)

    def contributions(self) -> dict[ChunkRef, int]:
        """How many tasks write each chunk."""
        counts: dict[ChunkRef, int] = {}
        for task in self.tasks:
            counts[task.output] = counts.get(task.output, 0) + 1
        return counts

    def dependencies(self) -> Dependencies:
        """Who writes and reads each chunk, and what each task waits for (made once per
        graph); ExecutionError when a task reads a chunk no task writes.

        >>> a, b = ChunkRef(0, ()), ChunkRef(1, ())
        >>> deps = TaskGraph(tasks=(Task(0, (), a, None), Task(1, (a, a), b, None))).dependencies()
        >>> deps.pending, [t.id for t in deps.sources]
        ({0: 0, 1: 1}, [0])
        """
        cached = self.programs.get("dependencies")
        if cached is not None:
            return cached
        contributions = self.contributions()
        readers: dict[ChunkRef, list[Task]] = {}
        pending: dict[int, int] = {}
        sources = []
        for task in self.tasks:
            distinct = dict.fromkeys(task.inputs)
            for ref in distinct:
                if ref not in contributions:
                    raise ExecutionError(f"task {task.id} reads chunk {ref} that no task writes")
                readers.setdefault(ref, []).append(task)
            pending[task.id] = len(distinct)
            if not distinct:
                sources.append(task)
        deps = Dependencies(contributions, {ref: tuple(ts) for ref, ts in readers.items()},
                            pending, tuple(sources))
        self.programs["dependencies"] = deps
        return deps

    def readers(self) -> dict[ChunkRef, list[Task]]:
        """The tasks reading each chunk (a task reading a chunk twice is listed once)."""
        out: dict[ChunkRef, list[Task]] = {}
        for task in self.tasks:
            for ref in dict.fromkeys(task.inputs):
                out.setdefault(ref, []).append(task)
        return out

    def step_name(self, step: int) -> str:
        return self.step_names.get(step, f"step {step}")
