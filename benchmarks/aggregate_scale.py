"""Aggregation at scale: synthetic 3D-parallel traces (default 1024 ranks = TP 8 x PP 8 x DP 16,
2 iterations), then load -> match -> align -> Chrome trace, timing each step and the peak memory
of the aggregating process and its loader processes. Goals on 2 cores: 1024 ranks in < 60 s and
< 4 GiB; 4096 ranks (--dp 64) in < 120 s and < 8 GiB.
  python benchmarks/aggregate_scale.py [--tp 8 --pp 8 --dp 16] [--jobs 2] [--keep DIR]
  python benchmarks/aggregate_scale.py --sweep 4,8,16,32,64   # DP sizes: 256 .. 4096 ranks, one table
  python benchmarks/aggregate_scale.py --dp 64 --format perfetto --focus-suspects 1000  # .pftrace + focused view
  ... --format perfetto --trace-processor /path/to/trace_processor_shell  # loaded by Perfetto's own reader
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
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
    parser.add_argument("--sweep", default=None, metavar="DP,DP,...",
                        help="run once per data-parallel size (each in its own process, so peak memory is its "
                             "own) and print the growth table")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    parser.add_argument("--format", choices=("chrome", "perfetto"), default="chrome",
                        help="merged trace format: Chrome JSON or Perfetto protobuf (default %(default)s)")
    parser.add_argument("--focus-suspects", default=None, metavar="RANK,RANK,...",
                        help="also write the focused view (scripts/aggregate.py --focus) for these suspect ranks and "
                             "report its size")
    parser.add_argument("--trace-processor", default=os.environ.get("PERFETTO_TRACE_PROCESSOR"), metavar="PATH",
                        help="with --format perfetto: load the written traces with Perfetto's trace processor "
                             "(trace_processor_shell at PATH; default $PERFETTO_TRACE_PROCESSOR) and compare its "
                             "slice and flow counts with what was written")
    args = parser.parse_args()
    if args.trace_processor and args.format != "perfetto":
        parser.error("--trace-processor checks Perfetto traces: add --format perfetto")
    if args.sweep:
        return sweep(args)
    directory = Path(args.keep or tempfile.mkdtemp(prefix="megascan-scale-"))
    spec = SyntheticRun(tp=args.tp, pp=args.pp, dp=args.dp, iterations=args.iterations,
                        offsets_ms={1: 3.0, args.tp * args.dp: -2.0}, drift_ppm={5: 150.0})
    started = time.perf_counter()
    generate(spec, directory)
    generated = time.perf_counter() - started
    size = sum(p.stat().st_size for p in directory.iterdir())
    output = directory / ("merged.pftrace" if args.format == "perfetto" else "merged.json")
    result = aggregate(directory, output, jobs=args.jobs, trace_format=args.format)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    summary = result.summary()
    spread = collective_end_spread_us(result.trace, result.collectives)
    t = result.timings
    figures = dict(ranks=spec.world_size, events=summary["events"], input_mb=size / 1e6, generate=generated,
                   load=t["load"], match=t["match"], align=t["align"], emit=t["emit"], total=t["total"],
                   output_mb=output.stat().st_size / 1e6, rss_main=own, rss_loader=children,
                   spread_p95=float(sorted(spread)[int(0.95 * len(spread))]), format=args.format)
    written = {output: result.written}
    if args.focus_suspects:
        figures.update(focus(result, directory, args, written))
    if args.trace_processor:
        figures.update(trace_processor_counts(args.trace_processor, written))
    if args.json:
        print(json.dumps(figures))
        return 0
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
        (f"emit {args.format} (s)", f"{t['emit']:.2f}"),
        ("aggregate total (s)", f"{t['total']:.2f}"),
        ("output (MB)", f"{output.stat().st_size / 1e6:.1f}"),
        ("peak RSS main (GiB)", f"{own:.2f}"),
        ("peak RSS loader (GiB)", f"{children:.2f}"),
        ("spread p95 aligned (us)", f"{float(sorted(spread)[int(0.95 * len(spread))]):.1f}"),
        goal_row(spec.world_size, t["total"], own + children),
    ]
    if args.focus_suspects:
        rows += [("focused view ranks", str(figures["focus_ranks"])),
                 ("focused view (MB)", f"{figures['focus_mb']:.1f}"),
                 ("focused view write (s)", f"{figures['focus_s']:.2f}")]
    if args.trace_processor:
        for kind in ("merged", "focused"):
            if f"{kind}_tp_slices" in figures:
                rows += [(f"{kind}: TP slices", f"{figures[f'{kind}_tp_slices']} of {figures[f'{kind}_slices']}"),
                         (f"{kind}: TP flows", f"{figures[f'{kind}_tp_flows']} of {figures[f'{kind}_flows']}"),
                         (f"{kind}: TP load (s)", f"{figures[f'{kind}_tp_s']:.1f}")]
    for name, value in rows:
        print(f"{name:24s} {value:>12s}")
    if args.trace_processor:
        equal = all(figures[f"{k}_tp_slices"] == figures[f"{k}_slices"] and figures[f"{k}_tp_flows"] == figures[f"{k}_flows"]
                    for k in ("merged", "focused") if f"{k}_tp_slices" in figures)
        print(f"Perfetto's trace processor read every slice and flow written: {equal}")
        return 0 if equal else 1
    return 0


def trace_processor_counts(binary: str, written: dict[Path, dict[str, int]]) -> dict:
    """Each written Perfetto trace loaded by Perfetto's own trace processor: its slice and flow
    counts beside what the writer wrote (every event, restart and marker is a slice)."""
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    out = {}
    for path, counts in written.items():
        kind = "focused" if path.name.startswith("focused") else "merged"
        started = time.perf_counter()
        with TraceProcessor(trace=str(path), config=TraceProcessorConfig(bin_path=binary, load_timeout=600)) as tp:
            out[f"{kind}_tp_slices"] = next(iter(tp.query("select count(*) as n from slice"))).n
            out[f"{kind}_tp_flows"] = next(iter(tp.query("select count(*) as n from flow"))).n
        out[f"{kind}_tp_s"] = time.perf_counter() - started
        out[f"{kind}_slices"] = counts["events"] + counts["restarts"] + counts["markers"]
        out[f"{kind}_flows"] = counts["flows"]
    return out


def focus(result, directory: Path, args, written: dict) -> dict:
    """The focused view of --focus-suspects, written as the merged trace's format."""
    from megatron.scan.chrome import write_chrome_trace
    from megatron.scan.perfetto import focus_ranks, subset, write_perfetto_trace

    started = time.perf_counter()
    chosen = focus_ranks(result.trace, [int(r) for r in args.focus_suspects.split(",")])
    path = directory / ("focused_trace.pftrace" if args.format == "perfetto" else "focused_trace.json")
    writer = write_perfetto_trace if args.format == "perfetto" else write_chrome_trace
    written[path] = writer(*subset(result.trace, result.collectives, result.p2p, chosen.ranks), path,
                           other_data={"megascan_focus": chosen.note()})
    return dict(focus_ranks=len(chosen.ranks), focus_mb=path.stat().st_size / 1e6,
                focus_s=time.perf_counter() - started)


