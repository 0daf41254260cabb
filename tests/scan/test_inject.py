"""Fault injection: a slowed rank's device computes FACTOR x slower or stalls now and then, the
extra time inside each transformer layer's forward and backward; a delayed link delivers late."""
from __future__ import annotations

import argparse
import re
import statistics
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from launch import torchrun
from megatron.app import observer as observer_module
from megatron.app.config import ConfigError
from megatron.scan import inject
from megatron.scan.inject import Burner, DelayedTransport, DeviceFault, InjectPlugin, LinkDelay, Slowdown, Stall
from megatron.scan.layers import LayerScopes, transformer_layers
from megatron.scan.timers import HostTimer
from megatron.scan.trace_format import header_fields, read_rank_file, trace_file_name, TraceWriter
from megatron.scan.tracer import Tracer, WindowSchedule

# The tiny model's work is slept, not computed: its durations hold on a loaded host, and the
# injector is run in its sleep mode for the same reason.
FORWARD_S, BACKWARD_S = 0.010, 0.015


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return hidden * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _Layer(torch.nn.Module):
    """What `transformer_layers` recognises as a megatron-core TransformerLayer."""

    def __init__(self, number: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.layer_number = number
        self.self_attention = torch.nn.Identity()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, hidden_states, attention_mask=None):
        return _Sleep.apply(hidden_states, self.forward_s, self.backward_s), None


class _Model(torch.nn.Module):
    def __init__(self, layers: int = 3, forward_s: float = FORWARD_S, backward_s: float = BACKWARD_S) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(i + 1, forward_s, backward_s) for i in range(layers))

    def forward(self, hidden):
        for layer in self.layers:
            hidden, _ = layer(hidden_states=hidden)
        return hidden.sum()


def _timed_step(model, span=None):
    """(forward s, backward s) of one microbatch, each measured around the call (and inside `span`)."""
    span = span or (lambda kind: observer_module.get_observer().span(kind, chunk=0, microbatch=0))
    hidden = torch.ones(4, requires_grad=True)
    started = time.perf_counter()
    with span("forward"):
        loss = model(hidden)
    forward = time.perf_counter() - started
    started = time.perf_counter()
    with span("backward"):
        loss.backward()
    return forward, time.perf_counter() - started


def _sleeping_fault(*specs) -> DeviceFault:
    fault = DeviceFault([s for s in specs if isinstance(s, Slowdown)], [s for s in specs if isinstance(s, Stall)],
                        burner=Burner(None, oversubscribed=True))
    fault.begin_iteration(max(s.start_iteration for s in specs))
    return fault


@pytest.fixture
def no_observer(monkeypatch):
    monkeypatch.setattr(observer_module, "_observer", observer_module.NullObserver())


def _tracer(tmp_path) -> Tracer:
    header = header_fields(rank=0, world_size=1, run_id="unit", coordinates={"dp": 0, "pp": 0, "tp": 0},
                           sizes={"dp": 1, "pp": 1, "tp": 1})
    return Tracer(writer=TraceWriter(tmp_path / "r.json", header), timer=HostTimer(), schedule=WindowSchedule(1, 1))


def _durations_ms(tracer: Tracer, kind: str) -> list[float]:
    return [(e[2] - e[1]) / 1e6 for e in tracer.events if e[0] == kind]


@pytest.mark.parametrize("fault_first", [True, False], ids=["fault-attached-first", "tracer-attached-first"])
def test_slowdown_lies_inside_traced_forward_backward_and_layer_spans(tmp_path, no_observer, fault_first):
    model = _Model()
    layers = transformer_layers([model])
    assert len(layers) == 3
    factor = 3.0
    fault = _sleeping_fault(Slowdown(0, factor))
    tracer = _tracer(tmp_path)
    tracer.layer_scopes = LayerScopes(tracer, layers)
    if fault_first:
        fault.attach(layers)
        tracer.begin_iteration(0)
    else:
        tracer.begin_iteration(0)
        fault.attach(layers)
    try:
        forward_s, backward_s = _timed_step(model, lambda kind: tracer.span(kind, chunk=0, microbatch=5))
        (forward_ms,), (backward_ms,) = _durations_ms(tracer, "forward"), _durations_ms(tracer, "backward")
        layer_forward, layer_backward = _durations_ms(tracer, "layer_forward"), _durations_ms(tracer, "layer_backward")
    finally:
        tracer.close({})
        fault.detach()
    # The traced spans themselves hold FACTOR x the work (sleeps never end early; the upper
    # bound leaves room for late wake-ups on a loaded host).
    assert 0.97 * factor * 3 * FORWARD_S * 1e3 <= forward_ms < 1.5 * factor * 3 * FORWARD_S * 1e3
    assert 0.97 * factor * 3 * BACKWARD_S * 1e3 <= backward_ms < 1.5 * factor * 3 * BACKWARD_S * 1e3
    assert forward_ms <= forward_s * 1e3 and backward_ms <= backward_s * 1e3
    # So do the per-layer scopes: the extra time of layer L is inside L's own scope.
    assert len(layer_forward) == len(layer_backward) == 3
    assert all(0.97 * factor * FORWARD_S * 1e3 <= ms < 1.5 * factor * FORWARD_S * 1e3 for ms in layer_forward)
    assert all(0.97 * factor * BACKWARD_S * 1e3 <= ms < 1.5 * factor * BACKWARD_S * 1e3 for ms in layer_backward)


