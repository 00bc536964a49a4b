"""tensorql.optimizer: contraction order, partition vectors and the cost model.

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
