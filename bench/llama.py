"""LLaMA generate, prefill and decode: tensorql vs Hugging Face transformers, same random model.

    python bench/llama.py [--tiny] [--seq 512] [--new 64] [--repeat 7] [--no-isolate]

One random-weight ``LlamaForCausalLM`` (~100M parameters: vocab 32000, hidden 768, 8 layers,
12 query / 4 key-value heads, SwiGLU 2048; fp32) is built from a ``LlamaConfig`` and a seed
(nothing is downloaded) in each contender's own process (``bench/harness.py``: the
transformers processes never import tensorql); tensorql's processes load it into their store
(``Llama.from_transformers``). Every call is a **new request**: the prompt's ids come from a
seed that counts the calls, the same sequence on both sides. Phases:

- **generate** (the headline): ``--seq`` prompt tokens and ``--new`` greedy tokens, end to
  end. tensorql: ``Llama.generate`` (the prompt's query, the decoder and its weight relayout
  all on the clock; the first request plans and builds them, later requests of the same
  prompt length and ``--new`` reuse them, as a server would: the cold column is the first);
  transformers: ``model.generate(do_sample=False)`` under ``torch.inference_mode``. The
  generated tokens of the first request must be equal.
- **prefill cached**: logits of a ``--seq``-token prompt, tensorql's query planned on the
  first call (``Llama.prefill``) and reused, as a server would;
- **prefill cold**: each call a prompt length not seen before (``--seq`` minus the call's
  number), tensorql planning it on the clock (``Llama.prefill(1, length).logits(ids)``: the
  first call plans from the expression; a later length re-binds that plan, its template, to
  its own extent and builds the physical plan, or -- where that costs more than the extra
  positions -- runs in a longer prefill's plan padded at its end, as a server's prompts of
  nearby lengths do; see ``Prefill``). ``tq replan`` pads nothing (``pad=False``): every
  length re-binds;
- **decode**: seconds per new token over ``--new`` tokens after an untimed prompt (tensorql:
  ``Llama.decoder`` built off the clock -- its plan, weights and tape, the plan lowered to
  bound calls that every token replays; transformers: ``model(token, past_key_values=...)``).

The logits of the first prefill are compared (max abs difference <= 1e-3 x max |logit|);
peak RSS of each side's process is reported. What each side may reuse: tensorql keeps its
plans (cached phases only) and a packed copy of each weight from its first call on (the
host's packing, ``kernels/packed_weights.py``: MKL's packed sgemm on an Intel CPU, oneDNN's
elsewhere)
(the cold figure is that first call; ``tq nopack`` runs with ``TENSORQL_PACKED_WEIGHTS=0``);
transformers keeps nothing between calls but its weights, as a user of it would, and
``transformers packed`` is the same model with every ``nn.Linear``'s weight packed once by
the code and the rule tensorql's packed weights use (``PackedLinear``): the same reuse
on its side. ``torch.compile`` is not given here (not yet done): transformers compiles
``generate`` with its static KV cache (``cache_implementation="static"``), a different program
from the dynamic cache measured here; the compiled peer of the products is in
``bench/cpu_einsum.py``.

Goals (issue 31), tq / the fastest transformers form: decode <= 1.0, generate <= 0.9, prefill
cold (a new prompt length) <= 1.0, prefill cached <= 0.9. Exits 1 on a wrong result, or on a
missed goal unless ``--tiny``.

The decode phase also times its **physical floor**, ``gemv floor``: in a process of its own, the
model's weight products of one token (every ``nn.Linear``'s weight, the LM head's included, in
the layers' order, ``torch.nn.functional.linear`` of one row, as transformers calls them) and
nothing else, per token. No decoder can be faster than its weights' GEMVs; the table gives
tq / floor beside tq / transformers. The prefill phases time theirs, ``gemm floor``: the same
weights' products of the prompt's rows (each weight packed once with the host's packing, the
fastest form either side has: :func:`gemm_floor`), with the call's prompt length, and
nothing else -- no attention, norm, rotary embedding or activation.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from harness import Contender, Interval, Record, add_arguments, ratio_text, run_contenders

FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
GOALS = {"generate": 0.9, "prefill cached": 0.9, "prefill cold": 1.0, "decode": 1.0}
FLOOR = "gemv floor"  # the decode phase's physical floor (not a peer: no goal, no check)
PREFILL_FLOOR = "gemm floor"  # the prefill phases' physical floor (the same: no goal)


def hf_model(tiny: bool):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(TINY if tiny else FULL))
    return transformers.LlamaForCausalLM(config).eval()


def prompt(vocab: int, seq: int, call: int) -> np.ndarray:
    """The ``call``-th request's prompt (1, seq): the same on both sides."""
    return np.random.default_rng(1000 + call).integers(0, vocab, size=(1, seq))


