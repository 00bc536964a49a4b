"""EXPLAIN: render a plan as a deterministic tree, with measured figures after a run.

Each line is one physical step: what it does, its output relation (labels, shape, dtype,
chunk grid), the number of chunk tasks and the estimates; ``analyze`` adds wall time spent in
the step's tasks, bytes read from the store and bytes produced. Runs on the event-driven runtime
add a ``devices:`` section: per device busy time, bytes moved in and out of device memory, copy
time overlapped with compute, peak memory against the budget, evictions and reloads.

"""

from __future__ import annotations

from tensorql.exec.run_types import RunStats
from tensorql.logical.plan import Aggregate, Join, LogicalNode
from tensorql.physical.planner import PhysicalPlan, Step
from tensorql.units import format_bytes, format_flops


def render_plan(plan: PhysicalPlan, stats: RunStats | None = None,
                title: str | None = None, extra: list[str] | None = None) -> str:
    """The plan as text; with ``stats`` it is EXPLAIN ANALYZE."""
    if plan.partition is not None:
        return render_partitioned(plan, stats, title, extra)
    lines: list[str] = []
    if title:
        lines.append(title)
    total_bytes_in = sum(s.est_bytes_in for s in plan.steps)
    lines.append(
        f"estimate: {format_flops(plan.est_flops)}, {len(plan.steps)} steps, "
        f"{sum(len(s.tasks) for s in plan.steps)} chunk tasks, "
        f"{format_bytes(total_bytes_in)} chunk reads"
    )
    lines.extend(_rules_line(plan))
    if stats is not None:
        lines.append(
            f"measured: wall {stats.wall_s * 1e3:.1f} ms on {stats.where}, "
            f"busy {stats.busy_s * 1e3:.1f} ms, read {format_bytes(stats.bytes_read)} from "
            f"store, peak live chunks {format_bytes(stats.peak_live_bytes)}"
        )
    device_lines = getattr(stats, "device_lines", None)  # the event-driven runtime's figures
    if device_lines is not None:
        lines.append("devices:")
        lines.extend(device_lines())
    lines.extend(extra or [])
    seen: set[int] = set()
    roots = (plan.root, *plan.also)
    for k, root in enumerate(roots):
        if len(roots) > 1:
            lines.append(f"output {k}:")
        _render(plan, root, "", "", lines, stats, seen)
    return "\n".join(lines)


def _rules_line(plan: PhysicalPlan) -> list[str]:
    """The logical rewrite rules that changed the plan, as a line (none when none did)."""
    return [f"rewrite rules: {', '.join(plan.rules_fired)}"] if plan.rules_fired else []


def _describe(step: Step, node: LogicalNode) -> str:
    rel = step.node.relation.describe()
    head = step.name
    if isinstance(step.node, Aggregate) and isinstance(node, Aggregate):
        join = node.input
        if isinstance(join, Join) and len(join.sources) == 2:
            head += f" <- Join {join.join} on [{', '.join(join.on)}]"
        elif isinstance(join, Join) and len(set(join.input_labels[0])) < len(
                join.input_labels[0]):
            head += " <- diagonal"
    return f"{head}  {rel}"


def _render(plan: PhysicalPlan, node: LogicalNode, prefix: str, child_prefix: str,
            lines: list[str], stats: RunStats | None, seen: set[int]) -> None:
    step = plan.steps[plan.step_of[id(node)]]
    text = f"{prefix}[{step.id}] {_describe(step, node)}"
    figures = f"tasks={len(step.tasks)}"
    if step.est_flops:
        figures += f" est={format_flops(step.est_flops)}"
    figures += f" in={format_bytes(step.est_bytes_in)} out={format_bytes(step.est_bytes_out)}"
    if stats is not None:
        st = stats.steps.get(step.id)
        if st is not None:
            figures += (f" | busy={st.busy_s * 1e3:.1f}ms span={st.span_s * 1e3:.1f}ms"
                        f" [{st.first_start * 1e3:.1f}..{st.last_end * 1e3:.1f}ms]")
            if st.bytes_read:
                figures += f" read={format_bytes(st.bytes_read)}"
    lines.append(f"{text}\n{child_prefix}    {figures}")
    if step.id in seen:
        lines[-1] = f"{prefix}[{step.id}] (shared, see above)"
        return
    seen.add(step.id)
    children = _children(plan, node, step.id)
    for n, child in enumerate(children):
        last = n == len(children) - 1
        _render(plan, child, child_prefix + ("└─ " if last else "├─ "),
                child_prefix + ("   " if last else "│  "), lines, stats, seen)


def _children(plan: PhysicalPlan, node: LogicalNode, sid: int) -> list[LogicalNode]:
    """The inputs of ``node``'s step: a join fused into its aggregate, or a pointwise node
    fused into this step, shows its own inputs instead."""
    children = list(node.inputs)
    if isinstance(node, Aggregate) and isinstance(node.input, Join):
        children = list(node.input.inputs)
    out: list[LogicalNode] = []
    for child in children:
        if plan.step_of.get(id(child)) == sid and child is not node:
            out.extend(c for c in _children(plan, child, sid) if c not in out)
        elif child not in out:
            out.append(child)
    return out


