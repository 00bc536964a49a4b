"""Chunk kernels (installed as ``tensorql_kernels``): torch functions on one chunk each, and
the algebra registry (``tensorql_kernels.algebra``) of every join and aggregation they apply.

They know nothing of plans, stores or devices; the executor calls them. The registry is the
one piece of state here: process-wide, the built-in operators plus those the user registers
(``tq.register_join`` / ``tq.register_agg``).
"""
