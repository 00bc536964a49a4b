"""The query pipeline below both faces: compile an einsum graph, run it, explain it.

One module per job: :mod:`.compile` (the stage chain; CompiledQuery / CompiledGroup),
:mod:`.planning` (the physical plan, partitioned or not), :mod:`.backends` (the registry of
execution backends and what each supports), :mod:`.run` (the one place a plan is handed to
the engine, and the dense results it writes into), :mod:`.distributed` (one rank's part of a
torch.distributed job), :mod:`.stages` (EXPLAIN's stage table).

Python (``tensorql.api``) and SQL (``tensorql.sql``) both hand a graph node to
:meth:`CompiledQuery.compile` and call ``run`` / ``explain`` on the result; neither knows how
the stages are chained. Execution backends sit in a registry (:data:`BACKENDS`): ``native``
(the event-driven runtime on the session's devices) and ``duckdb`` (the plan as one SQL query
inside DuckDB).

>>> import torch, tensorql as tq
>>> db = tq.connect()
>>> a = db.from_torch("a", torch.ones(3, 4), tile=(2, 2))
>>> q = CompiledQuery.compile(tq.einsum("ij->i", a).node, db)
>>> q.run().dense().tolist()
[4.0, 4.0, 4.0]
>>> sorted(BACKENDS)
['duckdb', 'native']
"""
from __future__ import annotations

from tensorql.pipeline.backends import (
    BACKENDS,
    Capabilities,
    DuckDBBackend,
    ExecutionBackend,
    NativeBackend,
    UnknownBackendError,
    get_backend,
    register_backend,
)
from tensorql.pipeline.compile import CompiledGroup, CompiledQuery
from tensorql.pipeline.distributed import job_devices, rank_job, share_rank_results
from tensorql.pipeline.planning import Session, check_task_count, physical_plan
from tensorql.pipeline.run import DenseResults, check_dense_fits, execute
from tensorql.pipeline.stages import STAGES, UnknownStageError

__all__ = [
    "BACKENDS", "STAGES", "CompiledGroup", "CompiledQuery", "DenseResults", "DuckDBBackend",
    "ExecutionBackend", "NativeBackend", "Session", "UnknownBackendError", "UnknownStageError",
    "check_dense_fits", "check_task_count", "get_backend", "job_devices", "physical_plan",
    "register_backend", "rank_job", "share_rank_results", "execute", "Capabilities",
]
