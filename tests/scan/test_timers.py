"""The CUDA-event timer over many windows, with a stand-in for torch.cuda (CI has no GPU): events
return to the pool once, so spans that share an event (a layer's backward end is the next one's
start) keep their own times in every window."""
from __future__ import annotations

import types

from megatron.scan.layers import LayerScopes
from megatron.scan.timers import CudaTimer


class _Clock:
    now_ms = 0.0


class _Event:
    """A CUDA event: record() stamps the device time; elapsed_time reads the gap in ms."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.stamp = None

    def record(self) -> None:
        _Clock.now_ms += 1.0  # every kernel between two marks takes 1 ms
        self.stamp = _Clock.now_ms

    def elapsed_time(self, other: "_Event") -> float:
        return other.stamp - self.stamp


def _fake_torch():
    cuda = types.SimpleNamespace(Event=_Event, synchronize=lambda device=None: None)
    return types.SimpleNamespace(cuda=cuda)


class _Tracer:
    """What LayerScopes asks of the tracer: marks, and the layer spans it records."""

    def __init__(self, timer: CudaTimer) -> None:
        self.timer, self.context, self.spans = timer, None, []

    def mark(self):
        return self.timer.mark()

    def record_layer(self, name, begun, end, layer, context) -> None:
        self.spans.append((name, begun, end, layer))


def test_spans_sharing_an_event_keep_their_times_in_every_window():
    timer = CudaTimer()
    timer._torch = _fake_torch()
    tracer = _Tracer(timer)
    scopes = LayerScopes(tracer, [types.SimpleNamespace(layer_number=n) for n in (1, 2, 3, 4)])
    for window in range(40):
        timer.window_start()
        tracer.spans.clear()
        for _ in range(3):  # iterations: forward of 4 layers, then their backward, chained
            for layer in scopes.layers:
                scopes.forward_end(layer, scopes.forward_begin(layer))
            chained = None
            for layer in reversed(scopes.layers):
                begun = scopes.backward_begin(layer, None, chained)
                chained = scopes.backward_end(layer, None, begun)
        timer.window_end()
        events = [(name, begun, end, layer) for name, begun, end, layer in tracer.spans]
        resolved = timer.resolver()(events)
        # Every span took exactly the 1 ms between its two marks, in every window.
        assert [end - start for _, start, end, _ in resolved] == [1_000_000] * len(resolved), window
        pool = list(timer._pool)
        assert len({id(e) for e in pool}) == len(pool)  # each event once: no two marks share one
