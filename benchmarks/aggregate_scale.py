"""Aggregation at scale: synthetic 3D-parallel traces (default 1024 ranks = TP 8 x PP 8 x DP 16,
2 iterations), then load -> match -> align -> Chrome trace, timing each step and the peak memory
of the aggregating process and its loader processes. Goal: < 60 s and < 4 GiB on 2 cores.
  python benchmarks/aggregate_scale.py [--tp 8 --pp 8 --dp 16] [--jobs 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.scan.aggregate import aggregate, collective_end_spread_us  # noqa: E402
from megatron.scan.synthetic import SyntheticRun, generate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the synthetic job (default 8)")
    parser.add_argument("--pp", type=int, default=8,
                        help="pipeline-parallel size of the synthetic job (default %(default)s)")
    parser.add_argument("--dp", type=int, default=16,
                        help="data-parallel size of the synthetic job (default %(default)s)")
    parser.add_argument("--iterations", type=int, default=2,
                        help="training iterations in the synthetic traces (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="processes loading rank files (default: the CPU count, %(default)s)")
    parser.add_argument("--keep", default=None, help="generate into this directory and keep it")
    args = parser.parse_args()
    directory = Path(args.keep or tempfile.mkdtemp(prefix="megascan-scale-"))
    spec = SyntheticRun(tp=args.tp, pp=args.pp, dp=args.dp, iterations=args.iterations,
                        offsets_ms={1: 3.0, args.tp * args.dp: -2.0}, drift_ppm={5: 150.0})
    started = time.perf_counter()
    generate(spec, directory)
    generated = time.perf_counter() - started
    size = sum(p.stat().st_size for p in directory.iterdir())
    output = directory / "merged.json"
    result = aggregate(directory, output, jobs=args.jobs)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    summary = result.summary()
    spread = collective_end_spread_us(result.trace, result.collectives)
    t = result.timings
    print(f"aggregate scale: {spec.world_size} ranks (tp {args.tp} x pp {args.pp} x dp {args.dp}), "
          f"{args.iterations} iterations, {args.jobs} loader processes")
    print(f"{'step':24s} {'value':>12s}")
    rows = [
        ("generate (s)", f"{generated:.1f}"),
        ("input files (MB)", f"{size / 1e6:.1f}"),
        ("events", f"{summary['events']}"),
        ("collective instances", f"{summary['collective_instances']}"),
        ("p2p links", f"{summary['p2p_links']}"),
        ("load (s)", f"{t['load']:.2f}"),
        ("match (s)", f"{t['match']:.2f}"),
        ("align (s)", f"{t['align']:.2f}"),
        ("emit chrome json (s)", f"{t['emit']:.2f}"),
        ("aggregate total (s)", f"{t['total']:.2f}"),
        ("output (MB)", f"{output.stat().st_size / 1e6:.1f}"),
        ("peak RSS main (GiB)", f"{own:.2f}"),
        ("peak RSS loader (GiB)", f"{children:.2f}"),
        ("spread p95 aligned (us)", f"{float(sorted(spread)[int(0.95 * len(spread))]):.1f}"),
        ("goal met (<60 s, <4 GiB)", str(t["total"] < 60 and own + children < 4)),
    ]
    for name, value in rows:
        print(f"{name:24s} {value:>12s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