def goal_row(ranks: int, seconds: float, gib: float) -> tuple[str, str]:
    limit_s, limit_gib = (60, 4) if ranks <= 1024 else (120, 8)
    return f"goal met (<{limit_s} s, <{limit_gib} GiB)", str(seconds < limit_s and gib < limit_gib)


def sweep(args) -> int:
    rows = []
    for dp in (int(v) for v in args.sweep.split(",")):
        command = [sys.executable, __file__, "--tp", str(args.tp), "--pp", str(args.pp), "--dp", str(dp),
                   "--iterations", str(args.iterations), "--jobs", str(args.jobs), "--json"]
        print(f"[aggregate_scale] {args.tp * args.pp * dp} ranks ...", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"aggregate scale sweep: TP {args.tp} x PP {args.pp} x DP, {args.iterations} iterations, "
          f"{args.jobs} loader processes")
    print("| ranks | events | input MB | load s | match s | align s | emit s | total s | peak GiB (main + loader) "
          "| output MB | s per 1k ranks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['events']} | {r['input_mb']:.0f} | {r['load']:.1f} | {r['match']:.1f} | "
              f"{r['align']:.1f} | {r['emit']:.1f} | {r['total']:.1f} | {r['rss_main'] + r['rss_loader']:.2f} | "
              f"{r['output_mb']:.0f} | {r['total'] / r['ranks'] * 1000:.1f} |")
    last = rows[-1]
    name, met = goal_row(last["ranks"], last["total"], last["rss_main"] + last["rss_loader"])
    print(f"{name} at {last['ranks']} ranks: {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
