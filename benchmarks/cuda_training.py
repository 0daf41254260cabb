"""One-GPU figures for the CUDA path (NCCL, megatron-core DDP + optimizer, CUDA events):

  1. trainer throughput (pretrain_gpt.py --device cuda) in fp32 and bf16, with model TFLOP/s;
  2. MegaScan tracing cost on CUDA: the same run with --trace (every iteration traced);
  3. our pipeline executor against megatron-core's own schedule on the same model, data,
     DDP and optimizer (time per iteration, and whether the losses are identical).

    python benchmarks/cuda_training.py [--iters 30] [--layers 12] [--hidden 768] [--seq 1024]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from training_throughput import ITER_MS  # the trainer's per-iteration time, from its log line

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONWARNINGS="ignore")


def trainer_ms(args, extra: list[str]) -> float:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29533",
        "pretrain_gpt.py", "--device", "cuda", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--max-position-embeddings", str(args.seq), "--micro-batch-size", str(args.mbs),
        "--global-batch-size", str(args.mbs * args.microbatches), "--train-iters", str(args.iters),
        "--mock-data", "--vocab-size", str(args.vocab), "--log-interval", "1", "--eval-interval", "0", *extra,
    ]
    proc = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(extra)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    times = [float(ms) for it, ms in ITER_MS.findall(proc.stdout) if int(it) > args.warmup]
    return statistics.median(times)


def schedule_ms(args, mode: str, bf16: bool) -> tuple[float, list]:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, str(ROOT / "tests" / "app" / "workers" / "mcore_schedule_compare.py"), "--mode", mode,
            "--iters", str(args.iters), "--microbatches", str(args.microbatches), "--layers", str(args.layers),
            "--hidden", str(args.hidden), "--heads", str(args.heads), "--seq", str(args.seq), "--mbs", str(args.mbs),
            "--vocab", str(args.vocab), "--skip-weights", "--out", out, *(["--bf16"] if bf16 else []),
        ]
        proc = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} schedule failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        result = torch.load(Path(out) / "rank0.pt", weights_only=False)
    return statistics.median(result["seconds"][args.warmup:]) * 1e3, result["losses"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30, help="training iterations per run (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out of the timing")
    parser.add_argument("--layers", type=int, default=12, help="transformer layers (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (default %(default)s)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default %(default)s)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length in tokens (default %(default)s)")
    parser.add_argument("--mbs", type=int, default=4, help="micro-batch size in samples (default %(default)s)")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="microbatches per iteration; global batch = mbs x microbatches (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=50257,
                        help="vocabulary size of the mock data (default %(default)s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/cuda_training.py needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    tokens = args.mbs * args.microbatches * args.seq
    # Training FLOPs per token: 6 x (non-embedding parameters + output layer) plus attention scores.
    params = 12 * args.layers * args.hidden ** 2 + args.vocab * args.hidden
    flops_per_iter = tokens * (6 * params + 12 * args.layers * args.hidden * args.seq)
    print(f"{name}, torch {torch.__version__}; GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"{args.microbatches} microbatches of {args.mbs} ({tokens} tokens/iteration), median of iterations "
          f"{args.warmup + 1}..{args.iters}", flush=True)

    print("\n1-2. trainer (pretrain_gpt.py --device cuda, NCCL world of 1)")
    print(f"{'precision':<10} {'tracing':<26} {'ms/iter':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'vs untraced':>12}")
    for precision, flag in (("fp32", []), ("bf16", ["--bf16"])):
        base = None
        for label, extra in (("off", []), ("--trace (every iteration)",
                                           ["--trace", "--trace-interval", "1", "--continuous-trace-iterations", "1",
                                            "--trace-dir", tempfile.mkdtemp(prefix="cuda_trace_")])):
            ms = trainer_ms(args, [*flag, *extra])
            base = base or ms
            print(f"{precision:<10} {label:<26} {ms:>9.1f} {tokens * 1e3 / ms:>10.0f} "
                  f"{flops_per_iter / ms / 1e9:>8.1f} {ms / base:>11.3f}x", flush=True)

    print("\n3. pipeline executor vs megatron-core schedule (forward_backward_no_pipelining), same DDP/optimizer")
    print(f"{'precision':<10} {'ours ms':>9} {'mcore ms':>9} {'ratio':>7} {'losses identical':>17}")
    for precision, bf16 in (("fp32", False), ("bf16", True)):
        ours_ms, ours_losses = schedule_ms(args, "ours", bf16)
        mcore_ms, mcore_losses = schedule_ms(args, "mcore", bf16)
        print(f"{precision:<10} {ours_ms:>9.1f} {mcore_ms:>9.1f} {ours_ms / mcore_ms:>6.3f}x "
              f"{str(ours_losses == mcore_losses):>17}", flush=True)


if __name__ == "__main__":
    main()
