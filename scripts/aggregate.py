"""Merge a MegaScan trace directory into one Chrome or Perfetto trace (seed-compatible flags):
`python scripts/aggregate.py -b TRACE_DIR -o merged.json` (or `-o merged.pftrace`; `--focus` also
writes TRACE_DIR/focused_trace.*: the suspects, their peers and neighbours, and a sample)."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.scan.cli import (  # noqa: E402
    OUTPUT_HELP,
    add_aggregate_arguments,
    aggregate_and_write,
    suspects_in,
    write_focus,
)
from megatron.scan.load import retain_freed_memory  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    # --benchmark, --bench-dir and --benchmark_dir are the spellings other tracers' scripts use.
    parser.add_argument("-b", "--benchmark-dir", "--benchmark", "--bench-dir", "--benchmark_dir", dest="benchmark_dir",
                        required=True, metavar="DIR", help="the --trace-dir of the run")
    parser.add_argument("-o", "--output", default=None, help=OUTPUT_HELP)
    parser.add_argument("-d", "--detect", action="store_true", help="also run slow-rank detection after writing the "
                        "merged trace: writes DIR/abnormal.json, abnormal.txt, detection.txt and report.html")
    add_aggregate_arguments(parser)
    args = parser.parse_args()
    status, result, _, trace_format = aggregate_and_write(args.benchmark_dir, args.output, args)
    if status != 0:
        return status
    if args.detect:
        from megatron.scan.detect.cli import run_detect

        # The aggregation that wrote the merged trace is the one detection reads (made once), unless
        # it was made without aligning clocks or fitting drift, which detection always does.
        status = run_detect(argparse.Namespace(jobs=args.jobs, run_id=args.run_id, output_dir=None, no_html=False,
                                               no_what_if=False, json=False, quiet=args.quiet), args.benchmark_dir,
                            aggregation=None if args.no_align or args.no_drift else result)
        if status != 0 or not args.focus:
            return status
        # Detection just wrote its suspects: the focused view reuses them instead of detecting again.
        return write_focus(result, args.benchmark_dir, trace_format, args,
                           suspects=suspects_in(os.path.join(args.benchmark_dir, "abnormal.json")))
    return write_focus(result, args.benchmark_dir, trace_format, args) if args.focus else 0


if __name__ == "__main__":
    retain_freed_memory()  # this process is the analysis's own
    sys.exit(main())
