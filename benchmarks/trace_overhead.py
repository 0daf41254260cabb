"""Tracing overhead: traced vs untraced iteration time measured in the same run.

Each run traces one iteration out of every four (`--trace-interval 4 --continuous-trace-iterations 1`),
so traced and untraced iterations interleave under the same machine load. The background writer
encodes a window while the next iteration runs, so that iteration's excess over the untraced
baseline (the other two iterations of each cycle) is charged to tracing too:
  traced cost = mean(traced) + (mean(following) - baseline);  ratio = traced cost / baseline
The first iterations (warm-up) are left out. On a shared 2-core machine running 4 ranks that
wall-clock comparison is noisy (its 95% confidence interval is printed), so the table also gives
the tracer's CPU cost measured directly: events per traced iteration (from the trace files) x the
cost of one recorded span (timed here) + the writer's encode time per window (from the files).
The hang watchdog (`--hang-timeout`) and live metrics (`--metrics-port`) observe every span and
collective of every iteration (not only traced ones); their cost is measured the same way: the
CPU time of one observation (the larger of a span and a collective, timed here) x events per
iteration, against the untraced iteration time.

Two modes:
  --mode off-vs-on (default): the honest end-to-end figure. Whole runs with MegaScan entirely off
    (no --trace: no scan plugin, no watchdog, no collective wrappers) alternate with whole runs of
    the same job with --trace (its defaults, or every iteration with --trace-every-iteration), in
    the order off,on,on,off,off,on,... so that a slow drift of machine load cancels. Each run gives
    its trimmed-mean iteration time after warm-up; each adjacent (off, on) pair a log ratio; pairs
    are added until the 95% confidence interval of the mean ratio is within --target (default
    +-1%) or --max-pairs is reached. The extra time per iteration divided by the events recorded
    per iteration (read from the traced runs' files) is the per-event cost, printed beside the
    cost of one recorded span timed in a loop here. With --side-by-side the two runs of a pair run
    at the same time, each on its own cores (the traced one swaps cores every pair): a host whose
    speed changes from second to second (a VM sharing its CPUs) slows both alike, which whole runs
    one after the other cannot cancel. Beside wall time, each run's CPU time per iteration (user
    + system of the ranks' processes, read from /proc at the log lines of the compared iterations)
    gives a second paired ratio: on a CPU-bound job it is the work tracing adds, without the time
    a rank stood waiting for the host (--stop-on cpu stops on its interval). A single rank that
    keeps its core busy gains nothing by it: on a 2-vCPU VM both ratios spread alike (7.9% per
    pair over 40 pairs, correlation 0.98), the VM's speed changes reaching CPU time too.
  --mode interleaved: traced and untraced iterations of one run (--trace-interval 4
    --continuous-trace-iterations 1), compared cycle by cycle; also prints the tracer's own CPU
    time and the always-on observers' (watchdog, metrics) cost per iteration.
Usage:
  python benchmarks/trace_overhead.py [--layouts pp2] [--iters 60] [--target 0.01] [--max-pairs 40]
  python benchmarks/trace_overhead.py --side-by-side --layouts single --iters 150 --max-pairs 80 [--stop-on cpu]
  python benchmarks/trace_overhead.py --mode interleaved [--iters 400] [--layouts pp2-dp2,tp2-pp2]
  python benchmarks/trace_overhead.py --device cuda [--layouts single] [--max-minutes 5]   (on a GPU machine)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# layout -> (ranks, flags). Two ranks on this 2-core machine is one process per core, the least
# noisy wall-clock comparison; the four-rank layouts share cores.
LAYOUTS = {
    "single": (1, []),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
    "pp2-dp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "512", "--device", "cpu"]
# On a GPU: GPT-2 small's shape in bf16, 4 microbatches of 2 x 1024 tokens (about 0.1 s per iteration
# on one H100), so that a run's start-up does not dominate it and the kernels, not Python, set the pace.
CUDA_MODEL = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--micro-batch-size", "2", "--global-batch-size", "8",
              "--mock-data", "--vocab-size", "50257", "--bf16", "--device", "cuda"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def start_job(layout: str, iters: int, flags: list[str], cpus: set[int] | None = None,
              model: list[str] = MODEL) -> subprocess.Popen:
    """Start one run of the layout with `flags` (torchrun and its ranks confined to `cpus` if given)."""
    if layout not in LAYOUTS:
        raise SystemExit(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    ranks, layout_flags = LAYOUTS[layout]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(_free_port()), "pretrain_gpt.py", *model, *layout_flags,
               "--train-iters", str(iters), "--log-interval", "1", "--lr-decay-style", "constant", *flags]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pin)


_TICK = os.sysconf("SC_CLK_TCK")


def ranks_cpu_s(launcher: int) -> float:
    """CPU seconds (user + system, all threads) used so far by the launcher's descendants: the
    ranks and anything they started, not torchrun itself."""
    total, stack = 0.0, [launcher]
    while stack:
        pid = stack.pop()
        try:
            if pid != launcher:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / _TICK
            for task in Path(f"/proc/{pid}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
    return total


def timed_lines(proc: subprocess.Popen, layout: str) -> dict[int, tuple[float, float, float]]:
    """Per-iteration (time ms, monotonic arrival of its log line, the ranks' CPU seconds so far
    then) of a started run, once it has ended; stderr is drained by a thread so that neither pipe
    can fill."""
    errors: list[str] = []
    drain = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    drain.start()
    times, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        match = LINE.search(line)
        if match:
            times[int(match.group(1)) - 1] = (float(match.group(2)), time.monotonic(), ranks_cpu_s(proc.pid))
    proc.wait()
    drain.join()
    if proc.returncode != 0:
        raise SystemExit(f"{layout} run failed:\n{''.join(lines)[-2000:]}\n{''.join(errors)[-2000:]}")
    return times


def side_by_side_times(procs: dict[str, subprocess.Popen], layout: str,
                       warmup: int) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """Iteration times of runs started together, keeping only the iterations every run spent
    beside the others: from the last run's end of warm-up to the first run's end (a run that
    goes on alone afterwards has the host to itself, a VM's idle CPU speeds its sibling, and
    would be charged less than it spent side by side); and each run's CPU ms per iteration over
    those iterations."""
    readers: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda k=k, p=p: readers.__setitem__(k, timed_lines(p, layout)))
               for k, p in procs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if set(readers) != set(procs):
        raise SystemExit(f"a {layout} run failed (see above)")
    begin = max(min((at for it, (_, at, _) in t.items() if it >= warmup), default=float("inf")) for t in readers.values())
    end = min(max(at for _, at, _ in t.values()) for t in readers.values())
    kept = {kind: {it: (ms, cpu) for it, (ms, at, cpu) in t.items() if begin <= at <= end} for kind, t in readers.items()}
    return ({kind: {it: ms for it, (ms, _) in t.items()} for kind, t in kept.items()},
            {kind: cpu_ms_per_iteration(t) for kind, t in kept.items()})


def cpu_ms_per_iteration(times: dict[int, tuple[float, float]]) -> float:
    """The ranks' CPU ms per iteration between the first and the last of `times` ({iteration:
    (ms, CPU seconds so far at its log line)})."""
    first, last = min(times), max(times)
    return (times[last][1] - times[first][1]) * 1e3 / max(last - first, 1)


def run_job(layout: str, iters: int, flags: list[str], warmup: int = 0,
            model: list[str] = MODEL) -> tuple[dict[int, float], float]:
    """Per-iteration time (ms) of one run of the layout with `flags`, keyed by 0-based iteration,
    and the ranks' CPU ms per iteration after `warmup` iterations."""
    times = timed_lines(start_job(layout, iters, flags, model=model), layout)
    return ({it: ms for it, (ms, _, _) in times.items()},
            cpu_ms_per_iteration({it: (ms, cpu) for it, (ms, _, cpu) in times.items() if it >= warmup - 1}))


