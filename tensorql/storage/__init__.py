"""Storage: where chunks live at rest. ``ChunkStore`` is the interface; stores implement it."""

from tensorql.storage.chunk_store import ChunkStore, TensorMeta
from tensorql.storage.memory_store import MemoryChunkStore

__all__ = ["ChunkStore", "TensorMeta", "MemoryChunkStore"]
