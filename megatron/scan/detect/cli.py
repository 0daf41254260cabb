"""`python -m megatron.scan detect DIR` (and `scripts/aggregate.py -b DIR -d`): run slow-rank
detection on a trace directory, print the short report, write abnormal.json/.txt and report.html."""
from __future__ import annotations

import argparse
import sys


def add_detect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", default=None, metavar="DIR",
                        help="where abnormal.json, abnormal.txt, detection.txt, report.html go (default: the trace dir)")
    parser.add_argument("--no-html", action="store_true", help="skip report.html")
    parser.add_argument("--no-what-if", action="store_true", help="skip the what-if replay")
    parser.add_argument("--json", action="store_true", help="print abnormal.json instead of the text report")


def add_detect_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser("detect", help="find slow ranks and links in a trace directory")
    p.add_argument("directory", help="trace directory written by --trace (or by `launch`)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="processes loading rank files (default: cores)")
    p.add_argument("--run-id", default=None, help="analyze only this run when a directory holds several")
    add_detect_arguments(p)
    return p


def run_detect(args: argparse.Namespace, directory: str | None = None, aggregation=None) -> int:
    """Exit status 0 with or without suspects (a finding is not an error); 2 when the input is
    unusable. `aggregation`: the directory's, when the caller made it already."""
    import json

    from megatron.app.progress import reporter
    from megatron.scan.detect import run_detection
    from megatron.scan.detect.report import as_dict, text_report, write_outputs
    from megatron.scan.load import AggregateError

    directory = directory or args.directory
    try:
        # Progress goes to stderr, never into the report or --json on stdout; MEGATRON_PROGRESS=0 silences it.
        progress = reporter("detect", quiet=getattr(args, "quiet", False))
        detection = run_detection(directory, jobs=args.jobs, run_id=args.run_id,
                                  what_if=not getattr(args, "no_what_if", False), progress=progress,
                                  aggregation=aggregation)
    except AggregateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with progress.step("writing reports"):
        paths = write_outputs(detection, args.output_dir or directory, html=not getattr(args, "no_html", False))
    if getattr(args, "json", False):
        print(json.dumps(as_dict(detection), indent=1))
    else:
        print(text_report(detection))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