def run_layout(layout: str, iters: int, granularity: str, trace_dir: str) -> dict[int, float]:
    """One run tracing one iteration out of every four (the interleaved mode)."""
    return run_job(layout, iters, ["--trace", "--trace-dir", trace_dir, "--trace-interval", "4",
                                   "--continuous-trace-iterations", "1", "--trace-granularity", granularity])[0]


def span_cost_us(repeat: int = 50_000) -> float:
    """CPU cost of one recorded span beyond the spine's own no-op call, in µs (best of 3)."""
    from megatron.scan.timers import HostTimer
    from megatron.scan.trace_format import TraceWriter, header_fields
    from megatron.scan.tracer import Tracer, WindowSchedule

    with tempfile.TemporaryDirectory() as directory:
        header = header_fields(rank=0, world_size=1, run_id="bench", coordinates={}, sizes={})
        tracer = Tracer(writer=TraceWriter(Path(directory) / "t.json", header), timer=HostTimer(),
                        schedule=WindowSchedule(1, 1))
        best = float("inf")
        for _ in range(3):
            tracer.events.clear()
            tracer.active = False
            started = time.perf_counter()
            for _ in range(repeat):
                with tracer.span("send", peer=1, bytes=64, chunk=0, microbatch=1, direction="F"):
                    pass
            idle = time.perf_counter() - started
            tracer.begin_iteration(0)
            started = time.perf_counter()
            for _ in range(repeat):
                with tracer.span("send", peer=1, bytes=64, chunk=0, microbatch=1, direction="F"):
                    pass
            best = min(best, (time.perf_counter() - started - idle) / repeat * 1e6)
        tracer.events.clear()
        tracer.close({})
    return best


