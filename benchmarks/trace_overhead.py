"""Tracing overhead: traced vs untraced iteration time measured in the same run.

Each run traces one iteration out of every four (`--trace-interval 4 --continuous-trace-iterations 1`),
so traced and untraced iterations interleave under the same machine load. The background writer
encodes a window while the next iteration runs, so that iteration's excess over the untraced
baseline (the other two iterations of each cycle) is charged to tracing too:
  traced cost = mean(traced) + (mean(following) - baseline);  ratio = traced cost / baseline
The first iterations (warm-up) are left out. Usage:
  python benchmarks/trace_overhead.py [--iters 400] [--granularity coarse|full] [--layouts pp2-dp2,tp2-pp2]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    for layout in args.layouts.split(","):
        with tempfile.TemporaryDirectory() as trace_dir:
            times = run_layout(layout, args.iters, args.granularity, trace_dir)
            trace_bytes = sum(p.stat().st_size for p in Path(trace_dir).iterdir())
        result = overhead(times, args.warmup)
        rows.append((layout, result, trace_bytes))
    print(f"trace overhead, 4 CPU ranks, {args.iters} iterations (first {args.warmup} skipped), "
          f"granularity {args.granularity}, traced and untraced iterations interleaved in one run")
    print(f"{'layout':10s} {'untraced ms':>12s} {'traced ms':>10s} {'ratio':>7s} {'overhead':>9s} {'samples':>8s} "
          f"{'95% CI':>9s} {'trace MB':>9s}")
    for layout, r, size in rows:
        print(f"{layout:10s} {r['untraced_ms']:12.2f} {r['traced_ms']:10.2f} {r['ratio']:7.4f} "
              f"{(r['ratio'] - 1) * 100:8.2f}% {r['samples']:8d} {r['ci'] * 100:8.2f}% {size / 1e6:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
