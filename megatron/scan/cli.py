"""`python -m megatron.scan <command>`: `aggregate DIR -o OUT.json|OUT.pftrace` merges, aligns and
links all rank traces into one Chrome or Perfetto trace; `synthesize` writes synthetic 3D-parallel traces; `detect`,
`hang`, `launch`, and `fault` (faults applied to a running job from outside)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from megatron.scan.load import AggregateError


TRACE_FORMATS = ("chrome", "perfetto")
AUTO_PERFETTO_RANKS = 1024  # above this many ranks, no -o and no --format: Perfetto (Chrome JSON gets too big)
OUTPUT_HELP = ("trace to write: Chrome JSON, or Perfetto protobuf for a .pftrace/.perfetto-trace name (default: "
               "DIR/merged_trace.json; DIR/merged_trace.pftrace above 1024 ranks)")


def add_aggregate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", "-j", type=int, default=None, help="processes loading rank files (default: cores)")
    parser.add_argument("--run-id", default=None, help="aggregate only this run when a directory holds several")
    parser.add_argument("--no-drift", action="store_true", help="fit clock offsets only, never drift")
    parser.add_argument("--no-align", action="store_true", help="keep each rank's own wall clock")
    parser.add_argument("--summary", default=None, metavar="FILE", help="also write the summary as JSON")
    parser.add_argument("--quiet", "-q", action="store_true", help="print warnings and errors only")
    parser.add_argument("--format", choices=TRACE_FORMATS, default=None, dest="trace_format",
                        help="chrome: Chrome trace JSON (chrome://tracing, Perfetto UI; large); perfetto: Perfetto's "
                             "protobuf trace (ui.perfetto.dev; about a third of the size, opens at thousands of "
                             "ranks). Default: from the -o name; without -o, chrome up to 1024 ranks, perfetto above")
    parser.add_argument("--focus", action="store_true",
                        help="also write DIR/focused_trace.json|.pftrace: only the ranks slow-rank detection names, "
                             "their peers (same stage in other DP replicas, their TP group), their pipeline "
                             "neighbours, rank 0 and --focus-sample other ranks; runs detection unless -d did")
    parser.add_argument("--focus-sample", type=int, default=16, metavar="N",
                        help="healthy ranks the focused view keeps for comparison, evenly spread (default %(default)s)")


def format_for(output: str | None, trace_format: str | None) -> str | None:
    """The format an -o name and --format ask for; None when neither says. Raises AggregateError
    when they disagree (an extension naming the other format)."""
    named = None
    if output is not None:
        lowered = output.lower()
        if lowered.endswith((".pftrace", ".perfetto-trace")):
            named = "perfetto"
        elif lowered.endswith(".json"):
            named = "chrome"
    if trace_format is not None and named is not None and trace_format != named:
        raise AggregateError(f"-o {output} names a {named} trace but --format {trace_format} was given: use a "
                             f"{'.pftrace' if trace_format == 'perfetto' else '.json'} name or drop --format")
    return trace_format or named


def aggregate_and_write(directory: str, output: str | None, args: argparse.Namespace):
    """Aggregate and write the merged trace; returns (status, Aggregation or None, output, format)."""
    import os

    from megatron.app.progress import reporter
    from megatron.scan.aggregate import aggregate, write_trace

    progress = reporter("aggregate", quiet=args.quiet)
    try:
        trace_format = format_for(output, getattr(args, "trace_format", None))
        # Progress goes to stderr, never into the summary on stdout; --quiet or MEGATRON_PROGRESS=0 silences it.
        result = aggregate(directory, None, jobs=args.jobs, run_id=args.run_id, allow_drift=not args.no_drift,
                           do_align=not args.no_align, progress=progress)
    except AggregateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2, None, output, None
    automatic = trace_format is None and output is None and len(result.trace.ranks) > AUTO_PERFETTO_RANKS
    trace_format = "perfetto" if automatic else trace_format or "chrome"
    output = output or os.path.join(directory, "merged_trace.pftrace" if trace_format == "perfetto"
                                    else "merged_trace.json")
    if automatic:
        print(f"note: {len(result.trace.ranks)} ranks (> {AUTO_PERFETTO_RANKS}): writing the Perfetto protobuf trace "
              f"{output} (open it in ui.perfetto.dev); --format chrome writes Chrome JSON", file=sys.stderr)
    write_trace(result, output, trace_format, progress=progress)
    result.timings["total"] += result.timings["emit"]
    summary = result.summary()
    for warning in summary["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    if not args.quiet:
        print(format_summary(summary, output))
    return 0, result, output, trace_format


def run_aggregate(directory: str, output: str | None, args: argparse.Namespace) -> int:
    status, result, _, trace_format = aggregate_and_write(directory, output, args)
    if status or not getattr(args, "focus", False):
        return status
    return write_focus(result, directory, trace_format, args)


def detected_suspects(result) -> list[int]:
    """Every rank a suspect of detection names (slow ranks and both ends of slow links), detection
    run on the aggregation in hand (no second load)."""
    from megatron.scan.detect import detect, from_aggregation

    detection = detect(from_aggregation(result))
    return [rank for suspect in detection.suspects for rank in suspect.ranks]


def suspects_in(abnormal_json: str) -> list[int]:
    """The suspects' ranks in an abnormal.json written by detection (-d)."""
    with open(abnormal_json) as f:
        return [rank for suspect in json.load(f).get("suspects", []) for rank in suspect["ranks"]]