def layer_scope_cost_us(repeat: int = 2_000, layers: int = 4) -> float:
    """CPU cost of `--trace-granularity full` per layer call (its forward and its backward scope:
    the module hooks, the gradient hooks and two recorded spans), in µs: a stack of tiny layers run
    forward and backward with the scopes attached inside a traced window, against the same without
    (best of 3). Direct, because on a busy host whole runs cannot resolve it."""
    import torch

    from megatron.scan.layers import LayerScopes
    from megatron.scan.timers import HostTimer
    from megatron.scan.trace_format import TraceWriter, header_fields
    from megatron.scan.tracer import Tracer, WindowSchedule

    class Layer(torch.nn.Module):
        def __init__(self, number: int) -> None:
            super().__init__()
            self.layer_number = number
            self.self_attention = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.self_attention(x)

    stack = torch.nn.Sequential(*[Layer(i + 1) for i in range(layers)])
    x = torch.ones(2, 4, requires_grad=True)

    def run() -> float:
        started = time.perf_counter()
        for _ in range(repeat):
            stack(x).sum().backward()
        return time.perf_counter() - started

    with tempfile.TemporaryDirectory() as directory:
        header = header_fields(rank=0, world_size=1, run_id="bench", coordinates={}, sizes={})
        tracer = Tracer(writer=TraceWriter(Path(directory) / "t.json", header), timer=HostTimer(),
                        schedule=WindowSchedule(1, 1))
        scopes = LayerScopes(tracer, list(stack))
        best = float("inf")
        for _ in range(3):
            bare = run()
            tracer.begin_iteration(0)
            scopes.attach()
            traced = run()
            scopes.detach()
            tracer.events.clear()
            best = min(best, (traced - bare) / (repeat * layers) * 1e6)
        tracer.close({})
    return best


def observer_costs_us(repeat: int = 50_000) -> dict[str, float]:
    """CPU cost (µs) of one observation by the watchdog and by the metrics exporter: the larger of
    a finished span and a finished collective, beyond the spine's own no-op call (best of 3)."""
    from megatron.scan.collectives import GroupInfo
    from megatron.scan.metrics import MetricsSpans, RankMetrics
    from megatron.scan.watchdog import Watchdog, WatchdogSpans

    with tempfile.TemporaryDirectory() as directory:
        identity = {"rank": 0, "world_size": 4, "host": "bench", "coordinates": {"dp": 0, "pp": 0, "tp": 0}}
        watchdog = Watchdog(directory=directory, identity=identity, timeout=300.0)
        metrics = RankMetrics(identity)
        info = GroupInfo(gid=1, name="1", ranks=(0, 1), desc="TENSOR_MODEL_PARALLEL_GROUP")
        observers = {"watchdog": (WatchdogSpans(watchdog), watchdog.on_collective),
                     "metrics": (MetricsSpans(metrics), metrics.on_collective)}
        costs = {}
        for name, (spans, on_collective) in observers.items():
            best_span = best_collective = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                for _ in range(repeat):
                    pass
                idle = time.perf_counter() - started
                started = time.perf_counter()
                for _ in range(repeat):
                    with spans.span("send", peer=1, bytes=64, chunk=0, microbatch=1, direction="F"):
                        pass
                best_span = min(best_span, (time.perf_counter() - started - idle) / repeat * 1e6)
                started = time.perf_counter()
                for _ in range(repeat):
                    on_collective("all_reduce", info, 1, 0, 1000)
                best_collective = min(best_collective, (time.perf_counter() - started - idle) / repeat * 1e6)
            costs[name] = max(best_span, best_collective)
        metrics.close()
    return costs


