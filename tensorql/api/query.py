"""Compatibility alias: the compile/run/explain pipeline now lives in :mod:`tensorql.pipeline`.

>>> from tensorql.api.query import CompiledQuery
>>> CompiledQuery.__module__
'tensorql.pipeline'
"""

from tensorql.pipeline import CompiledQuery

__all__ = ["CompiledQuery"]
