"""A timeline of a run: one row per device lane, one bar per op, as self-contained HTML
(:func:`timeline_html`) or as Chrome-trace JSON for Perfetto / chrome://tracing
(:func:`chrome_trace`; ``explain(analyze=True, trace="run.json")`` writes one).

Run with ``Runtime(..., timeline=True)``; then ``timeline_html(result.stats)``.

>>> from tensorql.exec.runtime import RuntimeStats, TimelineEvent
>>> stats = RuntimeStats(wall_s=1.0, timeline=[TimelineEvent("cpu:0", "compute", "compute",
...                                                         "compute s1[0]", 0.0, 0.5)])
>>> html = timeline_html(stats)
>>> html.count("<rect"), "cpu:0 compute" in html
(1, True)
"""

from __future__ import annotations

import html as _html
import json
import os
from typing import Any

from tensorql.errors import ExecutionError, OptionError, StorageError

_COLOURS = {"compute": "#4e79a7", "load": "#f28e2b", "send": "#59a14f", "d2h": "#e15759",
            "fetch": "#b07aa1"}


def timeline_html(stats: Any, width: int = 1200, row: int = 22) -> str:
    """The run's ops as an SVG Gantt chart inside a small HTML page."""
    events = list(stats.timeline)
    lanes = sorted({(e.device, e.lane) for e in events})
    span = max([stats.wall_s] + [e.end for e in events]) or 1.0
    label_w = 140
    scale = (width - label_w) / span
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{row * (len(lanes) + 1)}" font-family="monospace" font-size="11">']
    for n, (device, lane) in enumerate(lanes):
        parts.append(f'<text x="2" y="{row * n + 15}">{_html.escape(device)} {lane}</text>')
    index = {lane: n for n, lane in enumerate(lanes)}
    for e in events:
        y = row * index[(e.device, e.lane)] + 3
        x = label_w + e.start * scale
        w = max(0.5, (e.end - e.start) * scale)
        colour = _COLOURS.get(e.kind, "#999")
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" '
                     f'fill="{colour}"><title>{_html.escape(e.label)} '
                     f'{e.start * 1e3:.2f}..{e.end * 1e3:.2f} ms</title></rect>')
    parts.append(f'<text x="{label_w}" y="{row * len(lanes) + 15}">0 .. '
                 f'{span * 1e3:.1f} ms</text></svg>')
    return ("<!doctype html><html><head><meta charset='utf-8'><title>tensorql timeline"
            "</title></head><body>" + "".join(parts) + "</body></html>")


def chrome_trace(stats: Any, step_names: dict[int, str] | None = None) -> dict[str, Any]:
    """The run's ops as a Chrome-trace document (the JSON Perfetto and chrome://tracing
    open): a complete event (``"ph": "X"``, ``ts`` and ``dur`` in microseconds) per op, its
    ``name`` the step's name (from ``step_names``) for a compute op (one per task; a scan's
    task is its load from the store), else the op's kind and the step's name (``load Scan
    A``, ``d2h ...``); ``pid`` is the device, ``tid`` the lane on it (both named by metadata
    events); ``args`` hold the op's description, step and chunk key.

    >>> from tensorql.exec.runtime import RuntimeStats, TimelineEvent
    >>> stats = RuntimeStats(wall_s=1.0, timeline=[TimelineEvent("cpu:0", "compute",
    ...     "compute", "compute s1[0] @dev0", 0.25, 0.5)])
    >>> [e for e in chrome_trace(stats)["traceEvents"] if e["ph"] == "X"]
    [{'name': 'compute', 'cat': 'compute', 'ph': 'X', 'ts': 250000.0, 'dur': 250000.0, \
'pid': 0, 'tid': 0, 'args': {'op': 'compute s1[0] @dev0'}}]
    """
    events = list(getattr(stats, "timeline", None) or ())
    if not events:
        raise ExecutionError("the run recorded no timeline (run it with timeline=True, on "
                             "the native backend's runtime)")
    devices = sorted({e.device for e in events})
    pid = {d: k for k, d in enumerate(devices)}
    lanes = sorted({(e.device, e.lane) for e in events})
    tid = {lane: k for k, lane in enumerate(lanes)}
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid[d], "args": {"name": d}}
        for d in devices]
    out += [{"name": "thread_name", "ph": "M", "pid": pid[d], "tid": tid[(d, lane)],
             "args": {"name": lane}} for d, lane in lanes]
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        ref = getattr(e, "ref", None)
        step = getattr(ref, "step", None)
        name = e.kind
        if step is not None and step_names and step in step_names:
            name = step_names[step] if e.kind == "compute" else f"{e.kind} {step_names[step]}"
        args: dict[str, Any] = {"op": e.label}
        if ref is not None:
            args.update(step=step, chunk=list(ref.key))
        out.append({"name": name, "cat": e.kind, "ph": "X", "ts": e.start * 1e6,
                    "dur": max(0.0, e.end - e.start) * 1e6, "pid": pid[e.device],
                    "tid": tid[(e.device, e.lane)], "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"wall_ms": float(stats.wall_s) * 1e3}}


def check_trace_path(path: Any) -> None:
    """Refuse, before anything runs, a trace destination that cannot be a new file: not a
    path (an int would be taken as an open file descriptor), a directory, or a file in a
    directory that does not exist.

    >>> check_trace_path(5)
    Traceback (most recent call last):
    ...
    tensorql.errors.OptionError: explain(trace=...) takes a file path, got int 5
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise OptionError(f"explain(trace=...) takes a file path, got {type(path).__name__} "
                          f"{path!r}")
    target = os.path.abspath(os.fspath(path))
    if os.path.isdir(target):
        raise OptionError(f"explain(trace={path!r}): that is a directory, not a file")
    if not os.path.isdir(os.path.dirname(target)):
        raise OptionError(f"explain(trace={path!r}): the directory "
                          f"{os.path.dirname(target)!r} does not exist")


def write_trace(path: Any, stats: Any, step_names: dict[int, str] | None = None) -> None:
    """Write :func:`chrome_trace` of ``stats`` to the file ``path`` (StorageError naming the
    file when it cannot be written)."""
    check_trace_path(path)
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(chrome_trace(stats, step_names), fh)
    except OSError as err:
        raise StorageError(f"cannot write the trace to {os.fspath(path)!r}: "
                           f"{err.strerror or err}") from err
