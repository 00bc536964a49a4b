"""A timeline picture of a run: one row per device lane, one bar per op (self-contained HTML).

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
from typing import Any

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
