"""Real traced CPU training runs with a fault applied the way a user would meet it: an external
cgroup throttle or SIGSTOP through `python -m megatron.scan fault` (started at an iteration of the
running job, found by its RANK), or the in-process injector's flags. Shared by the detection tests
and `benchmarks/detection_accuracy.py`."""
from __future__ import annotations

import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch import ROOT, env, free_port, writable_hierarchy  # noqa: F401 (the fault tests import it here)

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
         "--device", "cpu", "--trace"]
EVERY_ITERATION = ["--trace-interval", "1", "--continuous-trace-iterations", "1"]
ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+)")


class FaultNotApplied(RuntimeError):
    """The fault tool stopped without applying its fault (its output says why)."""


@dataclass(frozen=True, kw_only=True)
class Throttle:
    """`fault throttle --rank RANK --cpu-fraction FRACTION`, applied once the job has printed
    iteration ONSET (0: as soon as the rank's process exists)."""

    rank: int
    fraction: float
    onset: int = 0

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "megatron.scan", "fault", "throttle", "--rank", str(self.rank),
                "--cpu-fraction", str(self.fraction), "--job", f":{port}", "--wait", "120"]


@dataclass(kw_only=True)
class Scenario:
    name: str
    nproc: int
    layout: list[str]
    expected: list[int] = field(default_factory=list)  # ranks a correct detector names
    expected_links: list[tuple[int, int]] = field(default_factory=list)
    inject: list[str] = field(default_factory=list)  # in-process injector flags
    extra: list[str] = field(default_factory=list)  # more trainer flags (e.g. --online-detect)
    throttles: list[Throttle] = field(default_factory=list)
    iterations: int = 12
    granularity: str = "coarse"  # --trace-granularity (full adds per-layer spans)
    defaults: bool = False  # MegaScan's default windows and granularity (no --trace-interval etc.)
    healthy_of: str = ""  # name of the layout's healthy scenario (job-level slowdown baseline)

    @property
    def healthy(self) -> bool:
        return not (self.expected or self.expected_links or self.inject or self.throttles)

    @property
    def onset(self) -> int:
        """First iteration the fault acts on (0 when from the start)."""
        onsets = [t.onset for t in self.throttles]
        for i, flag in enumerate(self.inject):
            if flag in ("--inject-slowdown", "--inject-stall"):
                parts = self.inject[i + 1].split(":")
                onsets.append(int(parts[-1]) if len(parts) == (3 if flag == "--inject-slowdown" else 4) else 0)
        return min(onsets, default=0)


@dataclass(kw_only=True)
class RunResult:
    returncode: int
    iteration_ms: dict[int, float]
    stdout: str
    fault_output: list[str]
    line_times: list[float] = field(default_factory=list)  # monotonic arrival time of each stdout line
    fault_started: list[float] = field(default_factory=list)  # monotonic time each fault took effect

    def onset_iteration(self) -> int | None:
        """The first (0-based) iteration that ran with the first fault in force: the one whose log
        line is the first to arrive after the fault took effect."""
        if not self.fault_started:
            return None
        for line, at in zip(self.stdout.splitlines(), self.line_times):
            match = ITERATION.search(line)
            if match and at >= self.fault_started[0]:
                return int(match.group(1)) - 1
        return None

    def median_ms(self, first: int = 2, last: float = float("inf")) -> float:
        """Median iteration time of the logged iterations `first` to `last` (start-up excluded)."""
        times = [ms for it, ms in self.iteration_ms.items() if first <= it <= last]
        return statistics.median(times) if times else float("nan")


def run(scenario: Scenario, trace_dir: Path, *, timeout: float = 600) -> RunResult:
    """Train with tracing into `trace_dir`; external faults are applied from outside by the fault
    CLI and released when the job ends (or on any error here)."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(scenario.nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "pretrain_gpt.py", *MODEL,
               *([] if scenario.defaults else [*EVERY_ITERATION, "--trace-granularity", scenario.granularity]),
               "--train-iters", str(scenario.iterations),
               *scenario.layout, *scenario.inject, *scenario.extra,
               "--trace-dir", str(trace_dir)]
    job = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    faults: list[subprocess.Popen] = []
    lines: list[str] = []
    iteration_ms: dict[int, float] = {}
    pending = sorted(scenario.throttles, key=lambda t: t.onset)

    line_times: list[float] = []
    fault_started: list[float] = []

    first_lines: list[str] = []

    def start_due(iteration: int) -> None:
        while pending and pending[0].onset <= iteration:
            fault = subprocess.Popen(pending.pop(0).command(port), cwd=ROOT, env=env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            faults.append(fault)
            # Its first line says the fault is in force; anything else means it never applied
            # (counting such a run as a miss made a host whose cgroups refused every quota look
            # like a detector that named nothing).
            first = fault.stdout.readline()
            if "[fault] throttled" not in first:
                raise FaultNotApplied(f"the fault did not apply: {first}{fault.communicate()[0]}")
            first_lines.append(first)
            fault_started.append(time.monotonic())

    # The job's lines are timestamped as they arrive by a thread of their own: while the fault CLI
    # starts (about a second) the job goes on, and lines read only afterwards would look as if
    # they came after the fault (the onset iteration was placed up to 3 iterations early).
    arrived: queue.Queue = queue.Queue()

    def read_job() -> None:
        for job_line in job.stdout:
            arrived.put((job_line, time.monotonic()))
        arrived.put(None)

    reader = threading.Thread(target=read_job, daemon=True)
    timer = threading.Timer(timeout, job.kill)
    timer.start()
    reader.start()
    try:
        start_due(0)
        while (item := arrived.get()) is not None:
            line, at = item
            lines.append(line)
            line_times.append(at)
            match = ITERATION.search(line)
            if match:
                iteration_ms[int(match.group(1))] = float(match.group(2))
                start_due(int(match.group(1)))
        job.wait()
    finally:
        timer.cancel()
        if job.poll() is None:
            job.kill()
            job.wait()
        fault_output = []
        for first, fault in zip(first_lines, faults):
            if fault.poll() is None:
                fault.send_signal(signal.SIGINT)
            try:
                out, _ = fault.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                fault.kill()
                out, _ = fault.communicate()
            fault_output.append(first + out)
    return RunResult(returncode=job.returncode, iteration_ms=iteration_ms, stdout="".join(lines),
                     fault_output=fault_output, line_times=line_times, fault_started=fault_started)


def wait_quiet(seconds: float = 0.5) -> None:
    """A short pause between runs, so that one job's exit does not overlap the next one's start."""
    time.sleep(seconds)
