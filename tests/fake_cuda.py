"""A recording fake of :mod:`tensorql.cuda_api`: the CUDA device class's own code in CPU CI.

``FakeCuda`` answers everything tensorql asks of ``torch.cuda`` (``is_available`` is True, N
devices, streams, events, pinned host memory, device-memory queries). Device memory is the
``meta`` device: tensors with a shape and a dtype but no data, so any read of device data on
the host (``.item()``, ``.tolist()``, a copy out) has nothing to read.

While work runs on a fake stream (inside ``stream_context``, i.e. on the runtime's lane
threads) a :class:`StrictDevice` dispatch mode watches every aten op and records a
*violation* (and raises :class:`FakeCudaViolation`) when an op

* mixes device (meta) tensors with CPU tensors other than 0-dim CPU scalars in ops that take
  such scalars (plain meta is lax: ``torch.mm(meta, cpu)`` succeeds, so the mode checks);
* syncs to the host (``.item()``, ``nonzero``, ...) or copies device data to the host outside
  a stream made for device-to-host copies (label ``d2h``);
* reads a tensor another stream wrote before that write is known complete to the reading
  stream: the reader waited on an event recorded after it (``wait_event``), or the host saw
  that event or the writer's stream complete (``synchronize``, ``query``);
* reads a tensor of another fake device in anything but a copy.

It also checks frees: a device tensor used on a stream other than the one that allocated it
must not be freed before that use is known complete (the caching allocator would hand its
block to the allocating stream at once).

Copies to the host give CPU tensors of the right shape and dtype filled with ``fill`` (NaN by
default; zeros for integer dtypes), so runs complete; their values mean nothing.

Events complete ``event_seconds`` of wall time after the previous one on their stream (0 by
default), so a test can see how many ops the runtime keeps in flight. ``blas_workspace``
bytes are allocated per (thread, stream) pair on the first matrix product there, as cuBLAS
does, and counted in ``memory_allocated``/``max_memory_allocated``.

>>> import torch
>>> import tensorql.cuda_api as cuda_api
>>> fake = FakeCuda(devices=2)
>>> with cuda_api.use(fake):
...     api = cuda_api.current()
...     s = api.stream(api.torch_device(0), label="h2d")
...     with api.stream_context(s):
...         x = torch.ones(4, 4).to(api.torch_device(0))
...     x.device.type, api.device_count()
('meta', 2)
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten


class FakeCudaViolation(AssertionError):
    """A rule of the fake's strict device check was broken (also kept in ``fake.violations``)."""


# ops that read device data on the host
_HOST_SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
              aten.masked_select.default, aten.equal.default, aten.item.default}
# ops that take 0-dim CPU scalars beside device tensors only through TensorIterator: fused
# and foreach kernels and BLAS want every tensor on the device
_NO_CPU_SCALARS_PREFIXES = ("_fused_", "_foreach_")
_NO_CPU_SCALARS = {"mm", "bmm", "addmm", "addmm_", "baddbmm", "matmul", "cat", "stack"}
_BLAS = {"mm", "bmm", "addmm", "addmm_", "baddbmm", "baddbmm_", "addbmm", "matmul", "linear",
         "_addmm_activation"}


@dataclass(eq=False)
class FakeStream:
    """A stream of one fake device: a counter of the ops issued on it."""

    fake: FakeCuda
    device: int
    label: str
    id: int
    seq: int = 0
    seen: dict[int, int] = field(default_factory=dict)  # stream id -> seq known complete here
    busy_until: float = 0.0

    def wait_event(self, event: FakeEvent) -> None:
        with self.fake.lock:
            self.fake.log.append(("wait_event", self.label, event.stream.label if event.stream
                                  else None))
            if event.stream is not None:
                sid = event.stream.id
                self.seen[sid] = max(self.seen.get(sid, 0), event.seq)

    def wait_stream(self, other: FakeStream) -> None:
        event = self.fake.event()
        event.record(other)
        self.wait_event(event)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or self.fake.event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.fake._host_sync("stream.synchronize")
        with self.fake.lock:
            until = self.busy_until
        _sleep_until(until)
        self.fake._complete(self, self.seq)

    def query(self) -> bool:
        if time.perf_counter() >= self.busy_until:
            self.fake._complete(self, self.seq)
            return True
        return False


