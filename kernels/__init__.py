"""Chunk kernels (installed as ``tensorql_kernels``): pure torch functions on one chunk each.

They know nothing of plans, stores or devices; the executor calls them.
"""
