"""The device cache of stored chunks (``tensorql/exec/device_cache.py``), on CPU tensors."""

from __future__ import annotations

import torch

from tensorql.exec.device_cache import DeviceCache


class _Store:
    pass


def test_least_recently_used_go_first_within_the_capacity():
    cache = DeviceCache()
    cache.resize(48)  # three chunks of 16 bytes
    store = _Store()
    chunks = {k: torch.full((4,), float(k)) for k in range(4)}
    for k in range(3):
        cache.put((store, ("w", k), "v1"), chunks[k])
    assert cache.get((store, ("w", 0), "v1")) is chunks[0]  # 0 is now the most recent
    cache.put((store, ("w", 3), "v1"), chunks[3])
    assert cache.get((store, ("w", 1), "v1")) is None  # the least recently used went
    assert [cache.get((store, ("w", k), "v1")) is chunks[k] for k in (0, 2, 3)] == [True] * 3
    assert cache.nbytes == 48 and cache.evictions == 1
    cache.resize(16)
    assert len(cache) == 1 and cache.get((store, ("w", 3), "v1")) is chunks[3]
    cache.put((store, ("big",), "v1"), torch.zeros(8))  # beyond the capacity: not kept
    assert cache.get((store, ("big",), "v1")) is None


def test_a_copy_written_in_place_or_of_another_store_is_not_handed_out():
    cache = DeviceCache()
    cache.resize(1 << 10)
    store, other = _Store(), _Store()
    t = torch.zeros(4)
    cache.put((store, ("w", 0), "v1"), t)
    assert cache.get((other, ("w", 0), "v1")) is None
    t.add_(1.0)  # written in place since it was kept
    assert cache.get((store, ("w", 0), "v1")) is None and len(cache) == 0
    handle = {"a dict": "the memory store's version"}
    cache.put((store, ("w", 0), handle), t)
    assert cache.get((store, ("w", 0), dict(handle))) is None  # an equal dict is another
