"""A plain numpy definition of the extended einsum, used as the oracle in tests.

It broadcasts every operand to the full label space, folds JOIN left to right and reduces the
aggregated labels with AGG: exactly the semantics, with no cleverness.
"""

from __future__ import annotations

import numpy as np

from tensorql.einsum.spec import EinsumSpec

JOIN = {"mul": np.multiply, "add": np.add, "sub": np.subtract, "div": np.divide,
        "max": np.maximum, "min": np.minimum}
AGG = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def extended_einsum(equation: str, *arrays: np.ndarray, join: str = "mul",
                    agg: str = "sum") -> np.ndarray:
    spec = EinsumSpec.parse(equation, [a.shape for a in arrays], join=join, agg=agg)
    joint = list(spec.output) + list(spec.aggregated)
    letters = {lab: chr(ord("a") + k) for k, lab in enumerate(joint)}
    value = None
    for array, labels, squeezed in zip(arrays, spec.inputs, spec.squeezed):
        # diagonal + transpose into joint order with np.einsum (no arithmetic involved)
        keep = [lab for lab, sq in zip(labels, squeezed) if not sq]
        squeezed_array = array.reshape([n for n, sq in zip(array.shape, squeezed) if not sq])
        distinct = list(dict.fromkeys(keep))
        view = np.einsum("".join(letters[lab] for lab in keep) + "->"
                         + "".join(letters[lab] for lab in distinct), squeezed_array)
        order = sorted(distinct, key=joint.index)
        view = np.transpose(view, [distinct.index(lab) for lab in order])
        shape = [spec.sizes[lab] if lab in distinct else 1 for lab in joint]
        view = view.reshape(shape)
        value = view if value is None else JOIN[join](value, view)
    value = np.broadcast_to(value, [spec.sizes[lab] for lab in joint])
    axes = tuple(range(len(spec.output), len(joint)))
    return AGG[agg](value, axis=axes) if axes else np.array(value)


TORCH_JOIN = {"mul": "mul", "add": "add", "sub": "sub", "div": "div", "max": "maximum",
              "min": "minimum", "pow": "pow"}


def torch_extended_einsum(equation: str, *tensors, join: str = "mul", agg: str = "sum"):
    """The same definition in torch (differentiable: the oracle of gradient tests). Ties of a
    max / min aggregation share the gradient evenly (``torch.amax`` / ``amin``)."""
    import torch

    spec = EinsumSpec.parse(equation, [t.shape for t in tensors], join=join, agg=agg)
    joint = list(spec.output) + list(spec.aggregated)
    letters = {lab: chr(ord("a") + k) for k, lab in enumerate(joint)}
    value = None
    for tensor, labels, squeezed in zip(tensors, spec.inputs, spec.squeezed):
        keep = [lab for lab, sq in zip(labels, squeezed) if not sq]
        view = tensor.reshape([n for n, sq in zip(tensor.shape, squeezed) if not sq])
        distinct = list(dict.fromkeys(keep))
        order = sorted(distinct, key=joint.index)
        view = torch.einsum("".join(letters[lab] for lab in keep) + "->"
                            + "".join(letters[lab] for lab in order), view)
        view = view.reshape([spec.sizes[lab] if lab in distinct else 1 for lab in joint])
        if value is None:
            value = view
        elif join == "where":
            value = (value, view) if not isinstance(value, tuple) else (*value, view)
        else:
            value = getattr(torch, TORCH_JOIN[join])(value, view)
    if join == "where":
        cond, yes, no = value
        value = torch.where(cond, yes, no)
    value = value.expand([spec.sizes[lab] for lab in joint])
    axes = tuple(range(len(spec.output), len(joint)))
    if not axes:
        return value
    if agg == "sum":
        return value.sum(dim=axes)
    if agg == "max":
        return value.amax(dim=axes)
    if agg == "min":
        return value.amin(dim=axes)
    return value.reshape([spec.sizes[lab] for lab in spec.output] + [-1]).prod(dim=-1)
