"""How well alignment recovers a host's clock on real traces: the two-node job of
tests/scan/test_alignment_hosts.py (two `torchrun --nnodes 2` launches of the trainer on this
machine, PP=2 x DP=2, two ranks per "node", two traced windows), node 1's files then moved to a
host of their own with a wall clock 37 ms ahead. Per run and window: the recovered offset's error,
the fastest message each way on the true clocks (their sum is how tightly the messages pin the
offset; the middle of that bound is off by at most half of it) and which estimate alignment kept.
`--busy K` runs K busy loops beside the job (a loaded host: late-observed collective finishes and
slow messages). Ends with the errors' median, 90th percentile and largest, and the windows off by
more than 0.5 ms.

Usage: python benchmarks/alignment_nodes.py [--runs 10] [--busy 2]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "scan")]

from megatron.scan.aggregate import aggregate  # noqa: E402
from test_alignment_hosts import SKEW_US, fastest_messages_us, skew_node1, two_node_job  # noqa: E402


def kept(notes: list[str], window: int) -> str:
    for note in notes:
        if note.startswith(f"window {window}: the anchor fit broke causality"):
            return "raw clocks" if "kept raw" in note else "bounds (fit broke causality)"
        if note.startswith(f"window {window}: causality bounds narrower"):
            return "bounds' middle (narrower than the anchors' scatter)"
    return "anchor fit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="two-node jobs to run (default 10)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops run beside each job (default 0)")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    errors, misses = [], []
    try:
        print(f"{'run':>3} {'window':>6} {'error us':>9} {'fastest there/back us':>22}  kept")
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="alignment_nodes_") as scratch:
                trace_dir = Path(scratch) / "trace"
                two_node_job(trace_dir)
                fastest = fastest_messages_us(aggregate(trace_dir, None, jobs=1))
                skew_node1(trace_dir)
                alignment = aggregate(trace_dir, None, jobs=1).alignment
            for window, offset in sorted(alignment.hosts[1].offset_us.items()):
                error, (there, back) = offset - SKEW_US, fastest[window]
                errors.append(abs(error))
                if abs(error) > 500:
                    misses.append((run, window, error, there + back))
                print(f"{run:>3} {window:>6} {error:>9.1f} {there:>10.0f} / {back:<9.0f}  {kept(alignment.notes, window)}",
                      flush=True)
    finally:
        for process in busy:
            process.kill()
    values = np.asarray(errors)
    print(f"\n{len(values)} windows over {args.runs} runs, {args.busy} busy loops beside: |error| median "
          f"{np.median(values):.0f} us, p90 {np.percentile(values, 90):.0f} us, largest {values.max():.0f} us; "
          f"{len(misses)} off by more than 500 us"
          + "".join(f"\n  run {r} window {w}: {e:+.0f} us, messages pin it to {b:.0f} us" for r, w, e, b in misses))


if __name__ == "__main__":
    main()