def test_layer_scopes_chain_backward_and_keep_the_forward_context(tmp_path, no_observer):
    model = _Model(layers=3, forward_s=0.001, backward_s=0.002)
    tracer = _tracer(tmp_path)
    tracer.layer_scopes = LayerScopes(tracer, transformer_layers([model]))
    tracer.begin_iteration(0)
    with tracer.span("forward", chunk=1, microbatch=4):
        loss = model(torch.ones(4, requires_grad=True))
    with tracer.span("backward", chunk=1, microbatch=4):
        loss.backward()
    events = list(tracer.events)
    tracer.close({})
    backward = {e[10]: e for e in events if e[0] == "layer_backward"}
    assert sorted(backward) == [1, 2, 3]
    assert all((e[4], e[5]) == (4, 1) for e in events if e[0].startswith("layer_"))
    # Layer L+1's backward ends at the very timestamp layer L's begins: no gap, no overlap.
    assert backward[3][2] == backward[2][1] and backward[2][2] == backward[1][1]
    # Outside a window the hooks are gone.
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in model.layers)


def _plugin(flags: list[str], world_size: int = 2) -> InjectPlugin:
    parser = argparse.ArgumentParser()
    plugin = InjectPlugin()
    plugin.add_arguments(parser)
    plugin.configure(SimpleNamespace(args=parser.parse_args(flags), parallel=SimpleNamespace(world_size=world_size)))
    return plugin


def _setup(plugin: InjectPlugin, rank: int, chunks: list) -> None:
    plugin.setup(SimpleNamespace(rank=rank, chunks=chunks, backend=SimpleNamespace(device=torch.device("cpu")),
                                 executor=None))


def test_plugin_hooks_layers_only_from_the_start_iteration(capsys, no_observer, monkeypatch):
    monkeypatch.setattr(inject, "ranks_outnumber_cores", lambda: True)
    model = _Model()
    plugin = _plugin(["--inject-slowdown", "1:3:2", "--inject-stall", "1:5:1000:4"])
    _setup(plugin, 1, [model])
    out = capsys.readouterr().out
    assert "[inject] rank 1: compute x3 from iteration 2, per transformer layer (sleep (ranks outnumber cores))" in out
    assert "[inject] rank 1: stalls of 5 ms every 1000 ms from iteration 4, per transformer layer" in out
    plugin.before_iteration(None, 1)
    assert not any(layer._forward_hooks for layer in model.layers)  # before START_ITER: nothing installed
    forward_s, backward_s = _timed_step(model)
    assert forward_s < 2 * 3 * FORWARD_S and backward_s < 2 * 3 * BACKWARD_S
    plugin.before_iteration(None, 2)
    assert all(layer._forward_hooks for layer in model.layers)
    forward_s, backward_s = _timed_step(model)
    assert forward_s >= 0.97 * 3 * 3 * FORWARD_S  # 3 layers, x3
    assert backward_s >= 0.97 * 3 * 3 * BACKWARD_S  # backward got its share
    plugin.shutdown(None)
    assert not any(layer._forward_hooks for layer in model.layers)


def test_a_model_without_transformer_layers_is_slowed_inside_its_spans(tmp_path, capsys, no_observer, monkeypatch):
    monkeypatch.setattr(inject, "ranks_outnumber_cores", lambda: True)

    class Plain(torch.nn.Module):
        def forward(self, hidden):
            return _Sleep.apply(hidden, 0.02, 0.02).sum()

    plugin = _plugin(["--inject-slowdown", "0:3"])
    _setup(plugin, 0, [Plain()])
    assert "[inject] rank 0: compute x3 from iteration 0, at the end of each forward/backward span: " \
           "no transformer layers found" in capsys.readouterr().out
    # As in training: the injector's setup runs before the tracer's, yet its time lies inside the
    # tracer's spans.
    tracer = _tracer(tmp_path)
    observer_module.set_observer(tracer)
    tracer.begin_iteration(0)
    plugin.before_iteration(None, 0)
    _timed_step(Plain())
    (forward_ms,), (backward_ms,) = _durations_ms(tracer, "forward"), _durations_ms(tracer, "backward")
    tracer.close({})
    assert 0.97 * 60 <= forward_ms < 90 and 0.97 * 60 <= backward_ms < 90