def write_focus(result, directory: str, trace_format: str, args: argparse.Namespace,
                suspects: list[int] | None = None) -> int:
    """DIR/focused_trace.<ext>: see --focus. `suspects`: detection's, when it already ran."""
    import os

    from megatron.scan.chrome import write_chrome_trace
    from megatron.scan.perfetto import focus_ranks, subset, write_perfetto_trace

    if args.focus_sample < 0:
        print("error: --focus-sample must be >= 0", file=sys.stderr)
        return 2
    if suspects is None:
        suspects = detected_suspects(result)
    focus = focus_ranks(result.trace, suspects, args.focus_sample)
    path = os.path.join(directory, "focused_trace" + (".pftrace" if trace_format == "perfetto" else ".json"))
    writer = write_perfetto_trace if trace_format == "perfetto" else write_chrome_trace
    writer(*subset(result.trace, result.collectives, result.p2p, focus.ranks), path,
           other_data={"megascan_focus": focus.note(), "megascan": result.summary()})
    note = focus.note()
    print(f"wrote focused view {path}: {len(focus.ranks)} of {len(result.trace.ranks)} ranks, "
          f"{os.path.getsize(path) / 1e6:.1f} MB; suspects {note['kept'].get('suspect', 'none')}; "
          f"{note['left_out_ranks']} ranks left out (listed in the file's megascan_focus note)")
    return 0


def format_summary(summary: dict, output: str) -> str:
    alignment = summary["alignment"]
    lines = [
        f"wrote {output}: {len(summary['ranks'])} ranks, {summary['events']} events (run {summary['run_id']})",
        f"collectives: {summary['collective_instances']} instances, {summary['collective_instances_incomplete']} "
        f"incomplete, {summary['collective_op_mismatches']} with mismatched ops",
        f"p2p: {summary['p2p_links']} send->recv links, {summary['p2p_unmatched_sends']} unmatched sends, "
        f"{summary['p2p_unmatched_recvs']} unmatched receives",
        f"clock alignment ({_clocks(alignment)}): {alignment['anchors']} anchors "
        f"({alignment.get('p2p_anchors', 0)} P2P), models {alignment['models']}, collective finish spread after "
        f"alignment median {summary['collective_end_spread_us_median']} us, "
        f"p95 {summary['collective_end_spread_us_p95']} us",
    ]
    lines.extend(format_alignment(alignment))
    return "\n".join(lines)


def _clocks(alignment: dict) -> str:
    hosts = len(alignment.get("hosts", []))
    if not alignment["ranks"]:
        return "off: each rank on its own wall clock"
    if alignment.get("clock_domains") == "rank":
        return "one clock per rank: no host identities in the trace"
    return f"one clock per host, {hosts} host{'s' if hosts != 1 else ''}" + (", nothing to align" if hosts == 1 else "")


