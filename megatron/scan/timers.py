"""Timestamp sources for the tracer: the host monotonic clock on CPU, CUDA events on GPU.

`mark()` is called on the hot path and returns a token; tokens become monotonic nanoseconds in
`resolve`, which runs after the window ends (once the device has been synchronized there).
"""
from __future__ import annotations

import collections
import time
from typing import Any


class HostTimer:
    """Tokens are already `time.perf_counter_ns()` values (CLOCK_MONOTONIC on Linux)."""

    device_timed = False

    def __init__(self) -> None:
        self.mark = time.perf_counter_ns  # bound once: the hot path pays one call, nothing else

    def window_start(self) -> None:
        return None

    def window_end(self) -> None:
        return None

    def resolver(self):
        return None


class CudaTimer:
    """Tokens are CUDA events recorded on the current stream; nothing synchronizes inside a
    window. At its end the device is synchronized once and a reference event recorded at the
    window start, paired with a host timestamp, turns each event into host monotonic time."""

    device_timed = True

    def __init__(self, device=None) -> None:
        import torch

        self._torch = torch
        self._device = device
        self._pool: collections.deque = collections.deque()
        self._reference = None
        self._reference_host_ns = 0

    def _event(self):
        try:
            return self._pool.pop()
        except IndexError:
            return self._torch.cuda.Event(enable_timing=True)

    def mark(self):
        event = self._event()
        event.record()
        return event

    def window_start(self) -> None:
        # Allowed sync point: between iterations, before the window's first event.
        self._torch.cuda.synchronize(self._device)
        self._reference = self._event()
        self._reference.record()
        self._torch.cuda.synchronize(self._device)
        self._reference_host_ns = time.perf_counter_ns()

    def window_end(self) -> None:
        self._torch.cuda.synchronize(self._device)

    def resolver(self):
        """A function for the writer thread: replaces event tokens in the event tuples by ns.

        One token may stand in several places: a layer's backward ends where the next one's
        begins, so both spans hold the same event. Each event is read once and goes back to the
        pool once, after the whole window is read. Returned twice, one CUDA event would be handed
        to two later marks; the second record() overwrites the first, and from then on spans read
        zero, negative or other spans' times (on an H200, from about iteration 100 of a run traced
        with per-layer scopes, every window was wrong by iteration 500)."""
        reference, host_ns, pool = self._reference, self._reference_host_ns, self._pool
        event_type = self._torch.cuda.Event

        def resolve(events: list[tuple]) -> list[tuple]:
            read: dict[int, tuple[Any, int]] = {}  # id(event) -> (event, ns)

            def to_ns(token: Any) -> int:
                if not isinstance(token, event_type):
                    return token
                known = read.get(id(token))
                if known is None:
                    known = read[id(token)] = (token, host_ns + int(reference.elapsed_time(token) * 1e6))
                return known[1]

            resolved = [(e[0], to_ns(e[1]), to_ns(e[2]), *e[3:]) for e in events]
            pool.extend(event for event, _ in read.values())
            return resolved

        return resolve


def build_timer(device_kind: str, device=None):
    """The switch between the two timing paths (`cpu` or `cuda`)."""
    return CudaTimer(device) if device_kind == "cuda" else HostTimer()
