"""The per-iteration host counters the tracer records: CPU time and run-queue wait summed over a
rank's threads, read through files kept open, counting only threads alive for the whole iteration."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from megatron.scan.host_counters import IterationCounters

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or not list(Path("/proc/self/task").glob("*/schedstat")),
                                reason="needs Linux /proc/<pid>/task/<tid>/schedstat")


def spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_cpu_time_of_every_thread_is_summed():
    counters = IterationCounters()
    assert counters.available
    go, done = threading.Event(), threading.Event()

    def worker():
        go.wait()
        spin(0.3)
        done.set()
        time.sleep(60)

    threading.Thread(target=worker, daemon=True).start()
    counters.begin()
    go.set()
    done.wait(10)  # the main thread sleeps meanwhile
    values = counters.end()
    assert 250 <= values["cpu_ms"] <= 600, values  # the other thread's 0.3 s of CPU
    assert values["cpu_wait_ms"] >= 0
    counters.close()


def test_a_thread_started_mid_iteration_does_not_bring_its_history():
    counters = IterationCounters()
    done, stop = threading.Event(), threading.Event()

    def busy_then_idle():
        spin(0.4)
        done.set()
        stop.wait()

    counters.begin()
    thread = threading.Thread(target=busy_then_idle, daemon=True)
    thread.start()
    done.wait()
    values = counters.end()  # the thread is alive now but was not at begin(): its 0.4 s is left out
    assert values["cpu_ms"] < 200, values
    counters.begin()
    spin(0.1)
    values = counters.end()  # alive at both reads from now on: counted (it is idle)
    assert 50 <= values["cpu_ms"] < 250, values
    stop.set()
    thread.join()
    counters.close()


def test_files_of_ended_threads_are_closed():
    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    counters = IterationCounters()
    counters.begin()
    counters.end()
    before = open_files()
    for _ in range(5):
        threads = [threading.Thread(target=time.sleep, args=(0.05,), daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        counters.begin()
        for t in threads:
            t.join()
        counters.end()
    counters.begin()
    counters.end()
    assert open_files() <= before + 1
    counters.close()
    assert open_files() < before
