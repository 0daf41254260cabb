"""The tracer: an observer for the trainer's spans plus the collective observer, recording only
inside traced windows, handing each finished window to the background writer."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from megatron.scan.collectives import CollectiveObserver
from megatron.scan.gpu_counters import GpuCounters
from megatron.scan.host_counters import IterationCounters
from megatron.scan.trace_format import (
    FLAG_BACKWARD,
    FLAG_DEVICE_TIME,
    FLAG_INSTANT,
    TraceWriter,
    WindowRecord,
    clock_pair,
)

# Waiting on the handle of an async collective (not a collective instance itself: group -1).
COLLECTIVE_WAIT = "collective_wait"
# Spans timed on the host even on GPU: they are host work (the data iterator).
HOST_KINDS = frozenset({"data"})
# Spans that set the (microbatch, chunk) context of collectives and layer scopes inside them.
_CONTEXT_KINDS = frozenset({"forward", "backward"})
_NULL = contextlib.nullcontext()


def _current_cuda_device() -> int | None:
    try:
        import torch

        return torch.cuda.current_device()
    except Exception:  # noqa: BLE001 - no CUDA after all: no GPU readings
        return None


@dataclass(frozen=True, slots=True)
class WindowSchedule:
    """`continuous` consecutive traced iterations out of every `interval` (iterations count from 0),
    and every iteration before `dense_until` (the run's first ones), in windows of `interval`."""

    interval: int
    continuous: int
    dense_until: int = 0

    def is_traced(self, iteration: int) -> bool:
        return iteration < self.dense_until or iteration % self.interval < self.continuous

    def is_window_end(self, iteration: int) -> bool:
        if iteration < self.dense_until:
            return iteration % self.interval == self.interval - 1 or iteration == self.dense_until - 1
        return iteration % self.interval == self.continuous - 1


class _Span:
    __slots__ = ("tracer", "kind", "attrs", "start", "context", "host")

    def __init__(self, tracer: "Tracer", kind: str, attrs: dict) -> None:
        self.tracer = tracer
        self.kind = kind
        self.attrs = attrs
        self.host = kind in HOST_KINDS

    def __enter__(self) -> None:
        tracer = self.tracer
        if self.kind in _CONTEXT_KINDS:
            self.context = tracer.context
            get = self.attrs.get
            tracer.context = (get("microbatch", -1), get("chunk", -1))
        self.start = tracer.host_now() if self.host else tracer.mark()

    def __exit__(self, *exc) -> bool:
        tracer = self.tracer
        end = tracer.host_now() if self.host else tracer.mark()
        get = self.attrs.get
        flags = 0 if self.host else tracer.device_flag
        if get("direction") == "B":
            flags |= FLAG_BACKWARD
        if self.kind in _CONTEXT_KINDS:
            tracer.context = self.context
        microbatch, chunk = tracer.context
        tracer.events.append((self.kind, self.start, end, tracer.iteration, get("microbatch", microbatch),
                              get("chunk", chunk), get("bytes", -1), get("peer", -1), -1, get("seq", -1),
                              get("layer", -1), flags, get("dtype")))
        return False


class Tracer:
    """Observer installed with megatron.app.observer.set_observer. Outside a window `span` returns
    a shared null context, so untraced iterations pay one attribute test per span."""

    def __init__(self, *, writer: TraceWriter, timer, schedule: WindowSchedule) -> None:
        self.writer = writer
        self.timer = timer
        self.schedule = schedule
        self.mark = timer.mark
        self.host_now = time.perf_counter_ns
        self.device_flag = FLAG_DEVICE_TIME if timer.device_timed else 0
        self.active = False
        self.iteration = -1
        self.context: tuple[int, int] = (-1, -1)
        self.events: list[tuple] = []
        self.collectives = CollectiveObserver(self.mark, self._record_collective, self._record_collective_wait)
        self.layer_scopes = None  # set by the plugin for --trace-granularity full
        self.p2p = None  # see trace_point_to_point
        self.counters = IterationCounters()
        self.gpu: GpuCounters | None = None  # NVML, opened at the first traced iteration (CUDA ranks)
        self.windows_written = 0
        self._window_first = -1
        self._clock_start: dict[str, int] | None = None
        self._metrics: list[dict[str, Any]] = []
        self.closed = False

    # --- observer protocol ----------------------------------------------------------
    def span(self, kind: str, **attrs: Any) -> contextlib.AbstractContextManager:
        if not self.active:
            return _NULL
        return _Span(self, kind, attrs)

    def instant(self, kind: str, **attrs: Any) -> None:
        if not self.active:
            return
        now = self.host_now()
        microbatch, chunk = self.context
        self.events.append((kind, now, now, self.iteration, attrs.get("microbatch", microbatch),
                            attrs.get("chunk", chunk), attrs.get("bytes", -1), attrs.get("peer", -1), -1, -1,
                            attrs.get("layer", -1), FLAG_INSTANT, None))

    def _record_collective(self, op: str, start, end, size: int, dtype: str | None, gid: int, seq: int,
                           flags: int) -> None:
        microbatch, chunk = self.context
        self.events.append((op, start, end, self.iteration, microbatch, chunk, size, -1, gid, seq, -1,
                            flags | self.device_flag, dtype))

    def _record_collective_wait(self, start, end) -> None:
        microbatch, chunk = self.context
        self.events.append((COLLECTIVE_WAIT, start, end, self.iteration, microbatch, chunk, -1, -1, -1, -1, -1,
                            self.device_flag, None))

    def trace_point_to_point(self, alias_module_prefixes=()) -> None:
        """Also record torch.distributed's point-to-point calls (megatron-core's schedule, a launched
        program), which no span of ours surrounds; undone by close()."""
        from megatron.scan.p2p import P2PObserver

        if self.p2p is None:
            self.p2p = P2PObserver(now=self.mark, sink=self._record_p2p, recording=lambda: self.active)
            self.p2p.install(alias_module_prefixes)

    def _record_p2p(self, kind: str, start, end, peer: int, size: int, dtype: str | None) -> None:
        self.events.append((kind, start, end, self.iteration, -1, -1, size, peer, -1, -1, -1, self.device_flag,
                            dtype))

    def record_layer(self, kind: str, start, end, layer: int, context: tuple[int, int]) -> None:
        self.events.append((kind, start, end, self.iteration, context[0], context[1], -1, -1, -1, -1, layer,
                            self.device_flag, None))

    # --- windows ----------------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        if self.closed or not self.schedule.is_traced(iteration):
            return
        if not self.active:
            self.timer.window_start()
            self._clock_start = clock_pair()
            self._window_first = iteration
            self._metrics = []
            self.active = True
            self.collectives.recording = True
            if self.layer_scopes is not None:
                self.layer_scopes.attach()
        self.iteration = iteration
        self.counters.begin()
        if self.gpu is None:
            self.gpu = GpuCounters(_current_cuda_device() if self.timer.device_timed else None)

    def end_iteration(self, iteration: int, metrics: dict[str, Any] | None = None, last: bool = False) -> None:
        """Called after the iteration's optimizer step and logging; closes the window at its last
        iteration or at the end of training."""
        if not self.active:
            return
        if metrics is not None:
            record = {"iteration": iteration, "iteration_time": metrics.get("iteration_time"),
                      "loss": metrics.get("lm loss"), **self.counters.end(),
                      **(self.gpu.read() if self.gpu is not None else {})}
            if metrics.get("microbatches") is not None:  # this replica's share of the global batch
                record["microbatches"] = metrics["microbatches"]
            self._metrics.append(record)
        if last or self.schedule.is_window_end(iteration):
            self.flush_window()

    def flush_window(self) -> None:
        if not self.active:
            return
        self.active = False
        self.collectives.recording = False
        if self.layer_scopes is not None:
            self.layer_scopes.detach()
        self.timer.window_end()
        events, self.events = self.events, []
        record = WindowRecord(
            window=self.windows_written,
            iterations=(self._window_first, self.iteration),
            clock_start=self._clock_start,
            clock_end=clock_pair(),
            events=events,
            groups={g.gid: g.as_dict() for g in self.collectives.groups.values()},
            metrics=self._metrics,
            resolve=self.timer.resolver(),
        )
        self.writer.submit(record)
        self.windows_written += 1
        self.context = (-1, -1)

    def close(self, end_record: dict[str, Any]) -> None:
        if self.closed:
            return
        self.flush_window()
        self.closed = True
        self.counters.close()
        if self.gpu is not None:
            self.gpu.close()
        self.collectives.uninstall()
        if self.p2p is not None:
            self.p2p.uninstall()
        self.writer.close({"windows": self.windows_written, **end_record})
