"""A pytest plugin that writes each failure's report to a file *as the test ends*.

pytest prints the reasons for its failures at the end of a session; a suite stopped at its
time cap (gpu-check's CPU suite on a device machine, whose lease is minutes) never gets there,
and twice that left failures named but unexplained. With ``-p failure_log`` and
``TENSORQL_FAILURE_LOG=<file>`` every failing test's report (its phase, its traceback as
``--tb`` formats it) is appended to the file when the test ends; under xdist only the
controller writes (the workers' reports reach it as they finish).

    TENSORQL_FAILURE_LOG=/tmp/failures.txt python -m pytest -p failure_log -n 4 tests
"""

from __future__ import annotations

import os

import pytest

_controller = True


def pytest_configure(config: pytest.Config) -> None:
    global _controller
    _controller = not hasattr(config, "workerinput")  # an xdist worker has it


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("TENSORQL_FAILURE_LOG")
    if not (path and _controller and report.failed):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"===== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
