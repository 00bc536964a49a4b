"""tensorql: a relational query engine over tensor blocks."""

from tensorql.errors import (
    ExecutionError,
    OptionError,
    ParseError,
    PlanError,
    ShapeError,
    StorageError,
    TensorQLError,
    UnknownTensorError,
)
from tensorql.options import Options

__version__ = "0.1.0"

__all__ = [
    "ExecutionError", "OptionError", "Options", "ParseError", "PlanError", "ShapeError",
    "StorageError", "TensorQLError", "UnknownTensorError",
]
