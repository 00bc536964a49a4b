"""An EINSUM's result as a stream of element rows for DuckDB: the rows of a result too large
to hold densely (past ``Options.process_memory_limit``) flow chunk by chunk into the
statement around the call (``SELECT count(*) FROM EINSUM(...) WHERE ...``).

The query runs on a thread of its own and hands each result chunk, as Arrow element rows,
through a bounded queue to the ``RecordBatchReader`` DuckDB scans; DuckDB pulling rows is what
lets the run go on, so at most a few chunks wait at any time. A statement that stops reading
early (``LIMIT``) stops the run.

>>> import numpy as np, tensorql as tq
>>> from tensorql.pipeline import CompiledQuery
>>> db = tq.connect()
>>> a = db.from_numpy("a", np.arange(6.0).reshape(3, 2), tile=(2, 2))
>>> reader = chunk_rows(CompiledQuery.compile((a * 10).node, db), ("i", "j"))
>>> sorted(reader.read_all().to_pylist(), key=lambda r: (r["i"], r["j"]))[-1]
{'i': 2, 'j': 1, 'val': 50.0}
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch

from tensorql.dtypes import torch_dtype
from tensorql.sql.relations import tensor_rows

__all__ = ["chunk_rows"]

QUEUE_CHUNKS = 2  # result chunks waiting for DuckDB at most


class _Stopped(Exception):
    """The reader was closed before the run finished (the statement read no further)."""


_DONE = object()


def chunk_rows(compiled: Any, labels: Sequence[str]) -> pa.RecordBatchReader:
    """The element rows (``labels`` as int64 columns, then ``val``) of ``compiled``'s result,
    one record batch per result chunk, computed as they are read."""
    relation = compiled.physical.result_step.relation
    tile = relation.grid.tile
    empty = torch.empty((0,) * len(labels), dtype=torch_dtype(relation.dtype))
    schema = tensor_rows(empty, labels).schema
    return pa.RecordBatchReader.from_batches(schema, _batches(compiled, labels, tile, schema))


def _batches(compiled: Any, labels: Sequence[str], tile: Sequence[int],
             schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    chunks: queue.Queue = queue.Queue(maxsize=QUEUE_CHUNKS)
    stop = threading.Event()

    def sink(key: tuple[int, ...], chunk: torch.Tensor) -> None:
        rows = tensor_rows(chunk, labels)
        columns = [pc.add(rows.column(d), pa.scalar(key[d] * tile[d], pa.int64()))
                   for d in range(len(labels))] + [rows.column(len(labels))]
        batch = pa.Table.from_arrays(columns, schema=schema).combine_chunks().to_batches()
        for piece in batch:
            _put(piece)

    def _put(item: Any) -> None:
        while True:
            if stop.is_set():
                raise _Stopped()
            try:
                chunks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def run() -> None:
        try:
            compiled.stream(sink)
            _put(_DONE)
        except _Stopped:
            pass
        except BaseException as err:  # noqa: BLE001 - raised where the rows are read
            try:
                _put(err)
            except _Stopped:
                pass

    worker = threading.Thread(target=run, name="tensorql-einsum-rows", daemon=True)
    worker.start()
    try:
        while True:
            item = chunks.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # read to the end, failed or closed early: the run stops
        while worker.is_alive():
            try:
                chunks.get(timeout=0.1)
            except queue.Empty:
                pass
        worker.join()