@dataclass(eq=False)
class FakeEvent:
    """An event: the point of its stream it was recorded at, and when that point completes."""

    fake: FakeCuda
    enable_timing: bool = False
    stream: FakeStream | None = None
    seq: int = 0
    recorded_at: float = 0.0
    complete_at: float = 0.0
    observed: bool = False

    def record(self, stream: FakeStream | None = None) -> None:
        fake = self.fake
        stream = stream or fake.current_stream()
        now = time.perf_counter()
        with fake.lock:
            self.stream, self.seq, self.recorded_at = stream, stream.seq, now
            seconds = fake.event_seconds
            if isinstance(seconds, dict):
                seconds = seconds.get(stream.label, 0.0)
            self.complete_at = max(now, stream.busy_until) + seconds
            stream.busy_until = self.complete_at
            self.observed = False
            fake.events_recorded += 1
            fake._pending.add(self)
            compute = sum(1 for e in fake._pending if e.enable_timing
                          and e.stream is not None and e.stream.label == "compute")
            fake.max_pending_compute_events = max(fake.max_pending_compute_events, compute)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.fake.current_stream()).wait_event(self)

    def query(self) -> bool:
        if self.stream is None:
            return True
        if time.perf_counter() >= self.complete_at:
            self._done()
            return True
        return False

    def synchronize(self) -> None:
        self.fake._host_sync("event.synchronize")
        if self.stream is None:
            return
        _sleep_until(self.complete_at)
        self._done()

    def _done(self) -> None:
        assert self.stream is not None
        self.fake._complete(self.stream, self.seq)
        with self.fake.lock:
            self.observed = True
            self.fake._pending.discard(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds between two completed events, as torch.cuda.Event.elapsed_time."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs events created with enable_timing=True")
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time of an event that has not completed")
        return max(0.0, end.complete_at - self.complete_at) * 1e3


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


@dataclass
class _Tag:
    """Where a device tensor's storage lives and which stream ops wrote and read it."""

    device: int
    alloc_stream: FakeStream | None
    write_stream: FakeStream | None
    write_seq: int
    nbytes: int
    uses: dict[int, tuple[FakeStream, int]] = field(default_factory=dict)


