"""The distributed exchange's GPU paths on the CPU: a recording fake of ``tensorql.cuda_api``
and the ``meta`` device standing in for GPU memory, torch.distributed's calls replaced by
recorders (nothing crosses a wire).

* A chunk received through NCCL is handed to its consumer only once the stream that received
  it is done: NCCL's ``wait()`` orders the waiting thread's current stream only, and the
  consumer runs on another (finding 3).
* Chunks a rank wrote back to the host under a memory limit are moved to the rank's
  communication device before ``torch.cat`` and NCCL see them; that device is the rank's
  GPU, whatever the group's backend string says (finding 5).
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

import tensorql.cuda_api as cuda_api
from tensorql.devices import DeviceSet
from tensorql.exec.distributed import RankLayout, RankPart, _ExchangeSides, communication_device
from tensorql.exec.exchanges import Exchange
from tensorql.exec.memplan import Op
from tensorql.exec.taskgraph import ChunkRef

GPU = torch.device("meta")  # the fake's device memory


class Recording(cuda_api.TorchCuda):
    """One GPU whose memory is ``meta``; records what is asked of streams and events."""

    name = "recording fake cuda"

    def __init__(self) -> None:
        self.calls: list[object] = []

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def torch_device(self, index: int) -> torch.device:
        return GPU

    def set_device(self, device: torch.device) -> None:
        self.calls.append(("set_device", device))

    def current_stream(self, device: torch.device | None = None) -> object:
        return f"current stream of {device}"

    def event(self, enable_timing: bool = False) -> object:
        calls = self.calls

        class Event:
            def record(self, stream: object) -> None:
                calls.append(("record", stream))

            def synchronize(self) -> None:
                calls.append("synchronize")

        return Event()


class Work:
    def __init__(self, calls: list[object]) -> None:
        self.calls = calls

    def wait(self) -> None:
        self.calls.append("wait")


def _rank_part(collective_device: torch.device = GPU) -> RankPart:
    rt = SimpleNamespace(layout=RankLayout(rank=0, world=2), group=None, exchange_group=None,
                         collective_device=collective_device)
    return RankPart(rt)  # type: ignore[arg-type]


def _send(op_id: int, src: int, dst: int, from_host: bool = False) -> Op:
    return Op(op_id, "send", dst, ChunkRef(7, (op_id,)), (), 16, "d2d", src_device=src,
              from_host=from_host)


def _run(host: dict | None = None, values: dict | None = None) -> SimpleNamespace:
    gpu = SimpleNamespace(kind="cuda", torch_device=GPU)
    remote = SimpleNamespace(kind="remote", torch_device=torch.device("cpu"))
    meta = {ChunkRef(7, (i,)): ((4,), "float32") for i in range(4)}
    return SimpleNamespace(
        devices=[gpu, remote], events=queue.SimpleQueue(), inflight={},
        graph=SimpleNamespace(chunk_meta=meta, step_name=lambda s: f"step {s}"),
        host=SimpleNamespace(get=lambda ref: (host or {})[ref]),
        values=[values or {}, {}], allocate=lambda op: None, ops=[])


def test_a_received_chunk_is_handed_over_once_its_stream_is_done():
    fake = Recording()
    part, run = _rank_part(), _run()
    with cuda_api.use(fake):
        part._transfer(run, _send(0, 1, 0), True, 1, Work(fake.calls),
                       torch.empty(4, device=GPU), 0.0)
    done = run.events.get_nowait()
    assert done.error is None and done.value.device == GPU
    # wait() orders this thread's stream after NCCL's; the host then waits for that stream
    assert fake.calls == ["wait", ("record", f"current stream of {GPU}"), "synchronize"]


def test_a_sent_chunk_needs_no_wait_for_a_stream():
    fake = Recording()
    part, run = _rank_part(), _run()
    with cuda_api.use(fake):
        part._transfer(run, _send(0, 0, 1), False, 1, Work(fake.calls),
                       torch.empty(4, device=GPU), 0.0)
    assert run.events.get_nowait().value == 16
    assert fake.calls == ["wait"]


def test_an_exchange_is_done_once_its_stream_is():
    fake = Recording()
    part, run = _rank_part(), _run()
    with cuda_api.use(fake):
        part._exchange_done(run, Exchange(0, 7, (0,)), Work(fake.calls),
                            torch.empty(4, device=GPU), 0.0)
    done = run.events.get_nowait()
    assert done.error is None and done.op_id == -1
    assert fake.calls == ["wait", ("record", f"current stream of {GPU}"), "synchronize"]


def test_chunks_written_back_to_the_host_travel_from_the_gpu(monkeypatch):
    """An exchange sending one chunk from the GPU and one from its host copy: one buffer on
    the GPU (torch.cat of a host and a GPU tensor fails; NCCL takes GPU tensors only)."""
    fake = Recording()
    on_gpu, on_host = _send(0, 0, 1), _send(1, 0, 1, from_host=True)
    run = _run(host={on_host.ref: torch.ones(4)}, values={on_gpu.ref: torch.empty(4, device=GPU)})
    run.ops = [on_gpu, on_host]
    part = _rank_part()
    part.sides = [_ExchangeSides([[], [on_gpu, on_host]], [[], []])]
    issued = []

    def all_to_all_single(received, send, out_splits, in_splits, group=None, async_op=False):
        issued.append((received.device, send.device, list(in_splits)))
        return Work(fake.calls)

    monkeypatch.setattr(torch.distributed, "all_to_all_single", all_to_all_single)
    with cuda_api.use(fake):
        part._issue(run, Exchange(0, 7, (0, 1)))
        done = run.events.get(timeout=10)  # awaited on a transfer thread
    assert done.error is None
    assert issued == [(GPU, GPU, [0, 8])]


def test_a_point_to_point_send_of_a_host_copy_travels_from_the_gpu(monkeypatch):
    fake = Recording()
    op = _send(0, 0, 1, from_host=True)
    run = _run(host={op.ref: torch.ones(4)})
    part = _rank_part()
    sent = []
    monkeypatch.setattr(torch.distributed, "isend",
                        lambda tensor, dst, tag, group: sent.append(tensor.device) or
                        Work(fake.calls))
    with cuda_api.use(fake):
        part.start_transfer(run, op)
        assert run.events.get(timeout=10).error is None
    assert sent == [GPU]


@pytest.mark.parametrize("spec,expected", [("cpu", torch.device("cpu")), ("cuda:0", GPU),
                                           (["cpu:0", "cuda:0"], GPU)])
def test_the_communication_device_is_the_ranks_gpu(spec, expected):
    """Not picked from the backend's name: a group of "cpu:gloo,cuda:nccl" is never "nccl"
    (the buffers stayed on the host), and the current device is no rank's own."""
    with cuda_api.use(Recording()):
        assert communication_device(DeviceSet.parse(spec)) == expected
