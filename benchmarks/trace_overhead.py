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
Usage:
  python benchmarks/trace_overhead.py [--iters 400] [--granularity coarse|full] [--layouts pp2-dp2,tp2-pp2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LAYOUTS = {
    "pp2-dp2": ["--pipeline-model-parallel-size", "2"],
    "tp2-pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
}
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "512", "--device", "cpu"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def run_layout(layout: str, iters: int, granularity: str, trace_dir: str) -> dict[int, float]:
    """Per-iteration time (ms) of one 4-rank run, keyed by 0-based iteration."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(_free_port()),
               "pretrain_gpt.py", *MODEL, *LAYOUTS[layout], "--train-iters", str(iters), "--log-interval", "1",
               "--lr-decay-style", "constant", "--trace", "--trace-dir", trace_dir, "--trace-interval", "4",
               "--continuous-trace-iterations", "1", "--trace-granularity", granularity]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{layout} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return {int(m.group(1)) - 1: float(m.group(2)) for m in LINE.finditer(proc.stdout)}


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
    worst = (0.0, 0.0)
    for path in Path(trace_dir).glob("benchmark-data-*.json"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        windows = [line for line in lines if line["type"] == "window"]
        end = next((line for line in lines if line["type"] == "end"), {})
        iterations = sum(w["iterations"][1] - w["iterations"][0] + 1 for w in windows)
        events = sum(len(w["events"]["name"]) for w in windows) / max(1, iterations)
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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--granularity", choices=["coarse", "full"], default="coarse")
    parser.add_argument("--layouts", default="pp2-dp2,tp2-pp2")
    args = parser.parse_args()
    rows = []
    cost_us = span_cost_us()
    always_on_us = observer_costs_us()
    for layout in args.layouts.split(","):
        with tempfile.TemporaryDirectory() as trace_dir:
            times = run_layout(layout, args.iters, args.granularity, trace_dir)
            trace_bytes = sum(p.stat().st_size for p in Path(trace_dir).iterdir())
            events, encode_ms = trace_costs(trace_dir)
        result = overhead(times, args.warmup)
        cpu_ms = events * cost_us / 1e3 + encode_ms  # one window = one traced iteration here
        rows.append((layout, result, trace_bytes, events, cpu_ms))
    print(f"trace overhead, 4 CPU ranks, {args.iters} iterations (first {args.warmup} skipped), "
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
