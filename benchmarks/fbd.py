"""MegaFBD memory and throughput vs the non-disaggregated run, measured in one invocation on the
same ranks: peak resident memory added by training (above the process after imports) per role,
and samples per second. Goal: forward instances <= 0.5x the memory of a baseline rank.
  python benchmarks/fbd.py [--nproc 4] [--pp 2] [--hidden 256] [--layers 4] [--iters 12]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from launch import torchrun  # noqa: E402


def run(label: str, nproc: int, args: list[str], probe: Path) -> list[dict]:
    proc = torchrun("pretrain_gpt.py", [*args, "--memory-probe", str(probe)], nproc=nproc, timeout=900,
                    extra_env={"MEGATRON_APP_PLUGINS": "megatron.fbd.memory_probe"})
    if proc.returncode != 0:
        raise SystemExit(f"{label} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]


def added_mib(record: dict) -> float:
    return (record["peak_kib"] - record["before_kib"]) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="CPU ranks of both runs (default %(default)s)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default %(default)s)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length in tokens (default %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4, help="micro-batch size in samples (default %(default)s)")
    parser.add_argument("--global-batch", type=int, default=32,
                        help="global batch size in samples (default %(default)s)")
    parser.add_argument("--iters", type=int, default=12,
                        help="training iterations per run; the first two are left out (default %(default)s)")
    args = parser.parse_args()
    common = [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "8",
        "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
        "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(args.global_batch),
        "--train-iters", str(args.iters), "--mock-data", "--vocab-size", "8192", "--device", "cpu",
        "--pipeline-model-parallel-size", str(args.pp), "--log-interval", "100",
    ]
    with tempfile.TemporaryDirectory(prefix="fbd-bench-") as tmp:
        baseline = run("baseline", args.nproc, common, Path(tmp) / "baseline")
        fbd = run("fbd", args.nproc, [*common, "--forward-backward-disaggregating"], Path(tmp) / "fbd")

    def throughput(records: list[dict]) -> float:
        # Skip the first two iterations (allocation, first weight transfer); ranks run in lockstep.
        per_rank = [statistics.median(r["iteration_times"][2:]) for r in records]
        return args.global_batch / max(per_rank)

    base_mem = statistics.mean(added_mib(r) for r in baseline)
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro batch {args.micro_batch}, "
          f"global batch {args.global_batch}, pp {args.pp}, {args.nproc} CPU ranks, {args.iters} iterations")
    print(f"{'run / role':<22}{'ranks':>6}{'peak MiB above imports':>25}{'ratio vs baseline':>20}")
    print(f"{'baseline (all ranks)':<22}{len(baseline):>6}{base_mem:>25.1f}{1.0:>20.2f}")
    for role in ("fwd", "bwd"):
        mine = [r for r in fbd if r["role"] == role]
        mem = statistics.mean(added_mib(r) for r in mine)
        print(f"{'fbd ' + role:<22}{len(mine):>6}{mem:>25.1f}{mem / base_mem:>20.2f}")
    b, f = throughput(baseline), throughput(fbd)
    print(f"{'throughput':<22}{'':>6}{'samples/s':>25}{'ratio vs baseline':>20}")
    print(f"{'baseline':<22}{'':>6}{b:>25.2f}{1.0:>20.2f}")
    print(f"{'fbd':<22}{'':>6}{f:>25.2f}{f / b:>20.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
