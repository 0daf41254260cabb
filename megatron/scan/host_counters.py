"""Per-process scheduler counters (Linux): CPU time used and time spent runnable but not running
(run-queue wait, which includes time stopped by a cgroup CPU quota), summed over the process's
threads. A rank starved of its CPU shows as wait; a rank waiting for its peers sleeps and does not.
The CPU-backend counterpart of a GPU's clock and throttle counters."""
from __future__ import annotations

import os

_TASKS = "/proc/self/task"


def read_cpu_counters() -> tuple[int, int] | None:
    """(cpu ns, run-queue wait ns) of this process, or None where /proc has no schedstat."""
    cpu = wait = 0
    try:
        threads = os.listdir(_TASKS)
    except OSError:
        return None
    found = False
    for tid in threads:
        try:
            with open(f"{_TASKS}/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:  # the thread exited meanwhile
            continue
        cpu += int(fields[0])
        wait += int(fields[1])
        found = True
    return (cpu, wait) if found else None


class IterationCounters:
    """Deltas of the counters over one iteration: `begin()` then `end()` -> {cpu_ms, cpu_wait_ms}."""

    def __init__(self) -> None:
        self.available = read_cpu_counters() is not None
        self._start: tuple[int, int] | None = None

    def begin(self) -> None:
        self._start = read_cpu_counters() if self.available else None

    def end(self) -> dict[str, float]:
        if self._start is None:
            return {}
        now = read_cpu_counters()
        if now is None:
            return {}
        return {"cpu_ms": round((now[0] - self._start[0]) / 1e6, 3),
                "cpu_wait_ms": round((now[1] - self._start[1]) / 1e6, 3)}