def test_sleep_mode_leaves_the_core_to_its_neighbours_and_busy_mode_takes_it():
    for burner, expect_cpu in ((Burner(None, oversubscribed=True), False), (Burner(None), True)):
        wall, cpu = time.perf_counter(), time.process_time()
        burner.burn(0.08)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert wall >= 0.08
        if expect_cpu:
            assert burner.mode == "busy CPU"
        else:
            assert "sleep" in burner.mode and cpu < 0.04, f"slept time should not burn CPU (used {cpu * 1e3:.0f} ms)"


def test_stalls_come_in_bursts_and_add_their_share_of_the_time(no_observer):
    stall_ms, every_ms = 20.0, 100.0
    model = _Model(layers=3, forward_s=0.005, backward_s=0.0)
    hidden = torch.ones(4)

    def forward_ms(calls: int) -> list[float]:
        times = []
        with torch.no_grad():
            for _ in range(calls):
                started = time.perf_counter()
                model(hidden)
                times.append((time.perf_counter() - started) * 1e3)
        return times

    healthy = forward_ms(30)  # ~450 ms of compute
    fault = _sleeping_fault(Stall(0, stall_ms, every_ms))
    fault.attach(transformer_layers([model]))
    try:
        stalled = forward_ms(30)
    finally:
        fault.detach()
    typical = statistics.median(healthy)
    long_calls = sum(ms > typical + stall_ms / 2 for ms in stalled)
    extra = sum(stalled) - sum(healthy)
    # About one stall per EVERY_MS of wall time: S/(N-S) of the compute, here 25% (~110 ms).
    expected = sum(healthy) * stall_ms / (every_ms - stall_ms)
    assert 0.5 * expected < extra < 2 * expected, (extra, expected)
    assert 3 <= long_calls <= 10, stalled  # intermittent: most calls untouched
    assert statistics.median(stalled) < typical + stall_ms / 2


def test_stall_not_before_its_start_iteration(no_observer):
    model = _Model(layers=2, forward_s=0.002, backward_s=0.0)
    fault = DeviceFault([], [Stall(0, 50, 100, start_iteration=3)], burner=Burner(None, oversubscribed=True))
    fault.begin_iteration(2)
    fault.attach(transformer_layers([model]))
    try:
        started = time.perf_counter()
        with torch.no_grad():
            model(torch.ones(4))
        assert time.perf_counter() - started < 0.04
        fault.begin_iteration(3)
        started = time.perf_counter()
        with torch.no_grad():
            model(torch.ones(4))
        assert time.perf_counter() - started >= 0.05
    finally:
        fault.detach()


@pytest.mark.parametrize("text,fragment", [
    ("1:50", "RANK:STALL_MS:EVERY_MS[:START_ITER] (e.g. 1:50:500:10"),
    ("1:a:500", "RANK:STALL_MS:EVERY_MS[:START_ITER] (e.g. 1:50:500:10"),
    ("1:50:500:1:2", "got '1:50:500:1:2'"),
    ("1:0:500", "need STALL_MS > 0"),
    ("1:50:50", "need EVERY_MS > STALL_MS"),
    ("-1:50:500", "need RANK >= 0"),
    ("1:50:40:-2", "need EVERY_MS > STALL_MS, START_ITER >= 0; the form is RANK:STALL_MS:EVERY_MS[:START_ITER] (e.g."),
])
def test_bad_stall_flags_show_the_form_and_an_example(text, fragment):
    with pytest.raises(ConfigError) as caught:
        Stall.parse(text)
    assert fragment in str(caught.value) and "e.g. 1:50:500:10" in str(caught.value)


def test_stall_of_a_rank_outside_the_world_is_refused():
    with pytest.raises(ConfigError, match=r"rank\(s\) \[2\] but world_size is 2"):
        _plugin(["--inject-stall", "2:5:50"])


class _Done:
    def wait(self):
        return None

    def is_completed(self):
        return True


class _Instant:
    name = "fake"

    def post(self, sends, recvs):
        return [_Done() for _ in [*sends, *recvs]]