def format_alignment(alignment: dict) -> list[str]:
    """The clocks: one per host (or per rank for old traces), the figures on the raw clocks and
    on the aligned ones, which corrections were dropped, then per host and per rank."""
    from megatron.scan.hang import rank_ranges

    lines = [f"  note: {note}" for note in alignment.get("notes", [])]
    before, after = alignment.get("before"), alignment.get("after")
    if before and after:
        def spread(f: dict) -> str:
            return f"median {f['finish_spread_us_median']} us, p95 {f['finish_spread_us_p95']} us"
        lines += [f"  finish spread (latest - earliest finish) of {before['collective_instances']} synchronous "
                  f"collectives: raw clocks {spread(before)}; aligned {spread(after)}",
                  f"  P2P receives ending before their send started: raw clocks {before['causality_violations']}, "
                  f"aligned {after['causality_violations']} of {before['p2p_messages']}"]
    hosts = alignment.get("hosts", [])
    if alignment.get("clock_domains") != "rank" and hosts:
        lines.append(f"  {len(hosts)} host clock(s): host  ranks  offset_us (per window)")
        for host in hosts:
            offsets = ", ".join(f"{v:.1f}" for v in host["offset_us"].values() if v is not None) or "-"
            marks = (" (reference)" if host["reference"] else "") + \
                (f" (raw clock kept in windows {host['kept_raw_windows']})" if host["kept_raw_windows"] else "")
            lines.append(f"  {host['host']}  {rank_ranges(host['ranks'])}  {offsets}{marks}")
    lines.append("  rank  anchors  residual_us  offset_us (per window)")
    for entry in alignment["ranks"]:
        offsets = ", ".join(f"{v:.1f}" for v in entry["offset_us"].values() if v is not None) or "-"
        lines.append(f"  {entry['rank']:4d}  {entry['anchors']:7d}  {entry['residual_rms_us'] or 0:11.1f}  {offsets}")
    if alignment["unanchored_ranks"]:
        lines.append(f"  unanchored (wall clock only): {alignment['unanchored_ranks']}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.scan", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("aggregate", help="merge a trace directory into one Chrome or Perfetto trace")
    p.add_argument("directory", help="trace directory written by --trace (or by `launch`): one file per rank")
    p.add_argument("-o", "--output", default=None, help=OUTPUT_HELP)
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
    c = commands.add_parser("capture", help="ask a running job to trace the next K iterations on every rank, or "
                                           "change its window schedule")
    c.add_argument("--job", required=True, metavar="DIR_OR_URL",
                   help="the job's --trace-dir on rank 0's node, or rank 0's metrics address http://HOST:PORT "
                        "(the job needs --metrics-control-token-file)")
    c.add_argument("--token-file", default=None, metavar="FILE", help="with an http:// job: the token the job was "
                   "given (--metrics-control-token-file)")
    c.add_argument("--iterations", type=int, default=None, metavar="K", help="iterations to trace, from an iteration "
                   "the ranks agree on (two after rank 0 reads the request)")
    c.add_argument("--trace-interval", type=int, default=None, metavar="N",
                   help="from then on, trace --continuous-trace-iterations of every N iterations")
    c.add_argument("--continuous-trace-iterations", type=int, default=None, metavar="C",
                   help="with --trace-interval: iterations per window (default 1)")
    c.add_argument("--online-detect-confirm", type=int, default=None, metavar="N",
                   help="change the job's --online-detect-confirm (analyses in a row before a single-analyzer "
                        "suspect is reported) from its next analysis on")
    c.add_argument("--online-detect-min-slowdown", type=float, default=None, metavar="X",
                   help="change the job's --online-detect-min-slowdown (compute factor over peers) from its next "
                        "analysis on")
    c.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for rank 0's answer (0: do not wait)")
    args = parser.parse_args(argv)
    if argv is None and args.command in ("detect", "aggregate"):
        # Run as a program (python -m megatron.scan), the process is the analysis's own; a caller
        # that passes its arguments keeps its allocator as it is.
        from megatron.scan.load import retain_freed_memory

        retain_freed_memory()
    if args.command == "capture":
        return run_capture(args)
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
        return run_aggregate(args.directory, args.output, args)
    from megatron.scan.synthetic import run as run_synthetic

    return run_synthetic(args)


def run_capture(args: argparse.Namespace) -> int:
    """Leaves the request in the job's trace directory and waits for rank 0's answer."""
    import os
    import time

    from megatron.scan.control import write_request

    settings = {"online_detect_confirm": args.online_detect_confirm,
                "online_detect_min_slowdown": args.online_detect_min_slowdown}
    settings = {key: value for key, value in settings.items() if value is not None}
    if args.iterations is None and args.trace_interval is None and not settings:
        print("error: give --iterations K (a window now), --trace-interval N (a new schedule), or online detection "
              "thresholds (--online-detect-confirm, --online-detect-min-slowdown)", file=sys.stderr)
        return 2
    if args.iterations is not None and args.iterations < 1 or args.trace_interval is not None and args.trace_interval < 1:
        print("error: --iterations and --trace-interval must be >= 1", file=sys.stderr)
        return 2
    request = {"iterations": args.iterations or 0, "interval": args.trace_interval or 0,
               "continuous": args.continuous_trace_iterations or 0, **settings}
    if args.job.startswith(("http://", "https://")):
        fetch = _http_capture(args, request)
        if fetch is None:
            return 2
        where = args.job
    else:
        if not os.path.isdir(args.job):
            print(f"error: {args.job} is not a directory: give the running job's --trace-dir", file=sys.stderr)
            return 2
        path = write_request(args.job, request)
        agreed = path.with_name(path.name.replace("request-", "agreed-"))
        fetch = lambda: json.loads(agreed.read_text()) if agreed.exists() else None  # noqa: E731
        where = str(path.parent)
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        answer = fetch()
        if answer is not None:
            if "error" in answer:
                print(f"error: the job refused the request: {answer['error']}", file=sys.stderr)
                return 2
            what = []
            if answer.get("online_detect"):
                what.append("online detection now uses " + ", ".join(f"{k} {v:g}" for k, v in
                                                                     answer["online_detect"].items()))
            if answer.get("iterations"):
                what.append(f"iterations {answer['start']}..{answer['start'] + answer['iterations'] - 1} are traced "
                            f"on every rank")
            if answer.get("interval"):
                what.append(f"from iteration {answer['start']} on, {answer['continuous']} of every "
                            f"{answer['interval']} iterations are traced")
            print(f"agreed by the job (rank 0 read the request after iteration {answer['read_at_iteration']}): "
                  + "; ".join(what))
            return 0
        time.sleep(0.2)
    if args.wait:
        print(f"error: no answer from the job within {args.wait:g} s: is it running with --trace (and its trace "
              f"directory {args.job})? The request stays ({where}) and is taken when rank 0 reaches it", file=sys.stderr)
        return 1
    print(f"request left ({where})")
    return 0


def _http_capture(args: argparse.Namespace, request: dict):
    """POSTs the request to rank 0's metrics port; returns a function polling for the answer."""
    import urllib.error
    import urllib.request

    if not args.token_file:
        print("error: an http:// job needs --token-file (the job's --metrics-control-token-file)", file=sys.stderr)
        return None
    with open(args.token_file) as f:
        headers = {"Authorization": f"Bearer {f.read().strip()}", "Content-Type": "application/json"}
    base = args.job.rstrip("/")
    body = json.dumps({"iterations": request["iterations"], "trace_interval": request["interval"],
                       "continuous_trace_iterations": request["continuous"],
                       **{k: v for k, v in request.items() if k.startswith("online_detect_")}}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base}/capture", data=body, headers=headers),
                                    timeout=10) as reply:
            name = json.loads(reply.read())["answer"]
    except urllib.error.HTTPError as exc:
        print(f"error: the job refused the request ({exc.code}): {json.loads(exc.read() or b'{}').get('error')}",
              file=sys.stderr)
        return None
    except OSError as exc:
        print(f"error: cannot reach {base}: {exc}", file=sys.stderr)
        return None

    def fetch():
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{base}/capture/{name}", headers=headers),
                                        timeout=10) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
    return fetch
