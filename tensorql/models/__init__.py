"""Workload builders: MLP, multi-head attention and LLaMA decoder blocks as einsum graphs.

>>> import tensorql as tq
>>> from tensorql.models import mlp
>>> w = mlp(tq.connect(), batch=4, d_model=6, d_ff=8)
>>> w.output.shape, bool(abs(w.output.numpy() - w.reference()).max() < 1e-4)
((4, 6), True)
"""

from tensorql.models.llama import Decoder, KVCache, Llama, LlamaShape, Prefill, PromptQuery
from tensorql.models.workloads import Workload, attention, llama, llama_block, mlp

__all__ = ["Decoder", "KVCache", "Llama", "LlamaShape", "Prefill", "PromptQuery", "Workload",
           "attention", "llama", "llama_block", "mlp"]
