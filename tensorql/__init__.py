"""tensorql: a relational query engine over tensor blocks.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> A = db.from_numpy("A", np.ones((4, 3), dtype=np.float32), tile=(2, 2))
>>> tq.einsum("ij->j", A).numpy().tolist()
[4.0, 4.0, 4.0]
"""

from tensorql.algebra import AggFunctionError, JoinFunctionError, register_agg, register_join
from tensorql.api import optim
from tensorql.api.autodiff import GradientError, grad
from tensorql.api.database import Database, connect
from tensorql.api.einsum import einsum
from tensorql.api.interchange import from_dlpack
from tensorql.api.tensor import Tensor, substitute, where
from tensorql.einsum.spec import AGGS, JOINS, EinsumSpec, UnknownOperatorError
from tensorql.errors import (
    DTypeError,
    ExecutionError,
    MemoryLimitError,
    OptionError,
    ParseError,
    PlanError,
    ShapeError,
    StaleTensorError,
    StorageError,
    TensorQLError,
    UnknownTensorError,
    UnsupportedError,
)
from tensorql.exec.host_malloc import tune_malloc
from tensorql.optimizer import Cost, PartitionPlan, optimize
from tensorql.options import Options

# now, before any thread (DuckDB's, torch's, the executor's) makes a malloc arena of its own
# (see tensorql.exec.host_malloc; TENSORQL_MALLOC_TUNING=0 leaves the allocator alone)
tune_malloc()

__version__ = "0.1.0"

__all__ = [
    "AGGS", "JOINS", "Cost", "Database", "EinsumSpec", "ExecutionError", "MemoryLimitError",
    "OptionError",
    "Options", "ParseError", "PartitionPlan", "PlanError", "ShapeError", "StaleTensorError",
    "StorageError",
    "Tensor", "TensorQLError",
    "UnknownOperatorError", "UnknownTensorError", "UnsupportedError", "DTypeError", "connect",
    "einsum", "optimize", "where", "grad", "GradientError", "optim", "substitute",
    "register_join", "register_agg", "JoinFunctionError", "AggFunctionError", "from_dlpack",
]