def _counter():
    calls = [-1]

    def next_call() -> int:
        calls[0] += 1
        return calls[0]
    return next_call


PACK_MIN_ROWS = 16  # kernels/packed_weights.py's MIN_ROWS: fewer rows keep the plain product


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose products use a copy of its weight packed once, with the code
    and the rule of tensorql's packed weights (``kernels/packed_weights.py``: the host's
    packing -- MKL's packed sgemm where torch's BLAS is MKL on an Intel CPU, oneDNN's
    elsewhere -- made on the first product, kept; fewer than 16 rows, a decoded token's,
    keep the plain product): what a transformers user who prepacks the same way gets.

    >>> from tensorql_kernels import packed_weights
    >>> layer = torch.nn.Linear(64, 1024, bias=False)
    >>> x, before = torch.randn(1, 256, 64), packed_weights.packed_bytes()
    >>> packed = PackedLinear(layer)
    >>> bool(torch.allclose(packed(x), layer(x), atol=1e-4))
    True
    >>> packed_weights.packed_bytes() > before or not packed_weights.ENABLED
    True
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        from tensorql_kernels import packed_weights

        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self._matmul = packed_weights.matmul
        # one tensor for the weight's life: its packed copies are found by it (its views' base)
        self._frozen = linear.weight.detach()
        packed_weights.mark_immutable(self._frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] < PACK_MIN_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = self._matmul(rows, self._frozen.t())
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


def pack_linears(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every ``nn.Linear`` a :class:`PackedLinear` (in place)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, PackedLinear(child))
    return model


def gemv_floor(model: torch.nn.Module, new: int):
    """The weight products of ``new`` decoded tokens and nothing else: one row times every
    ``nn.Linear``'s weight of ``model`` in order, per token (the floor of a decode step).

    >>> import transformers
    >>> config = transformers.LlamaConfig(**TINY)
    >>> interval = gemv_floor(transformers.LlamaForCausalLM(config), 2)()
    >>> interval.seconds > 0, interval.value.shape
    (True, (0,))
    """
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}

    @torch.inference_mode()
    def run():
        start = time.perf_counter()
        for _ in range(new):
            for weight in weights:
                torch.nn.functional.linear(rows[weight.shape[1]], weight)
        return Interval((time.perf_counter() - start) / new, np.zeros(0, dtype=np.int64))

    return run


def gemm_floor(model: torch.nn.Module, seq: int, shrinking: bool = False):
    """The weight products of a ``seq``-token prompt and nothing else: every ``nn.Linear`` of
    ``model`` as ``transformers packed`` runs it (:class:`PackedLinear`: its weight packed once,
    as tensorql's packed weights are), in order, times ``seq`` rows (the floor of
    a prefill: its GEMMs at the fastest packed rate, with no attention or elementwise work).
    ``shrinking``: the call numbered ``c`` (from 0) takes ``seq - c`` rows, as the ``prefill
    cold`` phase's prompts do.

    >>> import transformers
    >>> config = transformers.LlamaConfig(**TINY)
    >>> run = gemm_floor(transformers.LlamaForCausalLM(config), 20)
    >>> interval = run()
    >>> interval.seconds > 0, interval.value.shape
    (True, (0,))
    """
    layers = [PackedLinear(m) for m in list(model.modules()) if isinstance(m, torch.nn.Linear)]
    rows = {layer.weight.shape[1]: torch.randn(seq, layer.weight.shape[1]) for layer in layers}
    next_call = _counter()

    @torch.inference_mode()
    def run():
        length = seq - next_call() if shrinking else seq
        start = time.perf_counter()
        for layer in layers:
            layer(rows[layer.weight.shape[1]][:length])
        return Interval(time.perf_counter() - start, np.zeros(0, dtype=np.int64))

    return run


