"""Plans as graphs: EXPLAIN's ``format="json" | "dot" | "mermaid"``.

A plan (the physical plan, or the logical plan after the rewrite rules) becomes one JSON
document, from which the DOT (Graphviz) and mermaid texts are drawn. The document's schema
(``"schema": "tensorql.plan/1"``)::

    {"schema": "tensorql.plan/1",
     "stage": "physical" | "logical",
     "title": str | null,
     "devices": int,                    # devices the plan is placed on (1: not partitioned)
     "rules_fired": [str],              # logical rewrite rules that changed the plan
     "nodes": [{"id": str,              # "s3" (physical step 3) or "n0" (logical node 0)
                "name": str,            # the step's (node's) name, as in the text EXPLAIN
                "relation": str,        # labels, shape, dtype, chunk grid
                # physical only:
                "step": int, "tasks": int, "tasks_by_device": {"0": int, ...},
                "est_flops": float, "est_bytes_in": int, "est_bytes_out": int,
                "sent": [{"from": int, "to": int, "bytes": int}],  # its chunks between devices
                # with analyze (physical only), what the run measured:
                "measured": {"busy_ms": float, "span_ms": float, "bytes_read": int}}],
     "edges": [{"from": str, "to": str}],   # "from" is read by "to" (data flows along it)
     "outputs": [str]}                  # the nodes whose values are the query's results

>>> import numpy as np, tensorql as tq
>>> db = tq.connect()
>>> A = db.from_numpy("A", np.ones((4, 6), np.float32), tile=(2, 3))
>>> query = tq.einsum("ij->i", A).compile()
>>> doc = plan_json(query.physical)
>>> [n["name"] for n in doc["nodes"]], doc["edges"]
(['Scan A', 'Aggregate sum over [j]'], [{'from': 's0', 'to': 's1'}])
>>> print(to_mermaid(doc))
flowchart BT
  s0["Scan A<br/>(d0,d1) 4x6 float32 grid 2x2 of 2x3<br/>tasks=4"]
  s1["Aggregate sum over [j]<br/>(i) 4 float32 grid 2 of 2<br/>tasks=4"]
  s0 --> s1
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tensorql.errors import OptionError
from tensorql.exec.run_types import RunStats
from tensorql.logical.plan import LogicalNode, node_title, walk
from tensorql.physical.explain import _step_inputs, step_transfers
from tensorql.physical.planner import PhysicalPlan
from tensorql.units import format_bytes

SCHEMA = "tensorql.plan/1"


def plan_json(plan: PhysicalPlan, stats: RunStats | None = None,
              title: str | None = None) -> dict[str, Any]:
    """The physical plan as a JSON-ready dict (see the module's schema): a node per step, an
    edge per step read by another; with ``stats`` what the run measured per step."""
    moves = step_transfers(plan) if plan.partition is not None else {}
    nodes = []
    for step in plan.steps:
        per_dev: dict[str, int] = {}
        for task in step.tasks:
            per_dev[str(task.device)] = per_dev.get(str(task.device), 0) + 1
        node: dict[str, Any] = {
            "id": f"s{step.id}", "name": step.name, "relation": step.relation.describe(),
            "step": step.id, "tasks": len(step.tasks), "tasks_by_device": per_dev,
            "est_flops": float(step.est_flops), "est_bytes_in": int(step.est_bytes_in),
            "est_bytes_out": int(step.est_bytes_out),
            "sent": [{"from": a, "to": b, "bytes": v}
                     for (a, b), v in sorted(moves.get(step.id, {}).items())]}
        measured = stats.steps.get(step.id) if stats is not None else None
        if measured is not None:
            node["measured"] = {"busy_ms": measured.busy_s * 1e3,
                                "span_ms": measured.span_s * 1e3,
                                "bytes_read": int(measured.bytes_read)}
        nodes.append(node)
    edges = [{"from": f"s{src}", "to": f"s{sid}"}
             for sid, sources in _step_inputs(plan).items() for src in sources]
    return {"schema": SCHEMA, "stage": "physical", "title": title, "devices": plan.devices,
            "rules_fired": list(plan.rules_fired), "nodes": nodes, "edges": edges,
            "outputs": [f"s{s.id}" for s in plan.output_steps]}


def logical_json(roots: tuple[LogicalNode, ...], title: str | None = None,
                 rules_fired: tuple[str, ...] = ()) -> dict[str, Any]:
    """The logical plan from ``roots`` as a JSON-ready dict (see the module's schema): a node
    per operator (a shared one once), an edge per input."""
    order = walk(*roots)
    ids = {id(node): f"n{k}" for k, node in enumerate(order)}
    nodes = [{"id": ids[id(node)], "name": node_title(node),
              "relation": node.relation.describe()} for node in order]
    edges = [{"from": ids[id(child)], "to": ids[id(node)]}
             for node in order for child in dict.fromkeys(node.inputs)]
    return {"schema": SCHEMA, "stage": "logical", "title": title, "devices": 1,
            "rules_fired": list(rules_fired), "nodes": nodes, "edges": edges,
            "outputs": [ids[id(r)] for r in dict.fromkeys(roots)]}


def _lines(node: dict[str, Any]) -> list[str]:
    """The text of a node's box: name, relation, tasks (per device), bytes sent, measured."""
    out = [node["name"], node["relation"]]
    if "tasks" in node:
        tasks = f"tasks={node['tasks']}"
        if len(node["tasks_by_device"]) > 1:
            tasks += " (" + " ".join(f"dev{d}:{c}" for d, c in
                                     sorted(node["tasks_by_device"].items())) + ")"
        out.append(tasks)
    for sent in node.get("sent", ()):
        out.append(f"sent dev{sent['from']}->dev{sent['to']} {format_bytes(sent['bytes'])}")
    if "measured" in node:
        out.append(f"busy={node['measured']['busy_ms']:.1f}ms "
                   f"span={node['measured']['span_ms']:.1f}ms")
    return out


def to_dot(doc: dict[str, Any]) -> str:
    """The plan document as a Graphviz DOT digraph (``dot -Tsvg``): a box per node, an
    arrow per edge, the outputs drawn bold."""
    def quote(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    outputs = set(doc["outputs"])
    out = [f"digraph {quote('tensorql ' + doc['stage'] + ' plan')} {{",
           "  rankdir=BT;", '  node [shape=box, fontname="monospace"];']
    if doc.get("title"):
        out.append(f"  label={quote(doc['title'])};")
    for node in doc["nodes"]:
        label = quote("\n".join(_lines(node))).replace("\n", "\\n")
        style = ", style=bold" if node["id"] in outputs else ""
        out.append(f"  {node['id']} [label={label}{style}];")
    out += [f"  {e['from']} -> {e['to']};" for e in doc["edges"]]
    out.append("}")
    return "\n".join(out)


def to_mermaid(doc: dict[str, Any]) -> str:
    """The plan document as a mermaid flowchart (renders in GitHub's Markdown)."""
    def label(node: dict[str, Any]) -> str:
        text = "<br/>".join(_lines(node))
        return text.replace('"', "#quot;")

    out = ["flowchart BT"]
    out += [f'  {node["id"]}["{label(node)}"]' for node in doc["nodes"]]
    out += [f"  {e['from']} --> {e['to']}" for e in doc["edges"]]
    return "\n".join(out)


FORMATS: dict[str, Callable[[dict[str, Any]], str]] = {
    "json": lambda doc: json.dumps(doc, indent=2),
    "dot": to_dot,
    "mermaid": to_mermaid,
}


def render_doc(doc: dict[str, Any], fmt: str) -> str:
    """The plan document in format ``fmt`` (a key of :data:`FORMATS`)."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise OptionError(f"unknown EXPLAIN format {fmt!r}; choose one of text, "
                          f"{', '.join(FORMATS)}")
    return FORMATS[fmt](doc)
