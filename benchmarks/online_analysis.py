"""One online analysis from the trace files, as `--online-detect`'s analysis process runs it: a
trace directory written in windows (`python -m megatron.scan synthesize DIR --window N`, or a
kept run) is grown window by window in a scratch directory, and after each window every rank has
appended, one analysis (`megatron.scan.detect.online.analyze` with the window-by-window input) is
timed, with its steps: reading the appended lines, merging, matching, aligning the clocks (and
the robust fits inside), the window's tables, the concatenation, the analyzers, the report.
Appending takes no part in the timing.

    python -m megatron.scan synthesize /tmp/job --tp 8 --pp 8 --dp 64 --iterations 20 --window 5 \\
        --ranks-per-host 8 --offset 5:3 --offset 1000:-2.5 --drift 7:20 --drift 2048:-15
    python benchmarks/online_analysis.py /tmp/job            # each window read, aligned and tabled once
    python benchmarks/online_analysis.py /tmp/job --whole    # every file read whole each time

Prints one JSON line per window (seconds, resident memory, the iterations analysed) and the peak
memory. `--history N` as the job's --online-detect-history (0: every traced iteration). Goal at 4,096 ranks: one online
analysis <= 10 s on a 2-core machine."""
from __future__ import annotations

import argparse
import functools
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron.scan.align as align_module  # noqa: E402
import megatron.scan.detect.combine as combine_module  # noqa: E402
import megatron.scan.detect.incremental as incremental_module  # noqa: E402
import megatron.scan.detect.model as model_module  # noqa: E402
import megatron.scan.detect.report as report_module  # noqa: E402
import megatron.scan.load as load_module  # noqa: E402
import megatron.scan.match as match_module  # noqa: E402
import megatron.scan.tail as tail_module  # noqa: E402
from megatron.scan.detect.incremental import WindowedInput  # noqa: E402
from megatron.scan.detect.online import analyze, default_history  # noqa: E402
from megatron.scan.load import retain_freed_memory  # noqa: E402

# step -> (module or class, function): each call's time is added to its step
STEPS = {
    "read": (tail_module.DirectoryTail, "poll"),
    "merge": (load_module, "merge"),
    "match": (match_module, ("match_collectives", "match_p2p")),
    "align": (align_module, "align"),
    "fits": (align_module, "_fit"),
    "tables": (model_module, "from_aggregation"),
    "concatenate": (incremental_module, "concatenate"),
    "analyzers": (combine_module, "detect"),
    "report": (report_module, "as_dict"),
}


def _timed(seconds: dict[str, float]) -> None:
    """Wrap each step's functions where its callers look them up (at call time) to add up their time."""
    for step, (owner, names) in STEPS.items():
        for name in (names,) if isinstance(names, str) else names:
            original = getattr(owner, name)

            @functools.wraps(original)
            def wrapper(*args, __original=original, __step=step, **kwargs):
                started = time.perf_counter()
                try:
                    return __original(*args, **kwargs)
                finally:
                    seconds[__step] = seconds.get(__step, 0.0) + time.perf_counter() - started

            setattr(owner, name, wrapper)


def _line_ends(data: bytes) -> list[int]:
    """Offsets just past each newline."""
    ends, at = [], data.find(b"\n")
    while at >= 0:
        ends.append(at + 1)
        at = data.find(b"\n", at + 1)
    return ends


def _line(path: Path, ends: list[int], index: int) -> bytes:
    """Line `index` of the file, with its newline."""
    start = ends[index - 1] if index else 0
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(ends[index] - start)


def _resident_mb() -> int:
    """This process's resident memory now (the peak is printed at the end)."""
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * resource.getpagesize() / 2**20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="a trace directory written in windows (its files are only read)")
    parser.add_argument("--whole", action="store_true",
                        help="read every file whole before each analysis (the path of a restarted job's directory)")
    parser.add_argument("--history", type=int, default=None, metavar="N",
                        help="traced iterations each analysis covers, as --online-detect-history (default: its "
                             "default for the job's size, 20 at 4,096 ranks; 0: every one)")
    parser.add_argument("--scratch", default=None, help="where the directory is grown (default: a temporary one)")
    args = parser.parse_args(argv)
    source_dir = Path(args.directory)
    names = sorted(p.name for p in source_dir.glob("benchmark-data-*.json"))
    if not names:
        parser.error(f"{source_dir}: no benchmark-data-*.json trace files")
    retain_freed_memory()  # as the analysis process does
    seconds: dict[str, float] = {}
    _timed(seconds)
    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="online-analysis-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        # Where each file's lines end (the files are read again per window, not held: the peak
        # memory printed is the analysis's).
        ends = {}
        for name in names:
            data = (source_dir / name).read_bytes()
            ends[name] = _line_ends(data)
        windows = min(len(e) - 2 for e in ends.values())  # header and end record
        for name in names:
            (scratch / name).write_bytes(_line(source_dir / name, ends[name], 0))
        history = default_history(len(names)) if args.history is None else args.history
        source = None if args.whole else WindowedInput(scratch, history=history or None)
        fitted: dict = {}
        for window in range(1, windows + 1):
            for name in names:
                with open(scratch / name, "ab") as f:
                    f.write(_line(source_dir / name, ends[name], window))
            seconds.clear()
            started = time.perf_counter()
            result = analyze(scratch, 0, 0, fitted, source=source)
            took = time.perf_counter() - started
            print(json.dumps({
                "window": window, "ranks": len(names), "analysis_s": round(took, 2),
                "steps_s": {step: round(value, 2) for step, value in seconds.items()},
                "rss_mb": _resident_mb(), "analysed": None if result is None else result["history"],
                "verdict": None if result is None else result["verdict"],
                "suspects": None if result is None else [alert["ranks"][:4] for alert in result["alerts"]]}),
                flush=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"peak_mb": round(peak), "whole": args.whole}), flush=True)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
