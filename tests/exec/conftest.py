"""Fixtures for the runtime tests (kept local so tests/exec runs on its own)."""

from __future__ import annotations

import numpy as np
import pytest

import tensorql as tq


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def db():
    with tq.connect(workers=2) as database:
        yield database
