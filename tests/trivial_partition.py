"""What the partitioned path of the one builder makes of the *trivial partition* (one device,
every label whole, one piece per operation cut into the logical plan's tiles), set beside
today's one-device plan, step by step: the record of how far the two paths are from being
one (issue 28, build item 1). Run it to see the differences:

    PYTHONPATH=. python tests/trivial_partition.py [plan names of test_one_device_plans]
"""

from __future__ import annotations

import sys

import tensorql as tq
from tensorql.optimizer.cost import Cost
from tensorql.optimizer.graph import OpGraph
from tensorql.optimizer.plan import OpPartition, PartitionPlan
from tensorql.physical.builder import build


def trivial_partition(physical) -> PartitionPlan:
    """The one-device partition plan of ``physical``'s logical plan: one piece everywhere."""
    graph = OpGraph.build(physical.root, also=physical.also)
    ops = tuple(OpPartition(index=n.index, name=n.name, kind=n.kind, labels=n.labels,
                            sizes=n.sizes, pieces=(1,) * len(n.labels), flops_per_device=0,
                            inputs=(), partial_bytes=0, peak_bytes=0, n_agg=len(n.agg_labels))
                for n in graph.nodes)
    return PartitionPlan(devices=1, strategy="trivial", ops=ops, cost=Cost(0, 0, 0),
                         graph=graph)


def compare(names=()) -> None:
    import test_one_device_plans as plans  # tests/ on the path

    for name, make in plans.PLANS.items():
        if names and name not in names:
            continue
        with tq.connect(**plans.SETTINGS) as db:
            one = make(db)
            part = build(one.root, trivial_partition(one), db.chunk_store, also=one.also,
                         fuse_bytes=None, min_tasks=4)
            a, b = plans.signature(one), plans.signature(part)
        print(f"== {name}: {'identical' if a == b else 'differs'}")
        if a == b:
            continue
        for tag, sig in (("one device", a), ("trivial partition", b)):
            print(f"  {tag}:")
            for s in sig:
                print(f"    {s['name']}: {s['tasks']} tasks {s['kernels']} inputs {s['inputs']}"
                      f" flops {s['flops']} est {s['est']} {s['digest']}")


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    compare(sys.argv[1:])
