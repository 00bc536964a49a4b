"""tensorql: a relational query engine over tensor blocks.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> A = db.from_numpy("A", np.ones((4, 3), dtype=np.float32), tile=(2, 2))
>>> tq.einsum("ij->j", A).numpy().tolist()
[4.0, 4.0, 4.0]
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING

from tensorql.errors import (
    DLPackError,
    DTypeError,
    ExecutionError,
    MemoryLimitError,
    OptionError,
    ParseError,
    PlanError,
    ProgressCallbackError,
    ShapeError,
    StaleTensorError,
    StorageError,
    TensorQLError,
    UnknownTensorError,
    UnsupportedError,
)
from tensorql.exec.host_malloc import tune_malloc

# now, before any thread (DuckDB's, torch's, the executor's) makes a malloc arena of its own
# (see tensorql.exec.host_malloc; TENSORQL_MALLOC_TUNING=0 leaves the allocator alone)
tune_malloc()

# planning and spilling decisions are logged to "tensorql" (and its children, one per module);
# silent unless the application configures logging (logging.basicConfig(level="INFO"))
logging.getLogger(__name__).addHandler(logging.NullHandler())

# The rest of the public names load on first use (PEP 562): ``import tensorql`` does not
# import torch or DuckDB, so ``tensorql --version`` and ``--help`` start in well under 0.5 s.
_LAZY = {
    "AggFunctionError": "tensorql.algebra", "JoinFunctionError": "tensorql.algebra",
    "register_agg": "tensorql.algebra", "register_join": "tensorql.algebra",
    "optim": "tensorql.api.optim", "GradientError": "tensorql.api.autodiff",
    "grad": "tensorql.api.autodiff", "Database": "tensorql.api.database",
    "connect": "tensorql.api.database", "from_dlpack": "tensorql.api.interchange",
    "Tensor": "tensorql.api.tensor",
    "substitute": "tensorql.api.tensor", "where": "tensorql.api.tensor",
    "AGGS": "tensorql.einsum.spec", "JOINS": "tensorql.einsum.spec",
    "EinsumSpec": "tensorql.einsum.spec", "UnknownOperatorError": "tensorql.einsum.spec",
    "Cost": "tensorql.optimizer", "PartitionPlan": "tensorql.optimizer",
    "optimize": "tensorql.optimizer", "Options": "tensorql.options",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from tensorql.algebra import (
        AggFunctionError,
        JoinFunctionError,
        register_agg,
        register_join,
    )
    from tensorql.api import optim
    from tensorql.api.autodiff import GradientError, grad
    from tensorql.api.database import Database, connect
    from tensorql.api.einsum import einsum
    from tensorql.api.interchange import from_dlpack
    from tensorql.api.tensor import Tensor, substitute, where
    from tensorql.einsum.spec import AGGS, JOINS, EinsumSpec, UnknownOperatorError
    from tensorql.optimizer import Cost, PartitionPlan, optimize
    from tensorql.options import Options


def __getattr__(name: str):
    """A public name (or a subpackage, ``tensorql.sql``) imported when first asked for."""
    module = _LAZY.get(name)
    if module is not None:
        imported = importlib.import_module(module)
        value = imported if module.endswith(f".{name}") else getattr(imported, name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'tensorql' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"einsum"})


class _Package(types.ModuleType):
    """The ``tensorql`` module's class: ``tensorql.einsum`` is the function although a
    subpackage has that name (importing ``tensorql.einsum.spec`` binds the subpackage to the
    name, which eager imports used to overwrite again)."""

    @property
    def einsum(self):
        return importlib.import_module("tensorql.api.einsum").einsum

    @einsum.setter
    def einsum(self, value) -> None:  # the import system binding the subpackage: keep the
        pass  # function (the subpackage stays in sys.modules["tensorql.einsum"])


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "AGGS", "JOINS", "Cost", "Database", "EinsumSpec", "ExecutionError", "MemoryLimitError",
    "OptionError",
    "Options", "ParseError", "PartitionPlan", "PlanError", "ProgressCallbackError", "ShapeError",
    "StaleTensorError",
    "StorageError",
    "Tensor", "TensorQLError",
    "UnknownOperatorError", "UnknownTensorError", "UnsupportedError", "DTypeError", "DLPackError",
    "connect",
    "einsum", "optimize", "where", "grad", "GradientError", "optim", "substitute",
    "register_join", "register_agg", "JoinFunctionError", "AggFunctionError", "from_dlpack",
]
