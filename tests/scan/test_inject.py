"""Fault injection: a slowed rank's compute takes FACTOR x as long; a delayed link delivers late."""
from __future__ import annotations

import time

import pytest

from megatron.app.config import ConfigError
from megatron.scan.inject import DelayedTransport, LinkDelay, Slowdown, SlowdownObserver
from launch import torchrun


def _work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_slowdown_stretches_compute_spans_only_from_the_start_iteration():
    observer = SlowdownObserver(factor=3.0, start_iteration=2, device=None)
    observer.iteration = 1
    started = time.perf_counter()
    with observer.span("forward", chunk=0, microbatch=0):
        _work(0.02)
    assert time.perf_counter() - started < 0.04  # before START_ITER: untouched
    observer.iteration = 2
    started = time.perf_counter()
    with observer.span("backward", chunk=0, microbatch=0):
        _work(0.02)
    assert time.perf_counter() - started >= 0.06  # 3 x 20 ms
    started = time.perf_counter()
    with observer.span("recv", peer=1):
        _work(0.02)
    assert time.perf_counter() - started < 0.04  # waiting is not compute


def test_slowdown_on_an_oversubscribed_host_sleeps_instead_of_taking_a_core():
    # With more ranks than cores a busy loop would slow a neighbour sharing the core; the
    # injected rank must be slower in wall time while using no extra CPU time.
    observer = SlowdownObserver(factor=4.0, start_iteration=0, device=None, oversubscribed=True)
    wall, cpu = time.perf_counter(), time.process_time()
    with observer.span("forward", chunk=0, microbatch=0):
        _work(0.02)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 0.08  # 4 x 20 ms
    assert cpu < 0.05, f"slept extra time should not burn CPU (used {cpu * 1e3:.0f} ms)"
    assert "sleep" in observer.mode


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


def test_injection_in_a_training_run():
    proc = torchrun("pretrain_gpt.py", [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "256",
        "--train-iters", "3", "--device", "cpu", "--pipeline-model-parallel-size", "2",
        "--inject-slowdown", "1:2:1", "--inject-link-delay", "0:1:5"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[inject] rank 1: compute x2 from iteration 1" in proc.stdout
    assert "[inject] rank 1: messages from [0] delayed [5.0] ms" in proc.stdout
    assert " iteration        3/" in proc.stdout
