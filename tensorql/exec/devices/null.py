"""Null device: runs nothing, records the order work was issued in, in virtual time.

For scheduler tests: every unit of work takes ``cost / speed[lane]`` virtual seconds (costs come
from the plan: FLOPs or bytes), lanes run concurrently, and completions come back in virtual
time order from a :class:`SimClock` shared by the run's null devices.

>>> clock = SimClock()
>>> dev = NullDevice("null:0", clock=clock)
>>> dev.open(lambda c: None)
>>> dev.submit("h2d", 1, lambda: None, cost=2e9); dev.submit("compute", 2, lambda: None, cost=1e9)
>>> [(c.op_id, c.ended) for c in (clock.pop(), clock.pop())]
[(2, 1.0), (1, 2.0)]
>>> dev.log
[('h2d', 1), ('compute', 2)]
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from tensorql.exec.devices.base import Completion, Device, Post


class SimClock:
    """Virtual time: pending completions in order of their end time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Completion]] = []
        self._seq = 0

    def schedule(self, completion: Completion) -> None:
        heapq.heappush(self._heap, (completion.ended, self._seq, completion))
        self._seq += 1

    def pending(self) -> bool:
        return bool(self._heap)

    def pop(self) -> Completion:
        ended, _, completion = heapq.heappop(self._heap)
        self.now = max(self.now, ended)
        return completion


class NullDevice(Device):
    kind = "null"
    is_null = True

    def __init__(self, name: str = "null:0", *, clock: SimClock | None = None,
                 lanes: dict[str, int] | None = None,
                 speed: dict[str, float] | None = None) -> None:
        super().__init__(name, lanes or {"compute": 1, "h2d": 1, "d2h": 1, "d2d": 1})
        self.clock = clock or SimClock()
        self.speed = {"compute": 1e9, "h2d": 1e9, "d2h": 1e9, "d2d": 1e9, **(speed or {})}
        self.log: list[tuple[str, int]] = []
        self._lane_free: dict[str, list[float]] = {}

    def open(self, post: Post) -> None:
        self.log = []
        self._lane_free = {lane: [0.0] * n for lane, n in self.lanes.items()}

    def close(self) -> None:
        pass

    def submit(self, lane: str, op_id: int, fn: Callable[[], Any], cost: float = 0.0) -> None:
        self.log.append((lane, op_id))
        free = self._lane_free[lane]
        slot = min(range(len(free)), key=free.__getitem__)
        start = max(self.clock.now, free[slot])
        end = start + cost / self.speed[lane]
        free[slot] = end
        self.clock.schedule(Completion(op_id, start, end))