def trace_costs(trace_dir: str) -> tuple[float, float]:
    """(most events per traced iteration on one rank, writer encode ms per window on that rank)."""
    from megatron.scan.trace_format import decode_column

    worst = (0.0, 0.0)
    for path in Path(trace_dir).glob("benchmark-data-*.json"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        windows = [line for line in lines if line["type"] == "window"]
        end = next((line for line in lines if line["type"] == "end"), {})
        iterations = sum(w["iterations"][1] - w["iterations"][0] + 1 for w in windows)
        events = sum(len(decode_column(w["events"]["name"])) for w in windows) / max(1, iterations)
        encode_ms = end.get("writer_encode_s", 0.0) * 1e3 / max(1, len(windows))
        worst = max(worst, (events, encode_ms))
    return worst


def trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    """Mean without the slowest and fastest `cut` share: 4 processes on 2 cores have outliers."""
    values = sorted(values)
    k = int(len(values) * cut)
    kept = values[k:len(values) - k] or values
    return statistics.fmean(kept)


def overhead(times: dict[int, float], warmup: int) -> dict[str, float]:
    """Paired per cycle of 4 iterations (traced, following, two untraced), which cancels slow
    changes of machine load: extra_c = traced + following - untraced_a - untraced_b."""
    cycles = [c for c in range(warmup // 4 + 1, max(times) // 4 + 1) if all(4 * c + k in times for k in range(4))]
    extra = [times[4 * c] + times[4 * c + 1] - times[4 * c + 2] - times[4 * c + 3] for c in cycles]
    baseline = trimmed_mean([times[4 * c + k] for c in cycles for k in (2, 3)])
    kept = sorted(extra)[int(len(extra) * 0.1):len(extra) - int(len(extra) * 0.1)] or extra
    mean_extra = statistics.fmean(kept)
    half_width = 1.96 * statistics.stdev(kept) / len(kept) ** 0.5 if len(kept) > 1 else float("nan")
    return {"untraced_ms": baseline, "traced_ms": baseline + mean_extra, "ratio": 1 + mean_extra / baseline,
            "ci": half_width / baseline, "samples": len(cycles)}


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then the normal's 1.96).
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(dof: int) -> float:
    return _T95[dof - 1] if 1 <= dof <= len(_T95) else 1.96


def ratio_interval(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(ratio on/off, lower, upper) of the 95% confidence interval, from the mean log ratio of
    paired runs (a ratio is symmetric in logs, and pairing cancels slow changes of machine load)."""
    logs = [math.log(on / off) for off, on in pairs]
    mean = statistics.fmean(logs)
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("inf")
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def events_per_iteration(trace_dir: str, iterations: int) -> float:
    """Events one rank records per iteration, averaged over every iteration of the run (traced or
    not) and over ranks: the work the tracer adds to each rank's iteration on average."""
    from megatron.scan.trace_format import decode_column

    files = list(Path(trace_dir).glob("benchmark-data-*.json"))
    total = 0
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["type"] == "window":
                total += len(decode_column(record["events"]["name"]))
    return total / max(1, len(files)) / max(1, iterations)


def off_vs_on(layout: str, args: argparse.Namespace) -> dict:
    """Alternate whole runs with MegaScan off and with --trace until the ratio's 95% interval is
    within args.target (or args.max_pairs); returns the figures of one table row. With
    args.side_by_side the two runs of a pair run at the same time, each on its own cores."""
    trace_flags = ["--trace", "--trace-granularity", args.granularity]
    if args.trace_every_iteration:
        trace_flags += ["--trace-interval", "1", "--continuous-trace-iterations", "1"]
    halves = _core_halves(layout) if args.side_by_side else None
    model = CUDA_MODEL if args.device == "cuda" else MODEL
    began = time.monotonic()
    pairs: list[tuple[float, float]] = []  # (off, on) trimmed-mean iteration ms
    cpu_pairs: list[tuple[float, float]] = []  # (off, on) the ranks' CPU ms per iteration
    events = []
    while len(pairs) < args.max_pairs:
        order = ("off", "on") if len(pairs) % 2 == 0 else ("on", "off")
        with tempfile.TemporaryDirectory() as trace_dir:
            flags = {"off": [], "on": [*trace_flags, "--trace-dir", trace_dir]}
            if halves:  # both at once; the traced run takes the other cores in every other pair
                procs = {kind: start_job(layout, args.iters, flags[kind], cpus, model=model)
                         for kind, cpus in zip(order, halves)}
                times, cpu = side_by_side_times(procs, layout, args.warmup)
            else:  # one after the other, in the order off,on,on,off,...
                runs = {kind: run_job(layout, args.iters, flags[kind], args.warmup, model=model) for kind in order}
                times, cpu = {k: r[0] for k, r in runs.items()}, {k: r[1] for k, r in runs.items()}
            events.append(events_per_iteration(trace_dir, args.iters))
        result = {kind: trimmed_mean(list(_steady(t, args.warmup))) for kind, t in times.items()}
        pairs.append((result["off"], result["on"]))
        cpu_pairs.append((cpu["off"], cpu["on"]))
        ratio, low, high = ratio_interval(pairs)
        cpu_ratio, cpu_low, cpu_high = ratio_interval(cpu_pairs)
        print(f"[overhead] {layout} pair {len(pairs)}: off {result['off']:.2f} ms, on {result['on']:.2f} ms; "
              f"ratio so far {ratio:.4f} [{low:.4f}, {high:.4f}]; CPU ms/iteration off {cpu['off']:.2f}, on "
              f"{cpu['on']:.2f}, ratio so far {cpu_ratio:.4f} [{cpu_low:.4f}, {cpu_high:.4f}]", flush=True)
        stop = (low, high, ratio) if args.stop_on == "wall" else (cpu_low, cpu_high, cpu_ratio)
        if len(pairs) >= args.min_pairs and max(stop[1] - stop[2], stop[2] - stop[0]) <= args.target:
            break
        if args.max_minutes and len(pairs) >= args.min_pairs and time.monotonic() - began > args.max_minutes * 60:
            print(f"[overhead] {layout}: --max-minutes {args.max_minutes:g} reached after {len(pairs)} pairs",
                  flush=True)
            break
    off = statistics.fmean(p[0] for p in pairs)
    ratio, low, high = ratio_interval(pairs)
    per_iteration = statistics.fmean(events)
    return {"layout": layout, "pairs": len(pairs), "off_ms": off, "on_ms": off * ratio, "ratio": ratio, "low": low,
            "high": high, "events": per_iteration, "cpu_off_ms": statistics.fmean(p[0] for p in cpu_pairs),
            "cpu": ratio_interval(cpu_pairs),
            "event_ns": [off * (r - 1) * 1e6 / per_iteration if per_iteration else float("nan") for r in (ratio, low, high)]}


def _core_halves(layout: str) -> tuple[set[int], set[int]]:
    """Two disjoint sets of this process's CPUs, one core per rank of the layout in each."""
    ranks = LAYOUTS[layout][0]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 * ranks:
        raise SystemExit(f"--side-by-side runs two {ranks}-rank jobs at once, a core per rank: it needs "
                         f"{2 * ranks} CPUs and this process may use {len(cpus)}; pick a layout of at most "
                         f"{len(cpus) // 2} rank(s) (e.g. --layouts single) or leave out --side-by-side")
    return set(cpus[:ranks]), set(cpus[ranks:2 * ranks])


def _steady(times: dict[int, float], warmup: int) -> list[float]:
    steady = [t for i, t in sorted(times.items()) if i >= warmup]
    if len(steady) < 5:
        raise SystemExit(f"only {len(steady)} iterations after the {warmup} of warm-up: raise --iters")
    return steady


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["off-vs-on", "interleaved"], default="off-vs-on",
                        help="off-vs-on: whole runs with MegaScan off against whole runs with --trace (default); "
                             "interleaved: traced and untraced iterations of one run, plus the tracer's CPU time")
    parser.add_argument("--iters", type=int, default=None,
                        help="iterations per run (default 60 for off-vs-on, 400 for interleaved)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="first iterations left out of each run (default 10 for off-vs-on, 20 for interleaved)")
    parser.add_argument("--granularity", choices=["coarse", "full"], default="coarse",
                        help="--trace-granularity of the traced runs")
    parser.add_argument("--layouts", default=None,
                        help=f"comma-separated, from {', '.join(LAYOUTS)} (default pp2 for off-vs-on, "
                             f"pp2-dp2,tp2-pp2 for interleaved)")
    parser.add_argument("--trace-every-iteration", action="store_true",
                        help="off-vs-on: trace every iteration (--trace-interval 1 --continuous-trace-iterations 1) "
                             "instead of --trace's default windows")
    parser.add_argument("--target", type=float, default=0.01,
                        help="off-vs-on: stop adding run pairs once the ratio's 95%% interval is within +-TARGET")
    parser.add_argument("--stop-on", choices=["wall", "cpu"], default="wall",
                        help="off-vs-on: the interval that --target applies to: the iteration time's (default) or the "
                             "ranks' CPU time per iteration's")
    parser.add_argument("--min-pairs", type=int, default=4, help="off-vs-on: run pairs before the first stop test")
    parser.add_argument("--max-pairs", type=int, default=40, help="off-vs-on: most run pairs per layout")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="off-vs-on: stop adding run pairs to a layout after this many minutes (once --min-pairs "
                             "are done), whatever the interval")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="off-vs-on: ranks on CPU (gloo, a tiny GPT) or on GPUs (NCCL, GPT-2 small's shape in "
                             "bf16, one GPU per rank)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="off-vs-on: run the two runs of each pair at the same time, each on its own cores "
                             "(needs 2 cores per rank; the traced run swaps cores every pair), so that changes "
                             "of the host's speed reach both alike")
    parser.add_argument("--layer-cost", metavar="LAYER_CALLS:ITERATION_MS", default=None,
                        help="only print the CPU cost of the per-layer scopes of --trace-granularity full per "
                             "layer call (forward and backward), timed directly, and what LAYER_CALLS calls per "
                             "iteration (layers per stage x microbatches) cost an ITERATION_MS iteration")
    args = parser.parse_args()
    if args.layer_cost:
        calls, iteration_ms = (float(v) for v in args.layer_cost.split(":"))
        per_call = layer_scope_cost_us()
        print(f"per-layer scopes: {per_call:.1f} us per layer call (forward + backward, best of 3); "
              f"{calls:.0f} calls per {iteration_ms:.0f} ms iteration: {per_call * calls / 1e3:.3f} ms, "
              f"{100 * per_call * calls / 1e3 / iteration_ms:.2f}% of the iteration")
        return 0
    interleaved = args.mode == "interleaved"
    args.iters = args.iters or (400 if interleaved else 60)
    args.warmup = args.warmup if args.warmup is not None else (20 if interleaved else 10)
    default = "pp2-dp2,tp2-pp2" if interleaved else ("single" if args.device == "cuda" else "pp2")
    layouts = (args.layouts or default).split(",")
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if interleaved:
        if args.device != "cpu":
            parser.error("--mode interleaved runs CPU ranks only; use the default off-vs-on mode with --device cuda")
        return interleaved_table(layouts, args)
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        wanted = max(LAYOUTS[layout][0] for layout in layouts)
        if args.side_by_side:
            parser.error("--side-by-side would put both runs of a pair on the same GPU; leave it out with --device cuda")
        if not gpus:
            parser.error("--device cuda needs a CUDA GPU and torch sees none here; leave --device out for CPU ranks")
        if gpus < wanted:
            parser.error(f"--device cuda puts one rank on each GPU: layouts {', '.join(layouts)} need {wanted} and "
                         f"this machine has {gpus}; pick --layouts single (or fewer ranks)")
    cost_ns = span_cost_us() * 1e3
    rows = [off_vs_on(layout, args) for layout in layouts]
    what = "every iteration" if args.trace_every_iteration else "--trace defaults (2 of every 5 iterations)"
    pairing = ("the two runs of a pair at the same time on their own cores, swapped every pair" if args.side_by_side
               else "runs alternated off,on,on,off,...")
    print(f"\nMegaScan off vs --trace ({what}, granularity {args.granularity}), {args.device.upper()} ranks, "
          f"{args.iters} iterations "
          f"per run (first {args.warmup} left out), {pairing}; a recorded span costs {cost_ns:.0f} ns in a loop")
    print(f"{'layout':8s} {'pairs':>5s} {'off ms':>8s} {'on ms':>8s} {'ratio':>7s} {'95% CI':>17s} "
          f"{'events/it':>9s} {'ns/event (95% CI)':>26s} {'CPU ms off':>10s} {'CPU ratio':>9s} {'CPU 95% CI':>17s} "
          f"{'CPU ns/event':>12s}")
    for r in rows:
        cpu_ratio, cpu_low, cpu_high = r["cpu"]
        print(f"{r['layout']:8s} {r['pairs']:5d} {r['off_ms']:8.2f} {r['on_ms']:8.2f} {r['ratio']:7.4f} "
              f"[{r['low']:.4f}, {r['high']:.4f}] {r['events']:9.1f} {r['event_ns'][0]:8.0f} "
              f"[{r['event_ns'][1]:.0f}, {r['event_ns'][2]:.0f}] {r['cpu_off_ms']:10.2f} {cpu_ratio:9.4f} "
              f"[{cpu_low:.4f}, {cpu_high:.4f}] "
              f"{r['cpu_off_ms'] * (cpu_ratio - 1) * 1e6 / r['events'] if r['events'] else float('nan'):12.0f}")
    if any(r["high"] - r["ratio"] > args.target for r in rows):
        print(f"the interval is wider than +-{args.target:.0%}: this host's run-to-run noise hides the tracer; its "
              f"CPU cost per iteration is events/it x the span cost above")
    return 0


def interleaved_table(layouts: list[str], args: argparse.Namespace) -> int:
    rows = []
    cost_us = span_cost_us()
    always_on_us = observer_costs_us()
    for layout in layouts:
        with tempfile.TemporaryDirectory() as trace_dir:
            times = run_layout(layout, args.iters, args.granularity, trace_dir)
            trace_bytes = sum(p.stat().st_size for p in Path(trace_dir).iterdir())
            events, encode_ms = trace_costs(trace_dir)
        result = overhead(times, args.warmup)
        cpu_ms = events * cost_us / 1e3 + encode_ms  # one window = one traced iteration here
        rows.append((layout, result, trace_bytes, events, cpu_ms))
    print(f"trace overhead, CPU ranks, {args.iters} iterations (first {args.warmup} skipped), "
          f"granularity {args.granularity}, traced and untraced iterations interleaved in one run; "
          f"one recorded span costs {cost_us:.2f} us")
    print(f"{'layout':8s} {'untraced ms':>11s} {'traced ms':>10s} {'ratio':>7s} {'95% CI':>8s} {'cycles':>6s} "
          f"{'events/it':>9s} {'tracer cpu ms':>13s} {'cpu ratio':>9s} {'trace MB':>8s}")
    for layout, r, size, events, cpu_ms in rows:
        print(f"{layout:8s} {r['untraced_ms']:11.2f} {r['traced_ms']:10.2f} {r['ratio']:7.4f} "
              f"{r['ci'] * 100:7.2f}% {r['samples']:6d} {events:9.0f} {cpu_ms:13.3f} "
              f"{1 + cpu_ms / r['untraced_ms']:9.4f} {size / 1e6:8.2f}")
    print()
    print("always-on observers (every iteration): one observation costs "
          + ", ".join(f"{name} {cost:.2f} us" for name, cost in always_on_us.items()))
    print(f"{'layout':8s} {'events/it':>9s} " + " ".join(f"{name + ' cpu ms':>16s} {name + ' ratio':>15s}"
                                                     for name in always_on_us))
    for layout, r, size, events, cpu_ms in rows:
        cells = []
        for cost in always_on_us.values():
            observer_ms = events * cost / 1e3
            cells.append(f"{observer_ms:16.3f} {1 + observer_ms / r['untraced_ms']:15.4f}")
        print(f"{layout:8s} {events:9.0f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
