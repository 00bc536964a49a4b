"""tensorql.optimizer: the partition stage -- partition vectors, placement and the cost model.

The contraction order is not chosen here: it is the logical plan's (``tensorql.logical.path``),
and the optimizer partitions the operations of that plan.

>>> from tensorql.optimizer import STRATEGIES
>>> sorted(STRATEGIES)
['auto', 'data', 'exhaustive', 'model']
"""

from tensorql.optimizer.cost import Cost
from tensorql.optimizer.plan import (
    OpPartition,
    PartitionPlan,
    explain_partitioning,
    optimize,
)
from tensorql.optimizer.search import (
    STRATEGIES,
    InfeasiblePlanError,
    SearchTooLargeError,
    UnknownStrategyError,
)

__all__ = [
    "STRATEGIES", "Cost", "InfeasiblePlanError", "OpPartition", "PartitionPlan",
    "SearchTooLargeError", "UnknownStrategyError", "explain_partitioning", "optimize",
]
