"""LLaMA prefill and decode: tensorql vs Hugging Face transformers on the same random model.

    python bench/llama.py [--tiny] [--seq 512] [--new 16] [--repeat 3]

One random-weight ``LlamaForCausalLM`` (~100M parameters: vocab 32000, hidden 768, 8 layers,
12 query / 4 key-value heads, SwiGLU 2048; fp32) is built from a ``LlamaConfig`` (nothing is
downloaded) and loaded into tensorql (weights in the DuckDB store). Measured in the same run:

- prefill: logits of a ``--seq``-token prompt (tensorql: ``Llama.prefill``, one query
  planned once per prompt shape and run for each prompt, as a server would; transformers:
  ``model(ids)`` with its default attention implementation). The time of a query planned
  from scratch (``Llama.logits(ids).torch()``) is printed too, for information,
- decode: seconds per new token with a KV cache (tensorql: ``Llama.decoder``, one cached
  plan per token over a static cache, planned once before the clock starts; transformers:
  ``model(token, past_key_values=...)``), averaged over ``--new`` tokens.

Each contender runs in turn, ``--repeat`` times (transformers, tensorql, transformers, ...),
and the medians are compared: on a host whose speed drifts, timing one side's runs before
the other's showed ratios 10% apart from run to run.

Goals: prefill tq/transformers <= 1.0, decode <= 1.2. Exits 1 on a miss (not with --tiny).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
import transformers
from timing import alternating_medians  # bench/timing.py

import tensorql as tq
from tensorql.models import KVCache, Llama

FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke run)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    seq = min(args.seq, 32) if args.tiny else args.seq

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(TINY if args.tiny else FULL))
    model = transformers.LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    db = tq.connect()
    ours = Llama.from_transformers(db, model)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(1, seq))
    print(f"model: {params / 1e6:.1f}M parameters fp32, prompt {seq} tokens, "
          f"{torch.get_num_threads()} torch threads, transformers {transformers.__version__} "
          f"(attention: {model.config._attn_implementation})")

    with torch.no_grad():
        hf_logits = model(torch.from_numpy(ids)).logits
        tq_logits = ours.logits(ids).torch()
        err = float((hf_logits - tq_logits).abs().max())
        prefill = ours.prefill(1, seq)
        # planned once, before the clock (and checked like the query planned from scratch)
        err = max(err, float((hf_logits - prefill.logits(ids)).abs().max()))
        hf_prefill, tq_prefill, tq_scratch = alternating_medians(
            [lambda: model(torch.from_numpy(ids)), lambda: prefill.logits(ids),
             lambda: ours.logits(ids).torch()], args.repeat)

        def hf_decode_run() -> float:
            out = model(torch.from_numpy(ids), use_cache=True)  # the prompt, off the clock
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(args.new):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return (time.perf_counter() - start) / args.new

        def tq_decode_run() -> float:
            logits, cache = ours.step(ids, KVCache(()))
            token_id = int(logits[0].argmax())
            decoder = ours.decoder(cache, seq + args.new + 1)  # planned once, off the clock
            start = time.perf_counter()
            for _ in range(args.new):
                logits = decoder.step([[token_id]])
                token_id = int(logits[0].argmax())
            return (time.perf_counter() - start) / args.new

        decode_times: list[list[float]] = [[], []]
        for _ in range(args.repeat):  # alternating, like the prefills
            decode_times[0].append(hf_decode_run())
            decode_times[1].append(tq_decode_run())
        hf_decode, tq_decode = (statistics.median(kept) for kept in decode_times)

    prefill_ratio, decode_ratio = tq_prefill / hf_prefill, tq_decode / hf_decode
    print(f"logits max abs difference: {err:.2e}")
    print("| phase | transformers | tensorql | tq/transformers | goal |")
    print("|---|---|---|---|---|")
    print(f"| prefill ({seq} tokens) | {hf_prefill * 1e3:.1f} ms | {tq_prefill * 1e3:.1f} ms | "
          f"{prefill_ratio:.2f}x | <= 1.0x |")
    print(f"| prefill planned from scratch (information) | | {tq_scratch * 1e3:.1f} ms | "
          f"{tq_scratch / hf_prefill:.2f}x | |")
    print(f"| decode (per token) | {hf_decode * 1e3:.1f} ms | {tq_decode * 1e3:.1f} ms | "
          f"{decode_ratio:.2f}x | <= 1.2x |")
    met = prefill_ratio <= 1.0 and decode_ratio <= 1.2
    print(f"goals: {'met' if met else 'MISSED'}")
    return 0 if met or args.tiny else 1


if __name__ == "__main__":
    sys.exit(main())
