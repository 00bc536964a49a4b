"""torch.distributed's point-to-point calls held to NCCL's rules over gloo, and one rank of the
test that runs the exchange code under them (``tests/exec/test_nccl_rules.py``).

NCCL ignores tags: a rank's k-th send to / receive from a peer pairs with the peer's k-th call
the other way, whatever their tags. Gloo pairs by tag. :class:`NCCLRules` replaces every
point-to-point call's tag by its position among the calls of its pair of ranks, so that gloo
pairs them exactly as NCCL would: a rank issuing its transfers in another order than its peer
gets the wrong chunk, a size error or a hang (a timeout). It records each rank's sequence per
peer (direction, shape, dtype, the caller's tag); the test checks that each pair's sequences
mirror each other.

Run as a script: ``nccl_rules.py <out dir> <exchange modes, comma-separated>``, under the
environment torchrun sets; writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


class NCCLRules:
    """Wraps ``send``/``recv``/``isend``/``irecv``/``batch_isend_irecv`` of torch.distributed
    (the default group's ranks) while installed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.issued: dict[int, list[list[Any]]] = {}  # peer -> [direction, shape, dtype, tag]

    def position(self, peer: int, direction: str, tensor: torch.Tensor, tag: int) -> int:
        """The call's place among this rank's calls with ``peer``: the tag gloo gets."""
        with self.lock:
            calls = self.issued.setdefault(peer, [])
            calls.append([direction, list(tensor.shape), str(tensor.dtype), tag])
            return len(calls) - 1

    def install(self) -> None:
        originals = {name: getattr(dist, name)
                     for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv")}
        rules = self

        def wrap(name: str, direction: str) -> Any:
            call = originals[name]

            def by_issue_order(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
                names = ("dst", "group", "tag") if direction == "send" else \
                    ("src", "group", "tag")
                given = dict(zip(names, args), **kw)
                peer, group, tag = given[names[0]], given.get("group"), given.get("tag", 0)
                return call(tensor, peer, group, rules.position(peer, direction, tensor, tag))

            return by_issue_order

        def batch(ops: list[Any]) -> Any:
            plain = []
            for op in ops:  # P2POp as torch wants it: its own isend / irecv, tags replaced
                sending = op.op in (dist.isend, originals["isend"])
                direction = "send" if sending else "recv"
                plain.append(dist.P2POp(
                    originals["isend" if sending else "irecv"], op.tensor, op.peer, op.group,
                    rules.position(op.peer, direction, op.tensor, op.tag)))
            return originals["batch_isend_irecv"](plain)

        dist.send, dist.recv = wrap("send", "send"), wrap("recv", "recv")
        dist.isend, dist.irecv = wrap("isend", "send"), wrap("irecv", "recv")
        dist.batch_isend_irecv = batch


def arrays() -> dict[str, np.ndarray]:
    """The inputs every rank builds alike: a two-layer MLP over a batch."""
    rng = np.random.default_rng(29)
    return {"x": rng.standard_normal((24, 32)).astype(np.float32),
            "w1": rng.standard_normal((32, 40)).astype(np.float32),
            "w2": rng.standard_normal((40, 16)).astype(np.float32),
            "q": rng.standard_normal((16, 24)).astype(np.float32)}


def run(mode: str, rules: NCCLRules) -> dict[str, Any]:
    """A two-layer MLP (checked against numpy) and a LLaMA block (against torch) with the
    exchange ``mode`` ("p2p" or "collective", "@<bytes>" adding a memory limit); what this
    rank saw, and the calls it issued with each peer."""
    import tensorql as tq
    from tensorql.models import llama_block

    exchange, _, limit = mode.partition("@")
    rules.issued.clear()
    seen: dict[str, Any] = {}
    a = arrays()
    want = (np.maximum(a["x"] @ a["w1"], 0) @ a["w2"]).T @ a["q"].T
    try:
        with tq.connect(distributed=True, workers=1, devices="cpu", distributed_timeout_s=10,
                        distributed_exchange=exchange,
                        memory_limit=int(limit) if limit else None) as db:
            x, w1, w2, q = (db.from_numpy(k, v, tile=(8, 8)) for k, v in a.items())
            got = ((x @ w1).relu() @ w2).T @ q.T
            seen["mlp_err"] = float(np.abs(got.numpy() - want).max())
            block = llama_block(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4, d_ff=20)
            seen["block_err"] = float(np.abs(block.output.numpy() - block.reference()).max())
    except tq.TensorQLError as err:
        seen["error"] = f"{type(err).__name__}: {err}"
    seen["issued"] = {str(peer): list(calls) for peer, calls in rules.issued.items()}
    return seen


def main() -> None:
    out, modes = sys.argv[1], sys.argv[2].split(",")
    rules = NCCLRules()
    rules.install()
    seen = {mode: run(mode, rules) for mode in modes}
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
