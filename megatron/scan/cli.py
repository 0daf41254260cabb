"""`python -m megatron.scan <command>`: `aggregate DIR -o OUT.json` merges, aligns and links all
rank traces into one Chrome trace; `synthesize` writes synthetic 3D-parallel traces; `detect`,
`hang`, `launch`, and `fault` (faults applied to a running job from outside)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from megatron.scan.load import AggregateError


def add_aggregate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", "-j", type=int, default=None, help="processes loading rank files (default: cores)")
    parser.add_argument("--run-id", default=None, help="aggregate only this run when a directory holds several")
    parser.add_argument("--no-drift", action="store_true", help="fit clock offsets only, never drift")
    parser.add_argument("--no-align", action="store_true", help="keep each rank's own wall clock")
    parser.add_argument("--summary", default=None, metavar="FILE", help="also write the summary as JSON")
    parser.add_argument("--quiet", "-q", action="store_true", help="print warnings and errors only")


def run_aggregate(directory: str, output: str, args: argparse.Namespace) -> int:
    from megatron.app.progress import reporter
    from megatron.scan.aggregate import aggregate

    try:
        # Progress goes to stderr, never into the summary on stdout; --quiet or MEGATRON_PROGRESS=0 silences it.
        result = aggregate(directory, output, jobs=args.jobs, run_id=args.run_id, allow_drift=not args.no_drift,
                           do_align=not args.no_align, progress=reporter("aggregate", quiet=args.quiet))
    except AggregateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = result.summary()
    for warning in summary["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    if not args.quiet:
        print(format_summary(summary, output))
    return 0


def format_summary(summary: dict, output: str) -> str:
    alignment = summary["alignment"]
    lines = [
        f"wrote {output}: {len(summary['ranks'])} ranks, {summary['events']} events (run {summary['run_id']})",
        f"collectives: {summary['collective_instances']} instances, {summary['collective_instances_incomplete']} "
        f"incomplete, {summary['collective_op_mismatches']} with mismatched ops",
        f"p2p: {summary['p2p_links']} send->recv links, {summary['p2p_unmatched_sends']} unmatched sends, "
        f"{summary['p2p_unmatched_recvs']} unmatched receives",
        f"clock alignment: {alignment['anchors']} anchors, models {alignment['models']}, collective finish spread "
        f"after alignment median {summary['collective_end_spread_us_median']} us, "
        f"p95 {summary['collective_end_spread_us_p95']} us",
        "  rank  anchors  residual_us  offset_us (per window)",
    ]
    for entry in alignment["ranks"]:
        offsets = ", ".join(f"{v:.1f}" for v in entry["offset_us"].values() if v is not None) or "-"
        lines.append(f"  {entry['rank']:4d}  {entry['anchors']:7d}  {entry['residual_rms_us'] or 0:11.1f}  {offsets}")
    if alignment["unanchored_ranks"]:
        lines.append(f"  unanchored (wall clock only): {alignment['unanchored_ranks']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.scan", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("aggregate", help="merge a trace directory into one Chrome trace")
    p.add_argument("directory", help="trace directory written by --trace (or by `launch`): one file per rank")
    p.add_argument("-o", "--output", default=None, help="Chrome trace to write (default: DIR/merged_trace.json)")
    add_aggregate_arguments(p)
    from megatron.scan import hang as hang_command

    hang_command.add_arguments(commands.add_parser("hang", help="merge per-rank hang dumps: which rank is stuck where"))
    from megatron.scan import launcher

    launcher.add_arguments(commands.add_parser("launch", help="trace any torch.distributed job: launch -- torchrun ..."))
    s = commands.add_parser("synthesize", help="write synthetic 3D-parallel traces (tests, benchmarks)")
    from megatron.scan.synthetic import add_arguments as add_synthetic_arguments

    add_synthetic_arguments(s)
    from megatron.scan.detect.cli import add_detect_parser

    add_detect_parser(commands)
    from megatron.scan import fault

    fault.add_arguments(commands.add_parser("fault", help="apply a fault to a running job from outside: throttle, "
                                                          "freeze, thaw, kill, release, list"))
    args = parser.parse_args(argv)
    if args.command == "fault":
        return fault.run(args)
    if args.command == "detect":
        from megatron.scan.detect.cli import run_detect

        return run_detect(args)
    if args.command == "hang":
        return hang_command.run(args)
    if args.command == "launch":
        return launcher.run(args)
    if args.command == "aggregate":
        import os

        output = args.output or os.path.join(args.directory, "merged_trace.json")
        return run_aggregate(args.directory, output, args)
    from megatron.scan.synthetic import run as run_synthetic

    return run_synthetic(args)
