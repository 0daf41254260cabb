"""Merge a MegaScan trace directory into one Chrome trace (seed-compatible flags):
`python scripts/aggregate.py -b TRACE_DIR -o merged.json`."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.scan.cli import add_aggregate_arguments, run_aggregate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    # --benchmark, --bench-dir and --benchmark_dir are the spellings other tracers' scripts use.
    parser.add_argument("-b", "--benchmark-dir", "--benchmark", "--bench-dir", "--benchmark_dir", dest="benchmark_dir",
                        required=True, metavar="DIR", help="the --trace-dir of the run")
    parser.add_argument("-o", "--output", default=None, help="Chrome trace to write (default: DIR/merged_trace.json)")
    parser.add_argument("-d", "--detect", action="store_true", help="also run slow-rank detection after writing the "
                        "merged trace: writes DIR/abnormal.json, abnormal.txt, detection.txt and report.html")
    add_aggregate_arguments(parser)
    args = parser.parse_args()
    output = args.output or os.path.join(args.benchmark_dir, "merged_trace.json")
    status = run_aggregate(args.benchmark_dir, output, args)
    if not args.detect or status != 0:
        return status
    from megatron.scan.detect.cli import run_detect

    return run_detect(argparse.Namespace(jobs=args.jobs, run_id=args.run_id, output_dir=None, no_html=False,
                                         no_what_if=False, json=False, quiet=args.quiet), args.benchmark_dir)


if __name__ == "__main__":
    sys.exit(main())
