"""EXPLAIN as pictures: format="json" | "dot" | "mermaid" for the physical and logical plans,
and a run's timeline as Chrome-trace JSON (issue 32)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import tensorql as tq
from tensorql.logical.plan import walk
from tensorql.physical.explain import _step_inputs


def _query(db):
    rng = np.random.default_rng(0)
    a = db.from_numpy("A", rng.standard_normal((8, 6)).astype(np.float32), tile=(4, 3))
    b = db.from_numpy("B", rng.standard_normal((6, 4)).astype(np.float32), tile=(3, 2))
    return (tq.einsum("ij,jk->ik", a, b) * 2.0).sum(1)


def _dependencies(plan) -> set[tuple[str, str]]:
    return {(f"s{src}", f"s{sid}") for sid, srcs in _step_inputs(plan).items() for src in srcs}


def test_physical_plan_as_json_dot_and_mermaid():
    with tq.connect() as db:
        expr = _query(db)
        plan = expr.compile().physical
        doc = json.loads(expr.explain(format="json"))
        assert doc["schema"] == "tensorql.plan/1" and doc["stage"] == "physical"
        assert [n["step"] for n in doc["nodes"]] == [s.id for s in plan.steps]
        assert [n["tasks"] for n in doc["nodes"]] == [len(s.tasks) for s in plan.steps]
        assert [n["name"] for n in doc["nodes"]] == [s.name for s in plan.steps]
        edges = {(e["from"], e["to"]) for e in doc["edges"]}
        assert edges == _dependencies(plan) and len(doc["edges"]) == len(edges)
        assert doc["outputs"] == [f"s{plan.result_step.id}"]
        assert all(n["sent"] == [] for n in doc["nodes"])  # one device: nothing sent

        dot = expr.explain(format="dot")
        assert dot.startswith('digraph "tensorql physical plan" {') and dot.endswith("}")
        assert len(re.findall(r"^  s\d+ \[label=", dot, re.M)) == len(plan.steps)
        assert set(re.findall(r"^  (s\d+) -> (s\d+);$", dot, re.M)) == edges
        assert len(re.findall(r"^  \S+ -> \S+;$", dot, re.M)) == len(edges)

        mermaid = expr.explain(format="mermaid")
        assert mermaid.splitlines()[0] == "flowchart BT"
        assert len(re.findall(r'^  s\d+\["', mermaid, re.M)) == len(plan.steps)
        assert set(re.findall(r"^  (s\d+) --> (s\d+)$", mermaid, re.M)) == edges
        assert expr.explain() == expr.explain(format="text")  # the text is the default


def test_logical_plan_as_a_graph():
    with tq.connect() as db:
        expr = _query(db)
        plan = expr.compile().physical
        nodes = walk(plan.root, *plan.also)
        doc = json.loads(expr.explain(stage="logical", format="json"))
        assert doc["stage"] == "logical" and len(doc["nodes"]) == len(nodes)
        assert len(doc["edges"]) == sum(len(set(map(id, n.inputs))) for n in nodes)
        assert doc["nodes"][0]["name"].startswith("Scan ")
        ids = {n["id"] for n in doc["nodes"]}
        assert all(e["from"] in ids and e["to"] in ids for e in doc["edges"])
        dot = expr.explain(stage="logical", format="dot")
        assert len(re.findall(r"^  \S+ -> \S+;$", dot, re.M)) == len(doc["edges"])
        with pytest.raises(tq.OptionError, match="text only"):
            expr.explain(stage="memory", format="dot")
        with pytest.raises(tq.OptionError, match="unknown EXPLAIN format 'svg'"):
            expr.explain(format="svg")


def test_partitioned_plan_shows_tasks_by_device_and_transfers():
    with tq.connect(devices=2, workers=2) as db:
        expr = _query(db)
        plan = expr.compile().physical
        doc = json.loads(expr.explain(format="json"))
        assert doc["devices"] == 2 and len(doc["nodes"]) == len(plan.steps)
        for node, step in zip(doc["nodes"], plan.steps):
            by_device = {}
            for task in step.tasks:
                by_device[str(task.device)] = by_device.get(str(task.device), 0) + 1
            assert node["tasks_by_device"] == by_device
        from tensorql.physical.explain import step_transfers

        sent = {(n["step"], s["from"], s["to"]): s["bytes"] for n in doc["nodes"]
                for s in n["sent"]}
        assert sent == {(sid, a, b): v for sid, pairs in step_transfers(plan).items()
                        for (a, b), v in pairs.items()}
        assert {(e["from"], e["to"]) for e in doc["edges"]} == _dependencies(plan)


def test_analyze_json_has_measured_figures():
    with tq.connect() as db:
        doc = json.loads(_query(db).explain(analyze=True, format="json"))
        assert all(n["measured"]["busy_ms"] >= 0 for n in doc["nodes"])


def test_trace_has_one_event_per_task(tmp_path):
    path = tmp_path / "run.json"
    with tq.connect(devices="cpu", workers=2) as db:  # the trace's lanes are cpu:0's
        expr = _query(db)
        plan = expr.compile().physical
        assert "measured: wall" in expr.explain(analyze=True, trace=str(path))
        with pytest.raises(tq.OptionError, match="analyze=True"):
            expr.explain(trace=str(path))
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events and all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    names = {s.id: s.name for s in plan.steps}
    # a task is a compute op, a scan's task its load from the store: each exactly once
    ran = [(e["args"]["step"], tuple(e["args"]["chunk"])) for e in events
           if e["cat"] == "compute" or e["args"]["op"].endswith("from rest")]
    tasks = [(s.id, tuple(t.output.key)) for s in plan.steps for t in s.tasks]
    assert sorted(ran) == sorted(tasks)
    for e in events:
        step_name = names[e["args"]["step"]]
        assert e["name"] == (step_name if e["cat"] == "compute" else f"{e['cat']} {step_name}")
    processes = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    lanes = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert [p["args"]["name"] for p in processes] == ["cpu:0"]
    assert {(e["pid"], e["tid"]) for e in events} <= lanes


def test_duckdb_backend_draws_the_plan_and_refuses_a_trace(tmp_path):
    with tq.connect(backend="duckdb") as db:
        expr = _query(db)
        doc = json.loads(expr.explain(analyze=True, format="json"))
        assert len(doc["nodes"]) == len(expr.compile().physical.steps)
        with pytest.raises(tq.UnsupportedError, match="native backend"):
            expr.explain(analyze=True, trace=str(tmp_path / "run.json"))
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("trace, words", [
    (5, "takes a file path, got int 5"),  # was opened as file descriptor 5
    ("", "takes a file path, got str ''"),
    ("{missing}/t.json", "the directory .* does not exist"),
    ("{tmp}", "that is a directory, not a file"),
])
def test_a_trace_that_cannot_be_a_new_file_is_refused_before_the_run(tmp_path, trace, words):
    if isinstance(trace, str):
        trace = trace.format(tmp=tmp_path, missing=tmp_path / "missing")
    with tq.connect(devices="cpu") as db:
        expr = _query(db)
        with pytest.raises(tq.OptionError, match=words):
            expr.explain(analyze=True, trace=trace)


@pytest.mark.parametrize("kwargs, error", [
    ({"stage": ["logical"]}, tq.TensorQLError), ({"stage": {}}, tq.TensorQLError),
    ({"format": ["dot"]}, tq.OptionError), ({"format": {}, "stage": "logical"}, tq.OptionError),
])
def test_an_unhashable_stage_or_format_is_named(kwargs, error):
    """Found by fuzzing (s9): explain(stage=['logical']) raised TypeError: unhashable type."""
    from tensorql.physical.plan_graph import render_doc

    db = tq.connect()
    with pytest.raises(error, match="unknown EXPLAIN (stage|format)"):
        _query(db).explain(**kwargs)
    with pytest.raises(tq.OptionError, match="unknown EXPLAIN format"):
        render_doc({}, ["dot"])