def step_transfers(plan: PhysicalPlan) -> dict[int, dict[tuple[int, int], int]]:
    """Bytes each step's chunks are sent between devices, ``{step: {(src, dst): bytes}}``: a
    chunk read on a device other than the one computing it is sent there once."""
    where = {t.output: t.device for s in plan.steps for t in s.tasks}
    sizes = plan.task_graph().chunk_bytes
    out: dict[int, dict[tuple[int, int], int]] = {}
    seen: set = set()
    for step in plan.steps:
        for task in step.tasks:
            for ref in task.inputs:
                src = where[ref]
                if src != task.device and (ref, task.device) not in seen:
                    seen.add((ref, task.device))
                    pair = out.setdefault(ref.step, {})
                    pair[(src, task.device)] = pair.get((src, task.device), 0) + sizes[ref]
    return out


def render_partitioned(plan: PhysicalPlan, stats: RunStats | None = None,
                       title: str | None = None, extra: list[str] | None = None) -> str:
    """A partitioned plan as a tree (each step over the steps it reads, named as on one
    device): per step its tasks by device and the bytes its chunks are sent between
    devices; with ``stats`` the measured run and the bytes really copied per pair."""
    n = plan.devices
    moves = step_transfers(plan)
    predicted = sum(sum(pairs.values()) for pairs in moves.values())
    lines = [title] if title else []
    lines.append(f"estimate: {format_flops(plan.est_flops)}, {len(plan.steps)} steps, "
                 f"{sum(len(s.tasks) for s in plan.steps)} chunk tasks on {n} devices, "
                 f"{format_bytes(predicted)} sent between devices")
    lines.extend(_rules_line(plan))
    if stats is not None:
        moved = getattr(stats, "moved", None) or [[0] * n for _ in range(n)]
        lines.append(f"measured: wall {stats.wall_s * 1e3:.1f} ms on {stats.where}, "
                     f"busy {stats.busy_s * 1e3:.1f} ms, read {format_bytes(stats.bytes_read)} "
                     f"from store, {format_bytes(sum(map(sum, moved)))} copied between devices")
        via_host = getattr(stats, "moved_via_host", None)
        if via_host and any(map(any, via_host)):
            lines[-1] += f" directly, {format_bytes(sum(map(sum, via_host)))} through the host"
        device_lines = getattr(stats, "device_lines", None)
        if device_lines is not None:
            lines.append("devices:")
            lines.extend(device_lines())
        lines.append("bytes copied (row: from device, column: to device):")
        lines.extend("  dev" + str(src) + ": " + " ".join(format_bytes(b) for b in row)
                     for src, row in enumerate(moved))
        if via_host and any(map(any, via_host)):  # a memory limit sent some through the host
            lines.append("bytes through the host (row: written back by device, column: "
                         "loaded by device):")
            lines.extend("  dev" + str(src) + ": " + " ".join(format_bytes(b) for b in row)
                         for src, row in enumerate(via_host))
    lines.extend(extra or [])

    def figures(step: Step) -> str:
        per_dev: dict[int, int] = {}
        for task in step.tasks:
            per_dev[task.device] = per_dev.get(task.device, 0) + 1
        placed = " ".join(f"dev{d}:{c}" for d, c in sorted(per_dev.items()))
        text = f"tasks={len(step.tasks)} ({placed})"
        if step.est_flops:
            text += f" est={format_flops(step.est_flops)}"
        sent = moves.get(step.id)
        if sent:
            text += " sent " + ", ".join(f"dev{a}->dev{b} {format_bytes(v)}"
                                         for (a, b), v in sorted(sent.items()))
        if stats is not None and (st := stats.steps.get(step.id)) is not None:
            text += f" | busy={st.busy_s * 1e3:.1f}ms span={st.span_s * 1e3:.1f}ms"
        return text

    children = _step_inputs(plan)
    seen: set[int] = set()

    def render(sid: int, prefix: str, child_prefix: str) -> None:
        step = plan.steps[sid]
        if sid in seen:
            lines.append(f"{prefix}[{sid}] (shared, see above)")
            return
        seen.add(sid)
        lines.append(f"{prefix}[{sid}] {step.name}  {step.relation.describe()}\n"
                     f"{child_prefix}    {figures(step)}")
        for n, child in enumerate(children[sid]):
            last = n == len(children[sid]) - 1
            render(child, child_prefix + ("└─ " if last else "├─ "),
                   child_prefix + ("   " if last else "│  "))

    outputs = [s.id for s in plan.output_steps]
    for k, sid in enumerate(outputs):
        if len(outputs) > 1:
            lines.append(f"output {k}:")
        render(sid, "", "")
    for step in plan.steps:  # (every step feeds a result; this is a safeguard)
        if step.id not in seen:
            render(step.id, "", "")
    return "\n".join(lines)


def _step_inputs(plan: PhysicalPlan) -> dict[int, list[int]]:
    """For each step, the steps its tasks read, in order of first use (the tree of a
    partitioned plan: its partials, reduce-scatter parts, slices and assembled regions are
    steps between an operation and the ones it reads)."""
    out: dict[int, list[int]] = {}
    for step in plan.steps:
        found = out.setdefault(step.id, [])
        for task in step.tasks:
            for ref in task.inputs:
                if ref.step != step.id and ref.step not in found:
                    found.append(ref.step)
    return out