def hf_factory(tiny: bool, phase: str, seq: int, new: int, packed: bool = False,
               floor: bool = False):
    """transformers' side of ``phase`` (under ``torch.inference_mode``); ``packed``: its
    linear layers' weights packed once as tensorql packs them (:func:`pack_linears`); ``floor``: the
    model's weight products alone (:func:`gemv_floor` for decode, :func:`gemm_floor` for
    a prefill)."""
    model = hf_model(tiny)
    if floor and phase.startswith("prefill"):
        return gemm_floor(model, seq, shrinking=phase == "prefill cold")
    if floor:
        return gemv_floor(model, new)
    if packed:
        pack_linears(model)
    vocab = model.config.vocab_size
    next_call = _counter()

    @torch.inference_mode()
    def run():
        call = next_call()
        length = seq - call if phase == "prefill cold" else seq
        ids = torch.from_numpy(prompt(vocab, length, call))
        if phase == "generate":
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
            return out[0, seq:]
        if phase.startswith("prefill"):
            return model(ids).logits[0, -1]
        out = model(ids, use_cache=True)  # the prompt, off the clock
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = []
        start = time.perf_counter()
        for _ in range(new):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
        return Interval((time.perf_counter() - start) / new, np.array(tokens))

    return run


def tq_factory(tiny: bool, phase: str, seq: int, new: int, threads: int, pad: bool = True):
    """tensorql's side of ``phase``; ``pad``: whether a new prompt length may run in a longer
    planned prefill, padded (``Llama.prefill``)."""
    import tensorql as tq
    from tensorql.models import KVCache, Llama

    model = hf_model(tiny)
    vocab = model.config.vocab_size
    db = tq.connect(workers=threads, intra_op_threads=1)
    ours = Llama.from_transformers(db, model)
    del model
    next_call = _counter()
    prefill = []

    @torch.no_grad()
    def run():
        call = next_call()
        length = seq - call if phase == "prefill cold" else seq
        ids = prompt(vocab, length, call)
        if phase == "generate":
            return np.array(ours.generate(ids[0].tolist(), new)[seq:])
        if phase == "prefill cold":
            return ours.prefill(1, length, pad=pad).logits(ids)[0, -1]
        if phase == "prefill cached":
            if not prefill:
                prefill.append(ours.prefill(1, seq))
            return prefill[0].logits(ids)[0, -1]
        logits, cache = ours.step(ids, KVCache(()))
        token_id = int(logits[0].argmax())
        decoder = ours.decoder(cache, seq + new + 1)  # built off the clock
        tokens = []
        start = time.perf_counter()
        for _ in range(new):
            logits = decoder.step([[token_id]])
            token_id = int(logits[0].argmax())
            tokens.append(token_id)
        return Interval((time.perf_counter() - start) / new, np.array(tokens))

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke run)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--phases", default=",".join(["generate", "prefill cached",
                                                      "prefill cold", "decode"]),
                        help="comma-separated phases to run")
    add_arguments(parser)
    args = parser.parse_args(argv)
    seq = min(args.seq, 32) if args.tiny else args.seq
    if seq - args.repeat - args.warmup < 1:
        parser.error("--seq must exceed the calls made (prefill cold shortens it each call)")
    record = Record("llama", smoke=args.tiny, args=args, argv=argv)
    import transformers

    print(f"model {'TINY' if args.tiny else 'FULL'} fp32, prompt {seq} tokens, {args.new} new, "
          f"{args.threads} threads each side, transformers {transformers.__version__}")
    rows = []
    for phase in args.phases.split(","):
        common = dict(tiny=args.tiny, phase=phase, seq=seq, new=args.new)
        contenders = [Contender("transformers", "llama:hf_factory", common),
                      Contender("transformers packed", "llama:hf_factory",
                                dict(common, packed=True)),
                      Contender("tq", "llama:tq_factory", dict(common, threads=args.threads))]
        if phase != "prefill cold":
            contenders.append(Contender("tq nopack", "llama:tq_factory",
                                        dict(common, threads=args.threads),
                                        env={"TENSORQL_PACKED_WEIGHTS": "0"}))
        else:
            contenders.append(Contender("tq replan", "llama:tq_factory",
                                        dict(common, threads=args.threads, pad=False)))
        floor_name = (FLOOR if phase == "decode"
                      else PREFILL_FLOOR if phase.startswith("prefill") else None)
        if floor_name is not None:
            contenders.append(Contender(floor_name, "llama:hf_factory", dict(common, floor=True)))
        timings, outputs = run_contenders(contenders, args)
        record.timings(phase, timings)
        want = outputs["transformers"]
        for who, got in outputs.items():
            if who in ("transformers", floor_name):
                continue
            if phase.startswith("prefill"):
                err = float(np.abs(got - want).max())
                bound = 1e-3 * max(1.0, float(np.abs(want).max()))
                record.check(f"{phase}: {who} logits max abs difference {err:.1e} <= "
                             f"{bound:.1e}", err <= bound, err)
            else:
                record.check(f"{phase}: {who} tokens equal to transformers'",
                             got.shape == want.shape and bool((got == want).all()),
                             {"tq": got.tolist(), "transformers": want.tolist()})
        hf, tq_ = timings["transformers"], timings["tq"]
        hf_packed = timings["transformers packed"]
        fastest = min(("transformers", "transformers packed"), key=lambda w: timings[w].median)
        ratio = tq_.median / hf.median
        best = tq_.median / timings[fastest].median
        nopack = timings.get("tq nopack")
        replan = timings.get("tq replan")
        floor = None if floor_name is None else timings[floor_name]
        scale = 1e3
        rows.append([phase, hf.median * scale, hf.summary()["iqr"] * scale,
                     hf.first_s * scale, hf_packed.median * scale, tq_.median * scale,
                     tq_.summary()["iqr"] * scale, tq_.first_s * scale,
                     None if nopack is None else nopack.median * scale,
                     None if replan is None else replan.median * scale, ratio,
                     f"{best:.2f} ({fastest})",
                     None if nopack is None else nopack.median / hf.median,
                     (hf.peak_rss_bytes or 0) / 2**20, (hf_packed.peak_rss_bytes or 0) / 2**20,
                     (tq_.peak_rss_bytes or 0) / 2**20, GOALS.get(phase),
                     None if floor is None else floor.median * scale,
                     None if floor is None else tq_.median / floor.median])
        if phase in GOALS:
            record.goal(f"{phase}: tq / fastest transformers ({fastest}) "
                        f"{ratio_text(best, GOALS[phase])} <= {GOALS[phase]}",
                        best <= GOALS[phase])
        print(f"  {phase}: transformers {hf.describe()}; tq {tq_.describe()}"
              + ("" if floor is None else f"; {floor_name} {floor.describe()}"), flush=True)
    columns = ["phase", "transformers ms", "IQR", "cold ms", "transformers packed ms", "tq ms",
               "IQR", "cold ms", "tq nopack ms", "tq replan ms", "tq/transformers",
               "tq/fastest transformers",
               "nopack/transformers", "transformers peak MiB", "packed peak MiB",
               "tq peak MiB", "goal", "floor ms", "tq/floor"]
    record.table("main", columns, rows, note=f"prompt {seq} tokens, {args.new} new; decode is "
                 "per token; cold = the first call (a new process's first request); "
                 "transformers packed: its linear layers' weights packed once with "
                 "tensorql's packing code and rule; the goal is against the fastest "
                 "transformers form; tq replan (prefill cold): a new length re-binds its "
                 "plan, never padded into a longer one's; "
                 "floor: the model's weight products alone -- of one token (decode: gemv floor) "
                 "or of the prompt, packed (prefill: gemm floor).")
    from tables import render_table

    print(render_table(record.data, "main").rsplit("\n\n", 1)[0])
    return record.finish()


if __name__ == "__main__":
    sys.exit(main())
