"""One rank of tests/exec/test_distributed_exit.py: a user script of tensorql's distributed
mode that ends normally -- tensorql joins the process group, so tensorql's exit handler
(:func:`tensorql.exec.distributed.leave_process_group`) leaves it.

``exit_worker.py OUT query``: runs a partitioned MLP and checks it against torch; as the
interpreter ends (an exit handler registered before tensorql's, so run after it) writes
``OUT/rank<R>.exit.json`` with the torch.distributed threads still running then.

``exit_worker.py OUT pending``: rank 0 ends while an all-reduce it started is still in flight
on gloo's thread, with a Python callback on its future; rank 1 joins the all-reduce 1.5 s
later. Left to the interpreter's teardown, the group's work finished inside ``Py_Finalize``
and gloo's thread, taking the GIL for the callback, aborted the process.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

# the native threads of torch.distributed's gloo groups and of rank 0's TCPStore server
TORCH_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def torch_threads() -> list[str]:
    """The names of this process's torch.distributed threads still running."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in TORCH_THREADS:
            names.append(name)
    return sorted(names)


def report_at_exit(out: str, rank: int) -> None:
    def report() -> None:
        with open(os.path.join(out, f"rank{rank}.exit.json"), "w") as f:
            json.dump({"torch_threads": torch_threads()}, f)

    atexit.register(report)  # before tensorql's handler is registered: runs after it


def query(out: str, rank: int) -> None:
    import numpy as np

    import tensorql as tq
    from tensorql.models import mlp

    report_at_exit(out, rank)
    with tq.connect(distributed=True, workers=1, distributed_timeout_s=60) as db:
        w = mlp(db, batch=16, d_model=32, d_ff=64)
        got = w.output.compile().run(dense=True).dense().numpy()
        want = w.reference()
        want = want.numpy() if hasattr(want, "numpy") else want
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"max_err": float(np.abs(got - want).max())}, f)


def pending(out: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from tensorql.exec.distributed import join_process_group

    join_process_group(1, 60.0)  # as tq.connect(distributed=True) does
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value())
    else:
        time.sleep(1.5)
        dist.all_reduce(t)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"sum": t.tolist()}, f)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    {"query": query, "pending": pending}[mode](out, rank)


if __name__ == "__main__":
    main()
