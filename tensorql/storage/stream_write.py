"""Streaming writes: chunks produced elsewhere (a running query) flow into ``put_tensor``.

:class:`StreamingWrite` runs ``store.put_tensor`` on a writer thread fed by a bounded queue;
the producer calls :meth:`StreamingWrite.put` for each chunk as it completes and blocks while
``max_queued_bytes`` are waiting (backpressure keeps memory bounded by the queue, not by the
tensor). The write stays atomic: ``put_tensor`` publishes the tensor only after its last chunk,
and leaving the ``with`` block by an exception aborts it, so nothing partial is ever visible.

>>> import numpy as np
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.storage.chunk_store import TensorMeta
>>> from tensorql.storage.memory_store import MemoryChunkStore
>>> store = MemoryChunkStore()
>>> meta = TensorMeta("v", (4,), "float32", ChunkGrid((4,), (2,)))
>>> with StreamingWrite(store, meta) as write:
...     write.put((1,), np.full(2, 3, np.float32))
...     write.put((0,), np.ones(2, np.float32))
>>> store.read_dense("v").tolist()
[1.0, 1.0, 3.0, 3.0]
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tensorql.errors import StorageError
from tensorql.grid import Key
from tensorql.storage.chunk_store import ChunkStore, TensorMeta


class WriteAborted(StorageError):
    """The producer of a streaming write failed or was interrupted; nothing was stored."""


class StreamingWrite:
    """``store.put_tensor(meta, ...)`` on a writer thread, fed chunk by chunk by :meth:`put`."""

    def __init__(self, store: ChunkStore, meta: TensorMeta, *, replace: bool = False,
                 max_queued_bytes: int = 64 << 20) -> None:
        self.store, self.meta, self.replace = store, meta, replace
        self.max_queued_bytes = max(1, int(max_queued_bytes))
        self._queue: collections.deque[tuple[Key, Any]] = collections.deque()
        self._queued_bytes = 0
        self._closed = False  # no more chunks will come
        self._aborted: BaseException | None = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._write, name=f"tensorql-store-{meta.name}",
                                        daemon=True)

    def __enter__(self) -> StreamingWrite:
        try:
            self._thread.start()
        except BaseException as err:  # an interrupt while the writer starts: it holds the
            self._settle(err)  # store's write lock waiting for chunks, so end it first
            raise
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        self._settle(error)
        if error is None and self._error is not None:
            raise self._error

    def _settle(self, error: BaseException | None) -> None:
        """Close the queue (aborting the write when ``error``) and wait until the writer has
        committed or rolled back. An interrupt while waiting aborts the write unless it is
        past its last chunk (committing), waits on, and comes through once the writer has
        settled: what the store holds then is final, never a commit still to come."""
        interrupt: BaseException | None = None
        while self._thread.ident is not None:  # (a writer that never started: nothing)
            with self._cond:
                if error is not None and self._aborted is None:
                    self._aborted = error
                self._closed = True
                self._cond.notify_all()
            try:
                self._thread.join()
                break
            except BaseException as err:  # noqa: BLE001 - raised below, once settled
                interrupt = interrupt or err
                error = err
        if interrupt is not None:
            raise interrupt

    def put(self, key: Key, chunk: np.ndarray | torch.Tensor) -> None:
        """Queue one chunk; blocks while the queue is full, raises the writer's error."""
        nbytes = int(chunk.nbytes)
        with self._cond:
            while (self._queue and self._queued_bytes + nbytes > self.max_queued_bytes
                   and self._error is None):
                self._cond.wait()
            if self._error is not None:
                raise StorageError(f"storing tensor {self.meta.name!r} failed: {self._error}") \
                    from self._error
            self._queue.append((key, chunk))
            self._queued_bytes += nbytes
            self._cond.notify_all()

    def _chunks(self) -> Iterator[tuple[Key, Any]]:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._aborted is not None:
                    raise WriteAborted(f"storing tensor {self.meta.name!r} was aborted: "
                                       f"{type(self._aborted).__name__}: {self._aborted}")
                if not self._queue:
                    return
                key, chunk = self._queue.popleft()
                self._queued_bytes -= int(chunk.nbytes)
                self._cond.notify_all()
            yield key, chunk

    def _write(self) -> None:
        try:
            self.store.put_tensor(self.meta, self._chunks(), replace=self.replace)
        except BaseException as err:  # noqa: BLE001 - handed to the producer
            with self._cond:
                self._error = err
                self._queue.clear()
                self._queued_bytes = 0
                self._cond.notify_all()
