"""The ``tensorql`` logger (issue 32): silent by default (a NullHandler), planning and
spilling decisions at INFO / DEBUG for applications that configure logging."""

from __future__ import annotations

import logging

import numpy as np

import tensorql as tq


def _operands(db):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    y = rng.standard_normal((48, 40)).astype(np.float32)
    return db.from_numpy("a", x), db.from_numpy("b", y), np.maximum(x @ y, 0).sum(axis=1)


def _messages(caplog) -> list[str]:
    assert all(r.name == "tensorql" or r.name.startswith("tensorql.") for r in caplog.records)
    return [r.getMessage() for r in caplog.records]


def test_silent_by_default():
    logger = logging.getLogger("tensorql")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert logger.level == logging.NOTSET  # the application decides what is shown


def test_engine_strategy_and_rules_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="tensorql")
    with tq.connect(workers=2) as db:
        a, b, want = _operands(db)
        np.testing.assert_allclose(((a @ b) + 0.0).relu().sum(axis=1).numpy(), want,
                                   rtol=1e-4, atol=1e-3)
    messages = _messages(caplog)
    assert any(m.startswith("engine strategy ") and "tasks" in m for m in messages)
    assert "rewrite rules fired: fuse_pointwise" in messages
    assert all(r.levelno == logging.DEBUG for r in caplog.records)  # nothing louder here
    caplog.clear()
    caplog.set_level(logging.INFO, logger="tensorql")
    with tq.connect(workers=2) as db:
        a, b, _ = _operands(db)
        (a @ b).numpy()
    assert not caplog.records  # one device, no limit: nothing at INFO


def test_partitioning_replanning_and_evictions_at_info(caplog):
    caplog.set_level(logging.INFO, logger="tensorql")
    with tq.connect(devices=2, workers=2) as db:
        a, b, _ = _operands(db)
        (a @ b).numpy()
    messages = _messages(caplog)
    assert any(m.startswith("partitioned for 2 devices (strategy auto): ") and " moved " in m
               for m in messages)
    caplog.clear()
    with tq.connect(devices=2, workers=2, memory_limit=6 << 10) as db:
        a, b, want = _operands(db)
        result = (a @ b).relu().sum(axis=1).compile().run(dense=True)
        np.testing.assert_allclose(result.dense().numpy(), want, rtol=1e-4, atol=1e-3)
    messages = _messages(caplog)
    evicted = sum(d.evictions for d in result.stats.devices)
    reloaded = sum(d.reloads for d in result.stats.devices)
    assert evicted > 0 and reloaded > 0
    spilled = tq.units.format_bytes(result.stats.spilled_bytes)
    assert f"memory limit: {evicted} chunk(s) evicted from device memory, {reloaded} " \
        f"reloaded; {spilled} of host copies beyond the pinned pool" in messages
    partitioned = [m for m in messages if m.startswith("partitioned for 2 devices")]
    assert len(partitioned) == 1 and partitioned[0].endswith(" (memory_limit 6.0 KiB)")
