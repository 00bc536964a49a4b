"""Checks a plan passes before it runs: not too many tiny tasks, a dense result that fits."""

from __future__ import annotations

import math
from typing import Any

from tensorql.dtypes import itemsize
from tensorql.errors import MemoryLimitError, PlanError
from tensorql.logical.plan import LogicalNode
from tensorql.options import Options, available_memory_bytes
from tensorql.units import format_bytes

MANY_TASKS = 100_000  # beyond this many chunk tasks, per-task overhead (~100 µs) is seconds
TINY_TASK_ELEMS = 1 << 16  # ... and is what the run spends when tasks are this small


def check_task_count(logical: LogicalNode) -> None:
    """PlanError when tiles are so small that per-task overhead swamps the work: more than
    ``MANY_TASKS`` chunk tasks doing fewer than ``TINY_TASK_ELEMS`` element operations each
    (a 300x300 matmul with 1x1 tiles is 27 million tasks, minutes for 54 MFLOP).

    >>> import numpy as np, tensorql as tq
    >>> from tensorql.logical.lower import lower
    >>> db = tq.connect()
    >>> a = db.from_numpy("a", np.ones((300, 300), np.float32), tile=(1, 1))
    >>> check_task_count(lower((a @ a).node))
    Traceback (most recent call last):
    ...
    tensorql.errors.PlanError: this plan has 27,180,000 chunk tasks of ~1 element operations ...
    """
    from tensorql.logical.plan import walk

    tasks = work = 0
    smallest: tuple[int, ...] = ()
    for node in walk(logical):
        grid = node.relation.grid
        tasks += grid.num_chunks
        work += math.prod(grid.shape)
        if not smallest or math.prod(grid.tile) < math.prod(smallest):
            smallest = grid.tile
    if tasks > MANY_TASKS and work < tasks * TINY_TASK_ELEMS:
        raise PlanError(
            f"this plan has {tasks:,} chunk tasks of ~{work // tasks:,} element operations "
            f"each (tiles as small as {smallest}); at ~100 µs of overhead per task it would "
            f"spend ~{tasks * 1e-4:,.0f} s on overhead alone. Store the operands with larger "
            "tiles (tile=None picks them automatically) or rechunk them with db.store")


SMALL_RESULT_BYTES = 16 << 20  # below this a result is checked against the process figure only


PYTHON_ADVICE = ("store it with db.store(name, expr) and read it chunk by chunk "
                 "(db.iter_chunks), or compute a slice of it")


def check_dense_fits(relation: Any, options: Options, advice: str = PYTHON_ADVICE) -> None:
    """MemoryLimitError, before any allocation, when a dense result of ``relation`` (shape and
    dtype) is larger than :meth:`Options.dense_result_budget`; the error ends with
    ``advice`` (what to do instead, in the caller's terms: Python's by default, SQL's from
    the SQL face).

    >>> from tensorql.grid import ChunkGrid
    >>> from tensorql.logical.plan import TensorRelation
    >>> big = TensorRelation(("i", "j"), ChunkGrid((2**20, 2**20), (4096, 4096)), "float32")
    >>> check_dense_fits(big, Options())
    Traceback (most recent call last):
    ...
    tensorql.errors.MemoryLimitError: the result is 4.0 TiB (1048576x1048576 float32) ...
    """
    nbytes = math.prod(relation.shape) * itemsize(relation.dtype)
    if nbytes <= SMALL_RESULT_BYTES and nbytes <= options.dense_result_budget(system=False):
        return  # a small result: not worth reading /proc/meminfo on every run of a query
    budget = options.dense_result_budget()
    if nbytes > budget:
        shape = "x".join(map(str, relation.shape))
        raise MemoryLimitError(
            f"the result is {format_bytes(nbytes)} ({shape} {relation.dtype}) but this process "
            f"may hold {format_bytes(budget)} more (Options.process_memory_limit "
            f"{format_bytes(options.process_memory_bytes)}, less the chunk cache, DuckDB's "
            f"memory and device budgets; {format_bytes(available_memory_bytes())} available "
            f"on the system); {advice}")
