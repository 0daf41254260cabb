"""Per-process scheduler counters (Linux): CPU time used and time spent runnable but not running
(run-queue wait, which includes time stopped by a cgroup CPU quota), summed over the process's
threads. A rank starved of its CPU shows as wait; a rank waiting for its peers sleeps and does not.
The CPU-backend counterpart of a GPU's clock and throttle counters.

A rank of a gloo job runs 60 threads and more, so the cost of a read matters: each thread's
`schedstat` file is opened once and kept open, and every read is one `pread` per thread (about a
quarter of the cost of opening, reading and closing each file, measured with 60 threads)."""
from __future__ import annotations

import os
import threading

_TASKS = "/proc/self/task"


class ThreadCounters:
    """The schedstat files of this process's threads, kept open between reads."""

    def __init__(self) -> None:
        self._files: dict[str, int] = {}  # thread id -> open file descriptor

    def read(self) -> dict[str, tuple[int, int]] | None:
        """{thread id: (cpu ns, run-queue wait ns)} of every live thread; None where /proc has no
        schedstat (not Linux, or a kernel without schedstats)."""
        try:
            threads = os.listdir(_TASKS)
        except OSError:
            return None
        values: dict[str, tuple[int, int]] = {}
        for tid in threads:
            fd = self._files.get(tid)
            if fd is None:
                try:
                    fd = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:  # the thread exited meanwhile
                    continue
                self._files[tid] = fd
            try:
                fields = os.pread(fd, 128, 0).split()
                values[tid] = (int(fields[0]), int(fields[1]))
            except (OSError, ValueError, IndexError):  # exited (its id may come back as a new thread)
                os.close(self._files.pop(tid))
        for tid in [t for t in self._files if t not in values]:  # threads that are gone
            os.close(self._files.pop(tid))
        return values or None

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class IterationCounters:
    """Deltas of the counters over one iteration: `begin()` then `end()` -> {cpu_ms, cpu_wait_ms,
    main_cpu_ms, main_wait_ms}. Summed over the threads alive at both reads (a thread that started
    or ended in between would otherwise add or remove its whole history), and the training thread's
    own (the one calling `begin`): it runs the forward and backward, so its run-queue wait is the
    time compute stood still, without the dozens of communication threads' short wake-ups."""

    def __init__(self) -> None:
        self._threads = ThreadCounters()
        self.available = self._threads.read() is not None
        self._start: dict[str, tuple[int, int]] | None = None

    def begin(self) -> None:
        self._start = self._threads.read() if self.available else None
        self._main = str(threading.get_native_id())

    def end(self) -> dict[str, float]:
        if self._start is None:
            return {}
        now = self._threads.read()
        if now is None:
            return {}
        both = [tid for tid in now if tid in self._start]
        cpu = sum(now[t][0] - self._start[t][0] for t in both)
        wait = sum(now[t][1] - self._start[t][1] for t in both)
        counters = {"cpu_ms": round(cpu / 1e6, 3), "cpu_wait_ms": round(wait / 1e6, 3)}
        if self._main in both:
            counters["main_cpu_ms"] = round((now[self._main][0] - self._start[self._main][0]) / 1e6, 3)
            counters["main_wait_ms"] = round((now[self._main][1] - self._start[self._main][1]) / 1e6, 3)
        return counters

    def close(self) -> None:
        self.available = False
        self._start = None
        self._threads.close()
