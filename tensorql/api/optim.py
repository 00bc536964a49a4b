"""Training: SGD (momentum) and Adam / AdamW as einsum updates, checkpointed in the store.

An optimizer owns a set of stored weights. :meth:`Optimizer.params` hands them out as lazy
tensors; a loss built from them goes to :meth:`Optimizer.step`, which builds ONE graph -- the
forward pass, the gradients (:func:`tensorql.grad`) and the update of every weight and of the
optimizer's state -- plans it as one query and runs it (the forward pass is computed once and
feeds every gradient). Between steps the weights stay in memory; every ``checkpoint_every``
steps they are stored with the optimizer's state and step count in one commit
(``db.store_many``), so a process killed at any point resumes from the last committed step:
an optimizer opened on a database holding a checkpoint continues from it, with the same
results as a run that was never interrupted.

Memory: activations are freed after their last use within the step (the memory plan of the
one query); nothing is recomputed. Adam's update of a weight is one fused pass per chunk (the
``adam`` join: new weight, m and v stacked in one result). On one CPU device the update is
computed in place, into the storage of the weight and moments it replaces (the plan orders
each update after every other reader of them: :mod:`tensorql.physical.in_place`), as torch's
fused Adam does; elsewhere a step computes its results into those of the step before last,
which nothing reads any more (double buffering: one more copy of the weights and slots stays
resident between steps, and no step faults in fresh pages). ``values`` and ``state`` are those
working buffers, so copy them to keep them. A step that fails while updating in place leaves
the weights partly updated: the optimizer refuses further steps (``ExecutionError``) until it
is made again from the store.

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> _ = db.from_numpy("w", np.array([3.0, -2.0]))
>>> opt = tq.optim.SGD(db, ["w"], lr=0.25)
>>> w = opt.params()["w"]
>>> loss = (w * w).sum()                 # built once, stepped many times
>>> [round(opt.step(loss), 4) for _ in range(3)]
[13.0, 3.25, 0.8125]
>>> db.tensor("w").numpy().tolist(), opt.step_count
([0.375, -0.25], 3)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from opt_einsum import get_symbol

from tensorql.algebra import update_join
from tensorql.api.autodiff import FLOAT_DTYPES, GradientError, grad
from tensorql.api.tensor import Tensor
from tensorql.einsum.graph import Node, substitute, topological_order
from tensorql.errors import ExecutionError, OptionError, ShapeError, as_flag
from tensorql.exec.tape import REPLAYED

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]


def hyperparameter(name: str, value: Any, below: float | None = None) -> float:
    """``value`` as a float, checked as torch.optim checks it: a finite number >= 0 (and
    below ``below`` where given), else an :class:`OptionError` naming it.

    >>> hyperparameter("lr", 1e-3), hyperparameter("betas[0]", 0.9, below=1.0)
    (0.001, 0.9)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value) or value < 0 or (below is not None and value >= below):
        bound = f"in [0, {below:g})" if below is not None else "a finite number >= 0"
        raise OptionError(f"{name} must be {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class _StepPlan:
    """A planned training step and what it was planned for (a new loss expression or new
    session options plan it again)."""

    loss: Node
    options: Any
    query: Any
    trained: tuple[str, ...]  # the weights the loss has a gradient path to, updated by a step


class Optimizer:
    """Weights stored under ``params`` (names), updated by :meth:`step`.

    ``name`` prefixes the state stored with each checkpoint (``{name}.step``, the names of the
    weights it trains, ``{name}.params``, how many updates each of them has had,
    ``{name}.weight_steps``, and one tensor per weight and slot, e.g. ``adam.m.W1``); an
    optimizer resumes the checkpoint under its name only when it trains the same weights
    (else OptionError: two optimizers of other weights need other names).
    ``checkpoint_every`` is how many steps run between checkpoints (1: every step is
    committed).

    A step updates only the weights the loss has a gradient path to; the others and their
    slots are left as they are, as torch.optim skips a parameter whose ``grad`` is None. Like
    torch.optim, each weight counts its own updates (``weight_steps``): Adam's bias
    corrections for a weight some losses skip follow its own count, not ``step_count``.

    ``strategy``: the engine's strategy for the step's run (None, the default: the engine's
    policy, :func:`tensorql.exec.engine.choose_strategy`; e.g. "serial" or "lanes" to
    compare them on a host, as ``bench/train.py --tq-strategy`` does). Set it on the
    optimizer: ``opt.strategy = "serial"``.
    """

    slots: tuple[str, ...] = ()
    strategy: str | None = None

    def __init__(self, db: Any, params: Sequence[str], *, name: str = "optim",
                 checkpoint_every: int = 1) -> None:
        from tensorql.api.database import Database

        if not isinstance(db, Database):
            raise OptionError(f"an optimizer's first argument is the session its weights are "
                              f"stored in (tq.connect()), not {type(db).__name__}")
        if isinstance(params, str):
            params = [params]
        if not isinstance(params, (list, tuple)) or not all(
                isinstance(p, str) and p for p in params):
            raise OptionError("params must be the names of stored weights (a string or a list "
                              f"of strings), got {params!r}")
        if len(set(params)) != len(params):
            raise OptionError(f"params names a weight more than once: {list(params)!r}")
        if not isinstance(name, str) or not name:
            raise OptionError(f"name must be a non-empty string (it prefixes the stored state), "
                              f"got {name!r}")
        self.db, self.names, self.name = db, list(params), name
        if not self.names:
            raise OptionError("an optimizer needs at least one weight to train")
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or \
                checkpoint_every < 1:
            raise OptionError(f"checkpoint_every must be an integer >= 1, got "
                              f"{checkpoint_every!r}")
        self.checkpoint_every = int(checkpoint_every)
        self.values: dict[str, torch.Tensor] = {}
        for n in self.names:
            value = db.tensor(n).torch()
            if canonical(value) not in FLOAT_DTYPES:
                raise ShapeError(f"weight {n!r} has dtype {canonical(value)}; only floating "
                                 "weights can be trained")
            self.values[n] = value.clone()
        self.step_count = self._resumed_step()
        self.weight_steps: dict[str, int] = self._resumed_weight_steps()
        self.state: dict[tuple[str, str], torch.Tensor] = {}
        for slot in self.slots:
            for n in self.names:
                stored = self._state_name(slot, n)
                self.state[(slot, n)] = (db.tensor(stored).torch().clone()
                                         if self.step_count and db.chunk_store.has(stored)
                                         else torch.zeros_like(self.values[n]))
        # the in-memory leaves every step's graph reads; updated in place after each step
        self._params = {n: db.constant(v) for n, v in self.values.items()}
        self._slots = {k: db.constant(v) for k, v in self.state.items()}
        # the very tensors the constants hold: a step gives them the new values' storage
        self.values = {n: t.node.value for n, t in self._params.items()}
        self.state = {k: t.node.value for k, t in self._slots.items()}
        self._scalars: dict[str, torch.Tensor] = {}
        self._step_plan: _StepPlan | None = None  # the last loss's planned step
        # double buffering: the results of the step before last are no longer read by
        # anything (the weights and slots moved on to the last step's), so the next step
        # computes into them instead of into fresh memory (which costs page faults)
        self._latest: list[torch.Tensor] | None = None
        self._spare: list[torch.Tensor] | None = None
        self._failed_in_place: str | None = None  # why the in-memory weights are unusable

    def _state_name(self, slot: str, param: str) -> str:
        return f"{self.name}.{slot}.{param}"

    def _resumed_step(self) -> int:
        """The step count of the checkpoint stored under this optimizer's name (0: none);
        OptionError when the stored ``{name}.step`` is no step count or the checkpoint is of
        other weights (resuming its step count would give this optimizer wrong bias
        corrections, and its checkpoints would overwrite the other one's)."""
        counter, owners = f"{self.name}.step", f"{self.name}.params"
        store = self.db.chunk_store
        if not store.has(counter):
            return 0
        count = self.db.tensor(counter).torch()
        if count.ndim or count.dtype == torch.bool or count.is_floating_point() \
                or count.is_complex() or count < 0:
            raise OptionError(f"stored tensor {counter!r} ({tuple(count.shape)} "
                              f"{canonical(count)}) is not an optimizer's step count (a 0-d "
                              f"integer >= 0): pick another name= for the optimizer")
        if store.has(owners):  # (a checkpoint written before it was recorded has none)
            trained = _decode_names(owners, self.db.tensor(owners).torch())
            if sorted(trained) != sorted(self.names):
                raise OptionError(
                    f"the checkpoint stored under name={self.name!r} (step {int(count)}) is "
                    f"of an optimizer of the weights {trained!r}, not {self.names!r}: pick "
                    "another name= for this optimizer, or drop the old state (db.drop of "
                    f"{counter!r}, {owners!r} and its slots) to start afresh")
        return int(count)

    def _resumed_weight_steps(self) -> dict[str, int]:
        """How many updates each weight had at the checkpoint (``{name}.weight_steps``, in
        the order of ``{name}.params``; a checkpoint without it: ``step_count`` each)."""
        counts = {n: self.step_count for n in self.names}
        stored, owners = f"{self.name}.weight_steps", f"{self.name}.params"
        store = self.db.chunk_store
        if not self.step_count or not store.has(stored) or not store.has(owners):
            return counts
        trained = _decode_names(owners, self.db.tensor(owners).torch())
        value = self.db.tensor(stored).torch()
        if value.ndim != 1 or len(value) != len(trained) or value.is_floating_point() \
                or value.dtype == torch.bool or value.is_complex() or bool((value < 0).any()) \
                or bool((value > self.step_count).any()):
            raise OptionError(f"stored tensor {stored!r} ({tuple(value.shape)} "
                              f"{canonical(value)}) is not the update counts of the "
                              f"{len(trained)} weights of the checkpoint under "
                              f"name={self.name!r}: pick another name= for the optimizer")
        counts.update(zip(trained, (int(c) for c in value.tolist())))
        return counts

    def params(self) -> dict[str, Tensor]:
        """The weights as lazy tensors (the same ones every step: build the loss once). A
        loss may as well be written over the stored weights, ``db.tensor(name)``: ``step``
        puts the optimizer's copies in their place."""
        return dict(self._params)

    def _scalar(self, key: str, dtype: str) -> Tensor:
        """A 0-d constant whose value changes per step (set in ``_set_scalars``)."""
        k = f"{key}:{dtype}"
        if k not in self._scalars:
            from tensorql.dtypes import torch_dtype

            self._scalars[k] = torch.zeros((), dtype=torch_dtype(dtype))
        return self.db.constant(self._scalars[k])

    def _weight_step(self, param: str, dtype: str) -> Tensor:
        """A 0-d constant holding the number of ``param``'s update in this step (its own
        count, as torch.optim's ``state["step"]``; set in ``_set_scalars``)."""
        return self._scalar(_WEIGHT_STEP + param, dtype)

    def _set_scalars(self, step: int) -> None:
        values = self.scalars(step)
        for k, tensor in self._scalars.items():
            key = k.rsplit(":", 1)[0]
            if key.startswith(_WEIGHT_STEP):
                tensor.fill_(self.weight_steps[key[len(_WEIGHT_STEP):]] + 1)
            else:
                tensor.fill_(values[key])

    def scalars(self, step: int) -> dict[str, float]:
        """Values of the per-step scalars for step number ``step`` (1-based)."""
        return {}

    def update(self, param: str, weight: Tensor, gradient: Tensor,
               state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The new weight and slots of one weight, as lazy tensors."""
        raise NotImplementedError

    def _plan(self, loss: Tensor) -> Any:
        from tensorql.pipeline import CompiledGroup

        cached = self._step_plan
        if cached is not None and cached.loss is loss.node and cached.options == self.db.options:
            return cached.query
        given = loss.node
        # a loss written over the stored weights (db.tensor(name)) trains the in-memory ones
        node = substitute(given, {n: self._params[n].node for n in self.names})
        loss = Tensor(node, self.db)
        reached = _differentiable_leaves(node, {n: self._params[n].node for n in self.names})
        trained = tuple(n for n in self.names if n in reached)
        if not trained:
            raise GradientError(f"the loss has no gradient path to any of the weights "
                                f"{self.names!r} (it does not read them, or only through "
                                "comparisons or integer values): nothing to train")
        # (allow_unused: a path of floating nodes may still carry no adjoint, e.g. argmax's)
        grads = grad(loss, [self._params[n] for n in trained], allow_unused=True)
        self._tile_like_gradients(trained, grads)
        outputs = [loss]
        for n, g in zip(trained, grads):
            slots = {slot: self._slots[(slot, n)] for slot in self.slots}
            outputs.extend(self.update_outputs(n, self._params[n], g, slots))
        group = CompiledGroup.compile([t.node for t in outputs], self.db,
                                      in_place=self._in_place(trained))
        if group.physical is not None and len(group.in_place) == len(outputs) - 1:
            # every new value computed in place, only the loss apart: the engine may replay
            # the step from a tape (its calls bound once, the updates into the weights)
            group.physical.task_graph().programs[REPLAYED] = True
        self._step_plan = _StepPlan(loss=given, options=self.db.options, query=group,
                                    trained=trained)
        self._latest = self._spare = None  # a new plan's results may have other shapes
        return group

    def _in_place(self, trained: Sequence[str]) -> dict[int, list[torch.Tensor]]:
        """The outputs (by index among those of a step updating ``trained``, the loss first)
        that may be computed into the storage of the constants they replace, and those
        constants: none for an optimizer whose update is not one fused in-place kernel per
        chunk."""
        return {}

    def update_outputs(self, param: str, weight: Tensor, gradient: Tensor,
                       state: dict[str, Tensor]) -> list[Tensor]:
        """The results of the step that carry ``param``'s new values, in the order
        :meth:`take_results` reads them: the new weight, then each slot."""
        new_weight, new_slots = self.update(param, weight, gradient, state)
        return [new_weight, *(new_slots[slot] for slot in self.slots)]

    def take_results(self, param: str, results: Iterator[torch.Tensor]) -> None:
        """Give ``param``'s weight and slots the values :meth:`update_outputs` computed."""
        _replace(self.values[param], next(results))
        for slot in self.slots:
            _replace(self.state[(slot, param)], next(results))

    def _tile_like_gradients(self, trained: Sequence[str], grads: list[Tensor]) -> None:
        """Give each weight's slots (momentum, Adam's m and v) the chunk tiles its gradient
        comes out with; the updates put the gradient first, so gradient and slots are read
        chunk for chunk and only the weight itself may be retiled. (Retiling the weights
        too would change the gradients' tiles in turn.)"""
        from tensorql.grid import ChunkGrid
        from tensorql.logical.lower import lower_many

        if not self.slots:
            return
        for n, root in zip(trained, lower_many([g.node for g in grads])):
            grid = root.relation.grid
            for slot in self.slots:
                state = self._slots[(slot, n)].node
                if grid.shape == state.shape and grid.tile != state.grid.tile:
                    self._slots[(slot, n)] = Tensor(dataclasses.replace(
                        state, grid=ChunkGrid(grid.shape, grid.tile)), self.db)

    def explain(self, loss: Tensor, analyze: bool = False) -> str:
        """The plan of one training step (forward, backward and update as one query)."""
        if not isinstance(loss, Tensor) or loss.db is not self.db:
            raise ShapeError("explain() takes the loss as a tensorql Tensor of this database")
        analyze = as_flag(analyze, "analyze")
        group = self._plan(loss)
        self._set_scalars(self.step_count + 1)
        # analyzed as a step runs, into buffers nothing reads: the spare ones, fresh ones for
        # the outputs a step computes in place (the weights are not updated)
        out = [None if k in group.in_place or self._spare is None else self._spare[k]
               for k in range(len(group.nodes))]
        return group.explain(analyze=analyze, out=out)

    def step(self, loss: Tensor) -> float:
        """One training step: compute the loss, the gradients and the updates in one query,
        apply them, checkpoint when due; returns the loss (before the update)."""
        if not isinstance(loss, Tensor) or loss.db is not self.db:
            raise ShapeError("step() takes the loss as a tensorql Tensor of this database")
        if self._failed_in_place is not None:
            raise ExecutionError(self._failed_in_place)
        group = self._plan(loss)
        self._set_scalars(self.step_count + 1)
        latest, spare = self._latest, self._spare
        in_place = group.in_place if latest is not None else frozenset()
        out = [latest[k] if k in in_place else None if spare is None else spare[k]
               for k in range(len(group.nodes))]
        try:
            results = group.run(out=out, strategy=self.strategy)
        except BaseException as err:
            if in_place:
                self._failed_in_place = (
                    f"step {self.step_count + 1} failed ({type(err).__name__}: {err}) while "
                    "updating the weights in place: they are partly updated; make the "
                    "optimizer again from the store (the last checkpoint, step "
                    f"{self.step_count - self.step_count % self.checkpoint_every})")
            raise
        loss_value = float(results[0].reshape(()).item())
        it = iter(results[1:])
        # the constants the plan reads take the new values' storage (of the weights updated)
        for n in self._step_plan.trained:
            self.take_results(n, it)
            self.weight_steps[n] += 1
        self._spare, self._latest = self._latest, results
        self.step_count += 1
        if self.step_count % self.checkpoint_every == 0:
            self.checkpoint()
        return loss_value

    def checkpoint(self) -> None:
        """Store the weights, the optimizer's state and the step count in one commit."""
        items: dict[str, Any] = {n: self.values[n] for n in self.names}
        for (slot, n), value in self.state.items():
            items[self._state_name(slot, n)] = value
        items[f"{self.name}.step"] = torch.tensor(self.step_count, dtype=torch.int64)
        items[f"{self.name}.params"] = _encode_names(self.names)
        items[f"{self.name}.weight_steps"] = torch.tensor(
            [self.weight_steps[n] for n in self.names], dtype=torch.int64)
        self.db.store_many(items, replace=True)


_WEIGHT_STEP = "step@"  # the key prefix of a weight's own step count among the scalars


def _encode_names(names: Sequence[str]) -> torch.Tensor:
    """The weight names a checkpoint belongs to, as a tensor the store keeps like any other:
    their UTF-8 bytes, each name ended by a NUL byte.

    >>> _decode_names("opt.params", _encode_names(["W1", "b"]))
    ['W1', 'b']
    """
    data = b"".join(n.encode("utf-8") + b"\0" for n in names)
    return torch.tensor(list(data), dtype=torch.uint8)


def _decode_names(stored: str, value: torch.Tensor) -> list[str]:
    """The names :func:`_encode_names` encoded; OptionError naming the stored tensor when it
    holds something else."""
    data = bytes(value.numpy().tolist()) if value.dtype == torch.uint8 and value.ndim == 1 \
        else b""
    try:
        names = data.decode("utf-8").split("\0")
    except UnicodeDecodeError:
        names = []
    if len(names) < 2 or names[-1] or not all(names[:-1]):
        raise OptionError(f"stored tensor {stored!r} ({tuple(value.shape)} {canonical(value)}) "
                          "is not the weight names of an optimizer's checkpoint: pick another "
                          "name= for the optimizer")
    return names[:-1]


def _differentiable_leaves(root: Node, leaves: dict[str, Node]) -> set[str]:
    """The names of the ``leaves`` with a path of floating nodes to ``root``: those
    :func:`tensorql.grad` differentiates ``root`` by (no gradient flows through a comparison
    or an integer cast, as torch gives such a weight no ``grad``)."""
    names = {id(node): n for n, node in leaves.items()}
    reached: dict[int, frozenset[str]] = {}
    for node in topological_order(root):
        found: set[str] = set()
        if node.dtype in FLOAT_DTYPES:
            found = {names[id(node)]} if id(node) in names else set()
            for operand in node.inputs:
                found |= reached[id(operand)]
        reached[id(node)] = frozenset(found)
    return set(reached[id(root)])


def _replace(held: torch.Tensor, new: torch.Tensor) -> None:
    """Give the tensor a plan reads (a constant's value) the new values, without a copy
    when they have its dtype and shape (the constant's node says both)."""
    if new.dtype != held.dtype or new.shape != held.shape:
        held.copy_(new)
    else:
        held.set_(new)


def canonical(value: torch.Tensor) -> str:
    from tensorql.dtypes import canonical_dtype

    return canonical_dtype(value.dtype)


class SGD(Optimizer):
    """``w -= lr * g`` with optional momentum (torch.optim.SGD with dampening 0):
    ``buf = momentum * buf + g``; the step uses ``buf`` (or ``g + momentum * buf`` with
    ``nesterov``). ``weight_decay`` adds ``weight_decay * w`` to the gradient."""

    def __init__(self, db: Any, params: Sequence[str], lr: float = 1e-3, *,
                 momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 name: str = "sgd", checkpoint_every: int = 1) -> None:
        self.lr, self.momentum = hyperparameter("lr", lr), hyperparameter("momentum", momentum)
        self.nesterov = as_flag(nesterov, "nesterov")
        if self.nesterov and not self.momentum:  # torch.optim.SGD refuses it too
            raise OptionError("nesterov=True needs a momentum > 0 (Nesterov momentum requires "
                              f"a momentum and zero dampening, as torch says), got momentum="
                              f"{momentum!r}")
        self.weight_decay = hyperparameter("weight_decay", weight_decay)
        self.slots = ("momentum",) if self.momentum else ()
        super().__init__(db, params, name=name, checkpoint_every=checkpoint_every)

    def update(self, param, weight, gradient, state):
        if self.weight_decay:
            gradient = gradient + weight * self.weight_decay
        # the gradient's terms come first: their chunk tiles are the update's
        if not self.momentum:
            return gradient * -self.lr + weight, {}
        buf = gradient + state["momentum"] * self.momentum
        direction = gradient + buf * self.momentum if self.nesterov else buf
        return direction * -self.lr + weight, {"momentum": buf}


class Adam(Optimizer):
    """Adam as torch.optim.Adam computes it: ``m = b1 m + (1 - b1) g``, ``v = b2 v +
    (1 - b2) g^2``, ``w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``;
    ``weight_decay`` adds ``weight_decay * w`` to the gradient (see :class:`AdamW` for the
    decoupled form)."""

    slots = ("m", "v")
    decoupled = False

    def __init__(self, db: Any, params: Sequence[str], lr: float = 1e-3, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, name: str = "adam",
                 checkpoint_every: int = 1) -> None:
        self.lr, self.eps = hyperparameter("lr", lr), hyperparameter("eps", eps)
        self.weight_decay = hyperparameter("weight_decay", weight_decay)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise OptionError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self.beta1, self.beta2 = (hyperparameter(f"betas[{k}]", b, below=1.0)
                                  for k, b in enumerate(betas))
        super().__init__(db, params, name=name, checkpoint_every=checkpoint_every)

    def scalars(self, step: int) -> dict[str, float]:
        return {}  # each weight's own step count (_weight_step): the fused kernel derives
        # the bias corrections from it

    def update_outputs(self, param, weight, gradient, state):
        """ONE result per weight: the join ``adam`` (``adamw``) stacks the new weight and
        moments along a leading slot axis and computes them in one fused pass per chunk
        (:mod:`tensorql_kernels.optimizer_update`), where the same update written as
        elementwise steps is a dozen passes over memory. The gradient comes first, so its
        chunk tiles are the update's (the moments have them already; only the weight may be
        retiled)."""
        from tensorql.api.einsum import einsum
        from tensorql.dtypes import canonical_dtype, torch_dtype

        dtype = weight.dtype
        labels = "".join(get_symbol(k) for k in range(weight.ndim))
        slot = get_symbol(weight.ndim)
        # the join carries the hyperparameters fixed for the optimizer's life; lr and step
        # are its scalar operands (on a GPU the fused kernel reads them on the device)
        join = update_join(self.decoupled, self.beta1, self.beta2, self.eps, self.weight_decay)
        equation = ",".join([labels] * 4 + [slot, "", ""]) + f"->{slot}{labels}"
        # lr and step at least in float32, as torch.optim reads them (in bfloat16, lr 0.05
        # is 0.05005 and step 301 is 300); the result has the weight's dtype
        wide = canonical_dtype(torch.promote_types(torch_dtype(dtype), torch.float32))
        return [einsum(equation, gradient, weight, state["m"], state["v"],
                       self._fixed_slots(dtype), self._fixed(self.lr, wide),
                       self._weight_step(param, wide), join=join)]

    def _in_place(self, trained: Sequence[str]) -> dict[int, list[torch.Tensor]]:
        """Each trained weight's update (weight, m and v stacked: outputs 1, 2, ...) over the
        weight and its moments, which the fused kernel updates in place."""
        return {1 + k: [self.values[n], self.state[("m", n)], self.state[("v", n)]]
                for k, n in enumerate(trained)}

    def take_results(self, param, results):
        packed = next(results)  # weight, m, v stacked: each a contiguous view
        _replace(self.values[param], packed[0])
        _replace(self.state[("m", param)], packed[1])
        _replace(self.state[("v", param)], packed[2])

    def _fixed(self, value: float, dtype: str) -> Tensor:
        """A 0-d constant holding a hyperparameter."""
        from tensorql.dtypes import torch_dtype

        return self.db.constant(torch.tensor(value, dtype=torch_dtype(dtype)))

    def _fixed_slots(self, dtype: str) -> Tensor:
        """The slot indices 0, 1, 2 (weight, m, v) of the update's output."""
        from tensorql.dtypes import torch_dtype

        return self.db.constant(torch.arange(3, dtype=torch_dtype(dtype)))


class AdamW(Adam):
    """Adam with decoupled weight decay (torch.optim.AdamW; default weight_decay 0.01)."""

    decoupled = True

    def __init__(self, db: Any, params: Sequence[str], lr: float = 1e-3, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, name: str = "adamw",
                 checkpoint_every: int = 1) -> None:
        super().__init__(db, params, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         name=name, checkpoint_every=checkpoint_every)
