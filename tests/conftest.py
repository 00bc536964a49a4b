"""Shared fixtures: a fresh in-memory database per test, seeded RNGs, deterministic
hypothesis examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings

import tensorql as tq

# every hypothesis test draws the same examples on every run (no example database either)
settings.register_profile("tensorql", derandomize=True, database=None, deadline=None)
settings.load_profile("tensorql")


@pytest.fixture
def db():
    with tq.connect(workers=2) as database:
        yield database


@pytest.fixture(scope="module")
def db1():
    """One session on one device, shared by a module's tests (user-defined operator tests)."""
    with tq.connect(workers=2) as database:
        yield database


@pytest.fixture(scope="module")
def db3():
    """One session on three CPU devices, shared by a module's tests."""
    with tq.connect(devices=3) as database:
        yield database


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite the golden plan files under tests/fixtures/explain")


@pytest.fixture(scope="session", autouse=True)
def _the_cpu_suite_means_the_cpu():
    """On a machine with a GPU, ``devices="auto"`` (the default) is the GPUs; the CPU suite
    compares CPU results against CPU oracles (bit for bit in places) and runs the ``tensorql``
    command in subprocesses, so it says once that it means the CPU: ``TENSORQL_DEVICES=cpu``
    for the whole session (sessions and subprocesses read it through ``Options.from_env``).
    The GPU tests (marked ``gpu``) name their CUDA devices. Nothing changes without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TENSORQL_DEVICES", "cpu")
        yield


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch and numpy global seeds."""
    torch.manual_seed(0)
    np.random.seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_cuda(request):
    """A recording fake of ``torch.cuda`` installed process-wide (``tests/fake_cuda.py``):
    two devices by default; parametrize indirectly with a dict of ``FakeCuda`` keyword
    arguments for others. Fails the test if the strict device check recorded a violation."""
    from fake_cuda import FakeCuda

    import tensorql.cuda_api as cuda_api

    fake = FakeCuda(**{"devices": 2, **getattr(request, "param", {})})
    with cuda_api.use(fake):
        yield fake
    fake.assert_clean()
