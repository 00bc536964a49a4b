"""Dense results that a run computes its result chunks straight into."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorql.dtypes import torch_dtype
from tensorql.errors import ShapeError
from tensorql.exec.host_malloc import empty_result


class DenseResults:
    """Fresh dense tensors for the results of ``steps`` that a run computes its result
    chunks straight into (``destination``), copying only a chunk a kernel returned apart
    (``sink``); a stored chunk never leaks out by reference. ``tensors``: one per step.

    >>> import torch, tensorql as tq
    >>> q = tq.einsum("ij->i", tq.connect().constant(torch.ones(3, 4))).compile()
    >>> writer = DenseResults([q.physical.result_step])
    >>> writer.tensors[0].shape
    torch.Size([3])
    """

    def __init__(self, steps: Sequence[Any],
                 given: Sequence[torch.Tensor | None] | None = None) -> None:
        self._outs: dict[int, tuple[Any, torch.Tensor]] = {}
        for k, step in enumerate(steps):
            rel = step.relation
            dtype = torch_dtype(rel.dtype)
            buffer = given[k] if given is not None and k < len(given) else None
            if buffer is not None and (tuple(buffer.shape) != tuple(rel.shape)
                                       or buffer.dtype != dtype or not buffer.is_contiguous()
                                       or buffer.device.type != "cpu"):
                raise ShapeError(f"output {k}: the buffer given to compute it into is "
                                 f"{tuple(buffer.shape)} {buffer.dtype}, the result "
                                 f"{tuple(rel.shape)} {dtype} (contiguous, on the CPU)")
            if buffer is None:
                buffer = empty_result(rel.shape, dtype)
            self._outs.setdefault(step.id, (rel, buffer))
        self.tensors = [self._outs[step.id][1] for step in steps]

    def destination(self, ref: Any) -> torch.Tensor | None:
        if ref.step not in self._outs:
            return None
        rel, out = self._outs[ref.step]
        return out[rel.grid.slices(ref.key)]

    def sink(self, ref: Any, chunk: torch.Tensor) -> None:
        tile = self.destination(ref)
        if chunk.data_ptr() != tile.data_ptr() or chunk.stride() != tile.stride():
            tile.copy_(chunk)
