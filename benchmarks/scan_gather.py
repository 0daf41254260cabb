"""Trace gathering's cost to training: two "nodes" on this machine (two `torchrun --nnodes 2
--node-rank i` launches, one rank each on a core of its own, PP=2), every iteration traced at full
granularity. Runs where each node writes its own --trace-dir (node 1's file streams to node 0's
directory over the gloo side group) alternate with runs where both write one directory (nothing
to gather), so a drift of machine load cancels. Prints the median iteration time of each kind
after warm-up, their ratio per adjacent pair, the bytes gathered and whether the gathered file is
node 1's byte for byte.

Usage: python benchmarks/scan_gather.py [--repeat 3] [--iters 60] [--rate 20]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "512",
         "--device", "cpu", "--pipeline-model-parallel-size", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(base: Path, gather: bool, iters: int, rate: float, warmup: int) -> tuple[float, int, bool]:
    """(median ms per iteration after warm-up, bytes gathered, gathered file == node 1's)."""
    shutil.rmtree(base, ignore_errors=True)
    port, cores, jobs = free_port(), sorted(os.sched_getaffinity(0)), []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for node in (0, 1):
        directory = base / (f"node{node}" if gather else "shared")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "pretrain_gpt.py", *MODEL, "--train-iters", str(iters), "--log-interval", "1", "--trace",
                   "--trace-dir", str(directory), "--trace-interval", "1", "--continuous-trace-iterations", "1",
                   "--trace-granularity", "full", "--trace-gather-rate", str(rate)]
        core = {cores[node % len(cores)]}
        jobs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=lambda: os.sched_setaffinity(0, core)))
    outputs = [job.communicate(timeout=600)[0] for job in jobs]
    if any(job.returncode for job in jobs):
        raise SystemExit("a run failed:\n" + "\n".join(output[-3000:] for output in outputs))
    times = [float(ms) for iteration, ms in LINE.findall(outputs[1]) if int(iteration) > warmup]
    name = "benchmark-data-0-pipeline-1-tensor-0.json"
    if not gather:
        return statistics.median(times), 0, True
    gathered, own = (base / "node0" / name).read_bytes(), (base / "node1" / name).read_bytes()
    return statistics.median(times), len(gathered), gathered == own


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="pairs of runs (default %(default)s)")
    parser.add_argument("--iters", type=int, default=60, help="iterations per run (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out (default %(default)s)")
    parser.add_argument("--rate", type=float, default=20.0, help="--trace-gather-rate MB/s (default %(default)s)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="scan-gather-"))
    rows = []
    try:
        for pair in range(args.repeat):
            order = (True, False) if pair % 2 == 0 else (False, True)
            result = {gather: run(base / f"run{pair}-{int(gather)}", gather, args.iters, args.rate, args.warmup)
                      for gather in order}
            rows.append(result)
            print(f"pair {pair + 1}/{args.repeat}: gathered {result[True][0]:.1f} ms, shared directory "
                  f"{result[False][0]:.1f} ms per iteration", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("| pair | gathering (ms/iter) | one directory (ms/iter) | ratio | bytes gathered | identical |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r[True][0]:.1f} | {r[False][0]:.1f} | {r[True][0] / r[False][0]:.3f} | {r[True][1]} | "
              f"{'yes' if r[True][2] else 'NO'} |")
    ratios = [r[True][0] / r[False][0] for r in rows]
    print(f"median ratio {statistics.median(ratios):.3f} over {len(rows)} pairs (medians after {args.warmup} "
          f"warm-up iterations of {args.iters})")
    return 0 if all(r[True][2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
