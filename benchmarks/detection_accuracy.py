"""Slow-rank detection accuracy: precision, recall and top-1 localization over scenarios with
known faults: synthetic traces of 8 to 1024 ranks, and (with --real) real 4- and 8-rank CPU runs
with injected slowdowns (1.15x to 3x) and link delays. Prints one row per scenario and a total line.

    python benchmarks/detection_accuracy.py [--real] [--max-ranks 1024]"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from megatron.scan.detect import run_detection  # noqa: E402
from megatron.scan.detect.faults import FaultCase  # noqa: E402
from megatron.scan.detect.faults import generate_case  # noqa: E402

# name, (tp, pp, dp), slow {rank: factor}, links {(src, dst): ms}
SYNTHETIC = [
    ("healthy 2x2x2", (2, 2, 2), {}, {}),
    ("healthy 1x4x1", (1, 4, 1), {}, {}),
    ("pp-dp 1.15x", (1, 2, 4), {5: 1.15}, {}),
    ("tp-pp 1.5x dp=1", (2, 2, 1), {3: 1.5}, {}),
    ("3d 3x", (2, 2, 2), {6: 3.0}, {}),
    ("3d two faults", (2, 2, 2), {0: 1.5, 7: 2.0}, {}),
    ("link 10ms", (1, 4, 1), {}, {(2, 3): 10.0}),
    ("slow + link", (1, 4, 2), {1: 1.5}, {(4, 6): 10.0}),
    ("256 ranks 1.2x", (4, 4, 16), {137: 1.2}, {}),
    ("256 ranks healthy", (4, 4, 16), {}, {}),
    ("1024 ranks 1.3x", (8, 8, 16), {777: 1.3}, {}),
    ("1024 ranks two faults", (8, 8, 16), {5: 1.5, 900: 2.0}, {}),
]

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
         "--device", "cpu", "--train-iters", "10", "--trace", "--trace-interval", "1",
         "--continuous-trace-iterations", "1"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2PP2 = [*PP2, "--tensor-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP4 = ["--pipeline-model-parallel-size", "4"]
# name, ranks, layout flags, injection flags, expected ranks, expected links
REAL = [
    ("real healthy pp2 dp2", 4, PP2, [], [], []),
    ("real healthy tp2 pp2", 4, TP2PP2, [], [], []),
    ("real pp2 dp2 rank1 1.15x", 4, PP2, ["--inject-slowdown", "1:1.15"], [1], []),
    ("real pp2 dp2 rank1 1.5x", 4, PP2, ["--inject-slowdown", "1:1.5"], [1], []),
    ("real tp2 pp2 rank2 2x", 4, TP2PP2, ["--inject-slowdown", "2:2"], [2], []),
    ("real tp2 dp2 rank3 1.5x", 4, TP2, ["--inject-slowdown", "3:1.5"], [3], []),
    ("real pp2 dp2 rank2 3x", 4, PP2, ["--inject-slowdown", "2:3"], [2], []),
    ("real pp2 dp2 two faults", 4, PP2, ["--inject-slowdown", "0:2", "--inject-slowdown", "3:1.5"], [0, 3], []),
    ("real pp2 dp2 link 0->2 20ms", 4, PP2, ["--inject-link-delay", "0:2:20"], [], [(0, 2)]),
    ("real healthy tp2 pp2 dp2", 8, TP2PP2, [], [], []),
    ("real tp2 pp2 dp2 rank5 1.5x", 8, TP2PP2, ["--inject-slowdown", "5:1.5"], [5], []),
    ("real pp4 dp2 rank6 3x", 8, PP4, ["--inject-slowdown", "6:3"], [6], []),
]


def score(detection, expected_ranks, expected_links) -> dict:
    named = [tuple(s.ranks) if s.kind == "link" else s.ranks[0] for s in detection.suspects]
    expected = [*expected_ranks, *[tuple(link) for link in expected_links]]
    hits = len(set(named) & set(expected))
    return {"named": named, "expected": expected, "true_positive": hits, "false_positive": len(set(named) - set(expected)),
            "false_negative": len(set(expected) - set(named)),
            "top1": (named[:1] and named[0] in expected) if expected else not named}


def run_synthetic(max_ranks: int):
    for name, (tp, pp, dp), slow, links in SYNTHETIC:
        if tp * pp * dp > max_ranks:
            continue
        with tempfile.TemporaryDirectory() as directory:
            generate_case(FaultCase(tp=tp, pp=pp, dp=dp, slow=slow, link_delay_ms=links, iterations=2), directory)
            started = time.perf_counter()
            detection = run_detection(directory)
            seconds = time.perf_counter() - started
        yield name, tp * pp * dp, score(detection, list(slow), list(links)), seconds


def run_real(keep: str | None = None):
    from launch import torchrun

    for name, nproc, layout, inject, ranks, links in REAL:
        with tempfile.TemporaryDirectory() as scratch:
            directory = os.path.join(keep, name.replace(" ", "_").replace(">", "")) if keep else scratch
            if keep and any(Path(directory).glob("benchmark-*")):
                # Traces kept by an earlier --keep run are re-scored, not re-run.
                yield name, nproc, score(run_detection(directory, jobs=1), ranks, links), 0.0
                continue
            proc = torchrun("pretrain_gpt.py", [*MODEL, *layout, *inject, "--trace-dir", directory], nproc=nproc,
                            timeout=900)
            if proc.returncode != 0:
                print(f"{name}: training failed\n{proc.stderr[-1500:]}", file=sys.stderr)
                continue
            started = time.perf_counter()
            detection = run_detection(directory, jobs=1)
            yield name, nproc, score(detection, ranks, links), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true", help="also run the real 4- and 8-rank CPU scenarios (minutes)")
    parser.add_argument("--real-only", action="store_true")
    parser.add_argument("--max-ranks", type=int, default=1024)
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep the real runs' traces under DIR; traces already there are re-scored, not re-run")
    args = parser.parse_args()
    print(f"| scenario | ranks | expected | named | TP | FP | FN | top-1 | detect s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    totals = {"true_positive": 0, "false_positive": 0, "false_negative": 0, "top1": 0, "cases": 0, "healthy_alarms": 0}
    sources = [] if args.real_only else [run_synthetic(args.max_ranks)]
    if args.real or args.real_only:
        sources.append(run_real(args.keep))
    for source in sources:
        for name, ranks, s, seconds in source:
            print(f"| {name} | {ranks} | {s['expected']} | {s['named']} | {s['true_positive']} | {s['false_positive']} | "
                  f"{s['false_negative']} | {'yes' if s['top1'] else 'NO'} | {seconds:.1f} |", flush=True)
            for key in ("true_positive", "false_positive", "false_negative"):
                totals[key] += s[key]
            totals["top1"] += bool(s["top1"])
            totals["cases"] += 1
            totals["healthy_alarms"] += int(not s["expected"] and bool(s["named"]))
    tp, fp, fn = totals["true_positive"], totals["false_positive"], totals["false_negative"]
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    print(f"\nprecision {precision:.3f}, recall {recall:.3f}, top-1 localization {totals['top1']}/{totals['cases']}, "
          f"false alarms on healthy runs {totals['healthy_alarms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
