"""Iterations/s of the 4-rank CPU configurations (real torchrun + gloo), one table.

    python benchmarks/training_throughput.py [--iters 20] [--hidden-size 128] [--seq-length 128]
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "TP=2 PP=2 DP=1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "TP=1 PP=4 DP=1 (vpp 2)": ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
    "TP=1 PP=2 DP=2": ["--pipeline-model-parallel-size", "2"],
}
ITER_MS = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def run(layout_args: list[str], args) -> list[float]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(port),
        "pretrain_gpt.py", "--num-layers", "8", "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", str(args.iters),
        "--mock-data", "--vocab-size", "4096", "--log-interval", "1", "--device", "cpu", *layout_args,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stderr[-3000:]}")
    times = [float(ms) for it, ms in ITER_MS.findall(proc.stdout) if int(it) > args.warmup]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="training iterations per layout (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the timing")
    parser.add_argument("--hidden-size", type=int, default=128, help="hidden size of the model (default %(default)s)")
    parser.add_argument("--seq-length", type=int, default=128, help="sequence length in tokens (default %(default)s)")
    args = parser.parse_args()
    print(f"8-layer GPT, hidden {args.hidden_size}, seq {args.seq_length}, global batch 16 (micro 2), "
          f"4 CPU ranks over gloo, {os.cpu_count()} cores; iterations {args.warmup + 1}..{args.iters}")
    rows = []
    for name, layout in LAYOUTS.items():
        print(f"  running {name} ...", flush=True)
        times = run(layout, args)
        mean_ms = sum(times) / len(times)
        rows.append((name, mean_ms, 1e3 / mean_ms, 16 * args.seq_length * 1e3 / mean_ms))
    fastest = min(r[1] for r in rows)
    print(f"\n{'layout':<24} {'ms/iter':>9} {'iter/s':>8} {'tokens/s':>10} {'vs fastest':>11}")
    for name, ms, its, tps in rows:
        print(f"{name:<24} {ms:9.1f} {its:8.2f} {tps:10.0f} {ms / fastest:10.2f}x")


if __name__ == "__main__":
    main()