class FakeCuda:
    """A fake of :class:`tensorql.cuda_api.TorchCuda` that records what is done (see module).

    ``devices``: how many; ``capacity``: bytes of memory of each; ``event_seconds``: the
    simulated device time of the work between two events on a stream (or a dict of it by
    stream label); ``blas_workspace``:
    bytes of the per (thread, stream) workspace of the first matrix product there;
    ``fill``: the value of copies to the host; ``strict``: raise at the first violation
    (they are recorded either way)."""

    name = "fake cuda"

    def __init__(self, devices: int = 1, capacity: int = 16 << 30, *,
                 event_seconds: float | dict[str, float] = 0.0, blas_workspace: int = 0,
                 fill: float = math.nan, strict: bool = True) -> None:
        self.devices = devices
        self.capacity = capacity
        self.event_seconds = event_seconds
        self.blas_workspace = blas_workspace
        self.fill = fill
        self.strict = strict
        self.lock = threading.RLock()
        self.violations: list[str] = []
        self.log: list[tuple[Any, ...]] = []
        self.host_syncs: list[tuple[str, str, str]] = []  # (what, thread, stream label)
        self.events_recorded = 0
        self.events_created = 0
        self.record_h2d = False  # keep a copy of the host data of each H2D copy
        self.h2d_sources: list[torch.Tensor] = []
        self.max_pending_compute_events = 0
        self.ops_on_device = 0
        self.ops_by_device: dict[int, int] = {}
        self.ops_by_label: dict[str, int] = {}
        self.ops_by_name: dict[str, int] = {}  # aten op name -> calls on device data
        self.copies: dict[str, int] = {"h2d": 0, "d2h": 0, "d2d": 0}
        self.pinned_bytes = 0
        self._pending: set[FakeEvent] = set()
        self._done: dict[int, int] = {}  # stream id -> seq the host knows complete
        self._ids = itertools.count(1)
        self._streams: list[FakeStream] = []
        self._default = [self._new_stream(i, "default") for i in range(devices)]
        self._tls = threading.local()
        self._tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._pinned: list[tuple[int, int, weakref.ref]] = []
        self._allocated = [0] * devices
        self._peak = [0] * devices
        self._workspaces: set[tuple[int, int]] = set()  # (handle, stream id)
        self._handles: set[int] = set()
        self._free_handles: list[int] = []
        self._keep: list[torch.Tensor] = []  # workspaces live as long as the fake

    # -- presence -----------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.devices

    def torch_device(self, index: int) -> torch.device:
        """``meta:index``: meta tensors (they drop the index) stand in for device memory."""
        return torch.device("meta", index)

    def set_device(self, device: torch.device) -> None:
        self._tls.device = _index(device)

    def device_of(self, tensor: torch.Tensor) -> int | None:
        if tensor.device.type != "meta":
            return None
        tag = self._tag_of(tensor)
        return tag.device if tag is not None else 0

    # -- streams and events -------------------------------------------------------------
    def _new_stream(self, device: int, label: str) -> FakeStream:
        stream = FakeStream(self, device, label, next(self._ids))
        self._streams.append(stream)
        return stream

    def stream(self, device: torch.device, label: str = "") -> FakeStream:
        with self.lock:
            return self._new_stream(_index(device), label or "stream")

    @contextlib.contextmanager
    def stream_context(self, stream: FakeStream) -> Iterator[FakeStream]:
        previous = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            with StrictDevice(self):
                yield stream
        finally:
            self._tls.stream = previous

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        stream = getattr(self._tls, "stream", None)
        if stream is not None and (device is None or _index(device) == stream.device):
            return stream
        index = _index(device) if device is not None else getattr(self._tls, "device", 0)
        return self._default[index]

    def event(self, enable_timing: bool = False, blocking: bool = False) -> FakeEvent:
        with self.lock:
            self.events_created += 1
        return FakeEvent(self, enable_timing)

    def synchronize(self, device: torch.device | None = None) -> None:
        self._host_sync("synchronize")
        index = _index(device) if device is not None else None
        for stream in list(self._streams):
            if index is None or stream.device == index:
                _sleep_until(stream.busy_until)
                self._complete(stream, stream.seq)

    # -- memory ---------------------------------------------------------------------------
    def total_memory(self, device: torch.device) -> int:
        return self.capacity

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return self.capacity - self._allocated[_index(device)], self.capacity

    def memory_allocated(self, device: torch.device) -> int:
        return self._allocated[_index(device)]

    def max_memory_allocated(self, device: torch.device) -> int:
        return self._peak[_index(device)]

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        index = _index(device)
        self._peak[index] = self._allocated[index]

    def memory_reserved(self, device: torch.device) -> int:
        return self._peak[_index(device)]

    def blas_workspace_bytes(self, device: torch.device) -> int:
        return self.blas_workspace

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """Ordinary host memory, marked pinned in the fake's own books."""
        buf = torch.empty(int(nbytes), dtype=torch.uint8)
        with self.lock:
            self._pinned.append((buf.data_ptr(), buf.nbytes, weakref.ref(buf)))
            self.pinned_bytes += buf.nbytes
        return buf

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or tensor.nbytes == 0:
            return False
        ptr = tensor.data_ptr()
        with self.lock:
            return any(start <= ptr and ptr + tensor.nbytes <= start + size
                       for start, size, ref in self._pinned if ref() is not None)

    # -- what the strict mode reports --------------------------------------------------------
    def current_stream_or_none(self) -> FakeStream | None:
        return getattr(self._tls, "stream", None)

    def violate(self, message: str) -> None:
        with self.lock:
            self.violations.append(message)
        if self.strict:
            raise FakeCudaViolation(message)

    def _host_sync(self, what: str) -> None:
        stream = self.current_stream_or_none()
        with self.lock:
            self.host_syncs.append((what, threading.current_thread().name,
                                    stream.label if stream is not None else ""))

    def _complete(self, stream: FakeStream, seq: int) -> None:
        with self.lock:
            self._done[stream.id] = max(self._done.get(stream.id, 0), seq)
            for event in [e for e in self._pending if e.stream is stream and e.seq <= seq
                          and e.complete_at <= time.perf_counter()]:
                event.observed = True
                self._pending.discard(event)

    def visible(self, reader: FakeStream, writer: FakeStream | None, seq: int) -> bool:
        """Whether work on ``reader`` is ordered after op ``seq`` of ``writer``."""
        if writer is None or writer is reader:
            return True
        with self.lock:
            return (reader.seen.get(writer.id, 0) >= seq
                    or self._done.get(writer.id, 0) >= seq)

    def _tag_of(self, tensor: torch.Tensor) -> _Tag | None:
        with self.lock:  # lane threads tag concurrently
            tag = self._tags.get(tensor)
            if tag is None and tensor._base is not None:
                tag = self._tags.get(tensor._base)
        return tag

    def _new_storage(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        nbytes = tensor.untyped_storage().nbytes()
        tag = _Tag(stream.device, stream, stream, stream.seq, nbytes)
        with self.lock:
            self._tags[tensor] = tag
            self._allocated[tag.device] += nbytes
            self._peak[tag.device] = max(self._peak[tag.device], self._allocated[tag.device])
        weakref.finalize(tensor, self._freed, tag)

    def _freed(self, tag: _Tag) -> None:
        with self.lock:
            self._allocated[tag.device] -= tag.nbytes
            for stream, seq in tag.uses.values():
                if stream is tag.alloc_stream or tag.alloc_stream is None:
                    continue
                if not (self._done.get(stream.id, 0) >= seq
                        or tag.alloc_stream.seen.get(stream.id, 0) >= seq):
                    # not raised: a finalizer may run on any thread at any time
                    self.violations.append(
                        f"a device tensor of {tag.nbytes} bytes allocated on stream "
                        f"{tag.alloc_stream.label} was freed while its use on stream "
                        f"{stream.label} (op {seq}) was not known complete")

    def _handle(self) -> int:
        """This thread's BLAS handle: taken from a pool at first use, given back when the
        thread ends (as torch's handle pool does)."""
        lease = getattr(self._tls, "handle", None)
        if lease is None:
            with self.lock:
                handle = self._free_handles.pop() if self._free_handles else len(self._handles)
                self._handles.add(handle)
            lease = self._tls.handle = _HandleLease(self, handle)
        return lease.handle

    def _workspace(self, stream: FakeStream) -> None:
        key = (self._handle(), stream.id)
        if not self.blas_workspace or key in self._workspaces:
            return
        with self.lock:
            self._workspaces.add(key)
        ws = torch.empty(self.blas_workspace, dtype=torch.uint8, device="meta")
        self._keep.append(ws)
        with self.lock:
            self._allocated[stream.device] += self.blas_workspace
            self._peak[stream.device] = max(self._peak[stream.device],
                                            self._allocated[stream.device])

    def assert_clean(self) -> None:
        """No violation was recorded (the fixture calls this after each test)."""
        if self.violations:
            raise FakeCudaViolation("; ".join(self.violations[:5]))


class _HandleLease:
    def __init__(self, fake: FakeCuda, handle: int) -> None:
        self.fake, self.handle = fake, handle

    def __del__(self) -> None:
        with self.fake.lock:
            self.fake._free_handles.append(self.handle)


def _index(device: Any) -> int:
    if isinstance(device, int):
        return device
    if device is None:
        return 0
    index = torch.device(device).index
    return 0 if index is None else index


def _op_name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


class StrictDevice(TorchDispatchMode):
    """The strict device check of the work on one fake stream (see the module's rules)."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        fake = self.fake
        stream = fake.current_stream_or_none()
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        metas = [t for t in tensors if t.device.type == "meta"]
        name = _op_name(func)
        if stream is None or not (metas or _targets_device(func, kwargs)):
            return func(*args, **kwargs)
        where = f"{name} on stream {stream.label} of fake cuda:{stream.device}"
        if func in _HOST_SYNC and metas:
            fake.violate(f"{where}: a host sync on device data inside a kernel")
        is_copy = func in (aten._to_copy.default, aten.copy_.default)
        if not is_copy:
            strict_scalars = name in _NO_CPU_SCALARS or name.startswith(_NO_CPU_SCALARS_PREFIXES)
            cpu = [t for t in tensors if t.device.type == "cpu"
                   and (t.dim() > 0 or strict_scalars)]
            if cpu and metas:
                fake.violate(f"{where}: mixes device tensors with CPU tensors of shapes "
                             f"{[tuple(t.shape) for t in cpu]}")
        # reads: every device input must be known written on this stream's side
        dst = args[0] if func is aten.copy_.default else None
        for t in metas:
            tag = fake._tag_of(t)
            if tag is None:
                continue
            if tag.device != stream.device and not is_copy:  # a copy may read a peer
                fake.violate(f"{where}: reads a tensor of fake cuda:{tag.device}")
            if t is dst:
                continue
            if not fake.visible(stream, tag.write_stream, tag.write_seq):
                fake.violate(f"{where}: reads a tensor written on stream "
                             f"{tag.write_stream.label} (op {tag.write_seq}) before waiting "
                             "on an event recorded after that write")
        with fake.lock:
            stream.seq += 1
            fake.ops_on_device += 1
            fake.ops_by_device[stream.device] = fake.ops_by_device.get(stream.device, 0) + 1
            fake.ops_by_label[stream.label] = fake.ops_by_label.get(stream.label, 0) + 1
            fake.ops_by_name[name] = fake.ops_by_name.get(name, 0) + 1
        for t in metas:
            tag = fake._tag_of(t)
            if tag is not None:
                with fake.lock:
                    tag.uses[stream.id] = (stream, stream.seq)
        if name in _BLAS and metas:
            fake._workspace(stream)
        # device -> host copies: meta has no data, give the right shape and dtype
        if func is aten._to_copy.default and args[0].device.type == "meta" and \
                torch.device(kwargs.get("device") or "meta").type == "cpu":
            self._d2h(where, stream)
            src = args[0]
            dtype = kwargs.get("dtype") or src.dtype
            return torch.full(tuple(src.shape), self._fill(dtype), dtype=dtype)
        if func is aten.copy_.default and args[0].device.type == "cpu" and \
                args[1].device.type == "meta":
            self._d2h(where, stream)
            return args[0].fill_(self._fill(args[0].dtype))
        out = func(*args, **kwargs)
        self._tag_outputs(func, name, out, stream, args)
        return out

    def _fill(self, dtype: torch.dtype) -> float:
        return self.fake.fill if dtype.is_floating_point or dtype.is_complex else 0

    def _d2h(self, where: str, stream: FakeStream) -> None:
        if stream.label != "d2h":
            self.fake.violate(f"{where}: copies device data to the host outside a "
                              "device-to-host stream (a host sync inside a kernel)")
        with self.fake.lock:
            self.fake.copies["d2h"] += 1

    def _tag_outputs(self, func, name: str, out: Any, stream: FakeStream,  # noqa: ANN001
                     args: tuple) -> None:
        fake = self.fake
        outs = [t for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        if not outs:
            return
        returns = func._schema.returns
        aliasing = bool(returns) and returns[0].alias_info is not None
        if func is aten._to_copy.default and args[0].device.type == "cpu":
            with fake.lock:
                fake.copies["h2d"] += 1
                if fake.record_h2d:
                    fake.h2d_sources.append(args[0].clone())
        if func is aten.copy_.default and isinstance(args[1], torch.Tensor):
            kind = "h2d" if args[1].device.type == "cpu" else "d2d"
            with fake.lock:
                fake.copies[kind] += 1
        for t in outs:
            tag = fake._tag_of(t)
            if aliasing and tag is not None:
                with fake.lock:
                    if returns[0].alias_info.is_write:  # in place: a write on this stream
                        tag.write_stream, tag.write_seq = stream, stream.seq
                        tag.device = stream.device
                    elif t not in fake._tags:
                        fake._tags[t] = tag
                continue
            if tag is None:
                fake._new_storage(t, stream)


def _targets_device(func: Any, kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _fused_adam_tensor_lr_on_meta(params, grads, exp_avgs, exp_avg_sqs,  # noqa: ANN001
                                  max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                                  weight_decay, eps, amsgrad, maximize, grad_scale=None,
                                  found_inf=None) -> None:
    """aten's fused Adam (AdamW) with a tensor lr on the meta device, where torch has no
    kernel for this overload: the CUDA kernel's own checks, and no values (meta tensors have
    none). An lr on the host is read there (the CUDA kernel's ``lr.item()``); one on a device
    must be on the params' and float32 (the kernel reads it through a float pointer), and so
    must each step counter."""
    device = params[0].device
    if lr.device.type != "cpu" and (lr.device != device or lr.dtype != torch.float32):
        raise RuntimeError(f"lr must be a float32 tensor on the params' device {device} "
                           f"(got {lr.dtype} on {lr.device})")
    for step in state_steps:
        if step.device != device or step.dtype != torch.float32:
            raise RuntimeError(f"a step counter must be a float32 tensor on the params' "
                               f"device {device} (got {step.dtype} on {step.device})")


def _register_meta_kernels() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")  # adds kernels for the Meta key only
    for op in ("_fused_adam_.tensor_lr", "_fused_adamw_.tensor_lr"):
        lib.impl(op, _fused_adam_tensor_lr_on_meta, "Meta")
    return lib


# kept alive for the process: the kernels are registered as long as it lives
_META_KERNELS = _register_meta_kernels()


@contextlib.contextmanager
def installed(fake: FakeCuda) -> Iterator[FakeCuda]:
    """Install ``fake`` with :func:`tensorql.cuda_api.use` (what the ``fake_cuda`` fixture
    does)."""
    import tensorql.cuda_api as cuda_api

    with cuda_api.use(fake):
        yield fake


__all__ = ["FakeCuda", "FakeCudaViolation", "FakeEvent", "FakeStream", "StrictDevice",
           "installed"]
