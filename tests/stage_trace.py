"""The modules one query passes through, measured (used by tests/test_structure.py and
docs/architecture.md's hand trace).

:func:`stage_modules` runs ``expr.numpy()`` under a profiler and lists, in order of first
entry, the modules of tensorql and tensorql_kernels whose functions it calls -- leaving out
the *leaf* modules: records and helpers every stage reads (foundation modules, plan records,
storage's encodings), which a reader of the trace does not step into. A package that
implements one stage counts once: the rewrite rules (``logical.rules``), the partition stage
(``optimizer``), the device classes (``exec.devices``) and the chunk kernels
(``tensorql_kernels``). :func:`stage_calls` counts the calls of each stage's entry function.
"""

from __future__ import annotations

import sys
import threading

LEAVES = frozenset({
    # the package's lazy public names (``tq.einsum`` looked up on first use)
    "__init__",
    # foundation: any layer may call them
    "dag", "grid", "dtypes", "units", "options", "devices", "algebra", "errors",
    "kernels.algebra",
    # records the stages pass along (their properties and constructors)
    "logical.plan", "physical.planner", "exec.taskgraph", "exec.run_types", "exec.run_state",
    "einsum.graph", "physical.result",
    # storage's encodings below the chunk store, and the allocator switch
    "storage.sql_text", "storage.pages", "storage.blob_codec", "storage.chunk_store",
    "exec.host_malloc",
})
GROUPS = {"logical.rules": "logical.rules", "optimizer": "optimizer",
          "exec.devices": "exec.devices", "kernels": "kernels"}
# the entry function of each stage: a query calls each once
ENTRIES = {("logical.lower", "lower"), ("logical.rules", "rewrite"),
           ("physical.builder", "build"), ("exec.engine", "run")}


def _module(filename: str) -> str | None:
    for root, prefix in (("/tensorql/", ""), ("/kernels/", "kernels.")):
        if root in filename and "/site-packages/" not in filename.split(root)[0][-20:]:
            name = prefix + filename.split(root, 1)[1].removesuffix(".py").replace("/", ".")
            name = name.removesuffix(".__init__")
            for group, label in GROUPS.items():
                if name == group or name.startswith(group + "."):
                    return label
            return name
    return None


def stage_modules(run) -> tuple[list[str], dict[tuple[str, str], int]]:
    """The non-leaf modules ``run()`` enters, in order of first entry, and how many times
    each stage's entry function (:data:`ENTRIES`) is called."""
    order: list[str] = []
    calls: dict[tuple[str, str], int] = {}

    def profile(frame, event, arg):
        if event == "call":
            name = _module(frame.f_code.co_filename)
            if name is not None and name not in LEAVES and name not in order:
                order.append(name)
            entry = (name, frame.f_code.co_name)
            if entry in ENTRIES:
                calls[entry] = calls.get(entry, 0) + 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return order, calls