class _Msg:
    def __init__(self, peer):
        self.peer = peer


def test_delayed_link_completes_late_and_only_for_its_source():
    transport = DelayedTransport(_Instant(), {3: 0.05})
    send, from_3, from_1 = transport.post([_Msg(2)], [_Msg(3), _Msg(1)])
    assert send.is_completed() and from_1.is_completed()
    assert not from_3.is_completed()
    started = time.perf_counter()
    from_3.wait()
    assert time.perf_counter() - started >= 0.045
    assert from_3.is_completed()


@pytest.mark.parametrize("flag,text,fragment", [
    ("slowdown", "2", "RANK:FACTOR[:START_ITER]"),
    ("slowdown", "2:0.5", "FACTOR >= 1"),
    ("link", "1:1:5", "two different ranks"),
    ("link", "a:b:c", "SRC:DST:MS"),
])
def test_bad_injection_flags_say_what_to_write(flag, text, fragment):
    parse = Slowdown.parse if flag == "slowdown" else LinkDelay.parse
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse(text)


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--device", "cpu"]


def test_injection_in_a_training_run():
    proc = torchrun("pretrain_gpt.py", [
        *MODEL, "--global-batch-size", "4", "--train-iters", "3", "--pipeline-model-parallel-size", "2",
        "--inject-slowdown", "1:2:1", "--inject-stall", "0:5:50:1", "--inject-link-delay", "0:1:5"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[inject] rank 1: compute x2 from iteration 1, per transformer layer" in proc.stdout
    assert "[inject] rank 0: stalls of 5 ms every 50 ms from iteration 1, per transformer layer" in proc.stdout
    assert "[inject] rank 1: messages from [0] delayed [5.0] ms" in proc.stdout
    assert " iteration        3/" in proc.stdout


def test_slowed_rank_has_longer_traced_compute_spans_than_its_peer(tmp_path):
    # Two data-parallel ranks do the same work; only rank 1's device is 3 x slower. The grad
    # all-reduce evens out their iterations, so the difference must be inside the spans.
    proc = torchrun("pretrain_gpt.py", [
        *MODEL, "--seq-length", "64", "--global-batch-size", "8", "--train-iters", "4",
        "--trace", "--trace-dir", str(tmp_path), "--trace-interval", "1", "--continuous-trace-iterations", "1",
        "--inject-slowdown", "1:3"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    median_ms = {}
    for dp in (0, 1):
        f = read_rank_file(tmp_path / trace_file_name(dp, 0, 0))
        c = f.columns
        name = np.array([f.names[i] for i in c["name"]])
        after_warmup = c["iteration"] >= 1
        for kind in ("forward", "backward"):
            rows = (name == kind) & after_warmup
            median_ms[f.rank, kind] = float(np.median(c["end_ns"][rows] - c["start_ns"][rows])) / 1e6
    for kind in ("forward", "backward"):
        assert median_ms[1, kind] > 1.5 * median_ms[0, kind], median_ms


@pytest.mark.parametrize("executor,flags,nproc,link", [
    ("MegaFBD's role executors", ["--forward-backward-disaggregating"], 4, "2:0"),  # forward stage 0 -> its backward
    ("MegaDPP's executor", ["--use-dpp", "--dpp-transport", "torch"], 2, "0:1"),
])
def test_a_delayed_link_delays_every_executor_kind(executor, flags, nproc, link):
    """The delay wraps the transport where it is made, so executors the trainer does not build
    itself deliver late too: every iteration waits at least the delay."""
    proc = torchrun("pretrain_gpt.py", [
        *MODEL, "--global-batch-size", "4", "--train-iters", "3", "--pipeline-model-parallel-size", "2",
        "--log-interval", "1", *flags, "--inject-link-delay", f"{link}:800"], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    src, dst = link.split(":")
    assert f"[inject] rank {dst}: messages from [{src}] delayed [800.0] ms" in proc.stdout
    elapsed = [float(ms) for ms in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", proc.stdout)]
    assert len(elapsed) == 3 and min(elapsed) >= 800, (executor, elapsed)


def test_a_link_delay_with_megatron_cores_schedule_is_refused(monkeypatch):
    """megatron-core's schedule sends through torch.distributed itself: there is no transport to delay."""
    from megatron.app.train import parse

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--inject-link-delay .* --pipeline-schedule megatron-core does not use"):
        parse([*MODEL, "--global-batch-size", "4", "--train-iters", "2", "--pipeline-model-parallel-size", "2",
               "--pipeline-schedule", "megatron-core", "--inject-link-delay", "0:1:20"])
