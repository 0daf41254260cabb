"""Slow-rank detection at MegaScan's default settings (`--trace` alone: the dense start, then 2 in 5,
coarse spans) on the project's trainer, 4 CPU ranks, the first ITERATIONS iterations, in every
4-rank layout (DP, PP-only, TP x PP, PP x DP): healthy runs, one rank slowed 1.25x in-process
(--inject-slowdown), one rank throttled from outside by a cgroup CPU quota. Each scenario
--repeat times, round-robin; per scenario the runs that named the slowed rank first, the runs
that named any other rank, and the verdicts. Rows marked `held out` were not looked at while the
detectors' thresholds were chosen.

    python benchmarks/detection_defaults.py --repeat 10 [--layouts dp4,pp4] [--keep DIR]"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "scan")]

from megatron.scan.detect import run_detection  # noqa: E402

ITERATIONS = 20
PP2, TP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"], \
    ["--pipeline-model-parallel-size", "4"]
LAYOUTS = {"dp4": [], "pp4": PP4, "tp2-pp2": [*TP2, *PP2], "pp2-dp2": PP2}
# The rank slowed per layout and scenario; (layout, kind) pairs in HELD_OUT were left out of tuning.
SLOWED = {("dp4", "inject"): 1, ("dp4", "throttle"): 2, ("pp4", "inject"): 1, ("pp4", "throttle"): 2,
          ("tp2-pp2", "inject"): 2, ("tp2-pp2", "throttle"): 1, ("pp2-dp2", "inject"): 1, ("pp2-dp2", "throttle"): 3}
HELD_OUT = {("dp4", "throttle"), ("pp4", "throttle"), ("tp2-pp2", "throttle"), ("pp2-dp2", "throttle")}
FACTOR = 1.25
# 4 ranks on 2 cores get half a core each: a 0.3-core quota slows the throttled rank about 1.3-1.6x.
QUOTA = 0.3


def scenarios(layouts: list[str]) -> list:
    from fault_runs import Scenario, Throttle

    out = []
    for layout in layouts:
        flags = LAYOUTS[layout]
        out.append(Scenario(name=f"{layout} healthy", nproc=4, layout=flags, iterations=ITERATIONS, defaults=True,
                            healthy_of=f"{layout} healthy"))
        rank = SLOWED[(layout, "inject")]
        out.append(Scenario(name=f"{layout} inject r{rank} {FACTOR}x", nproc=4, layout=flags, expected=[rank],
                            inject=["--inject-slowdown", f"{rank}:{FACTOR}"], iterations=ITERATIONS, defaults=True,
                            healthy_of=f"{layout} healthy"))
        rank = SLOWED[(layout, "throttle")]
        out.append(Scenario(name=f"{layout} throttle r{rank} {QUOTA} core", nproc=4, layout=flags, expected=[rank],
                            throttles=[Throttle(rank=rank, fraction=QUOTA)], iterations=ITERATIONS, defaults=True,
                            healthy_of=f"{layout} healthy"))
    return out


def run_one(scenario, directory: Path) -> dict:
    from fault_runs import run

    saved = directory / "run.json"
    if saved.exists():  # kept by an earlier --keep run: re-scored, not re-run
        entry = json.loads(saved.read_text())
    else:
        outcome = run(scenario, directory)
        entry = {"ok": outcome.returncode == 0, "median_ms": outcome.median_ms(first=3)}
        if not entry["ok"]:
            print(f"{scenario.name}: training exited {outcome.returncode}:\n{outcome.stdout[-1500:]}", file=sys.stderr)
        directory.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(entry))
    if entry["ok"]:
        detection = run_detection(directory, jobs=1, what_if=False)
        named = [s.ranks[0] for s in detection.suspects if s.kind == "rank"]
        entry.update(named=named, verdict=detection.verdict,
                     power=detection.power.line() if detection.power is not None else None,
                     leading=(detection.leading or {}).get("rank"))
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="runs per scenario (default 10)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--keep", metavar="DIR", help="keep each run's traces under DIR (a later run re-scores them)")
    args = parser.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}: choose from {', '.join(LAYOUTS)}")
    chosen = scenarios(layouts)
    results: dict[str, list[dict]] = {s.name: [] for s in chosen}
    started, total = time.perf_counter(), args.repeat * len(chosen)
    for round_ in range(args.repeat):
        for scenario in chosen:
            with tempfile.TemporaryDirectory() as scratch:
                name = scenario.name.replace(" ", "_")
                directory = Path(args.keep) / f"{name}-{round_}" if args.keep else Path(scratch) / "trace"
                entry = run_one(scenario, directory)
            results[scenario.name].append(entry)
            done = sum(len(v) for v in results.values())
            print(f"[{done}/{total} {time.perf_counter() - started:.0f}s] {scenario.name}: "
                  f"{entry.get('verdict', 'TRAINING FAILED')} named {entry.get('named')} "
                  f"({entry['median_ms']:.0f} ms/it) {entry.get('power') or ''}", file=sys.stderr, flush=True)
    print(f"\nMegaScan defaults (--trace alone), 4 ranks, {ITERATIONS} iterations, {args.repeat} runs per scenario\n")
    print("| scenario | job slowdown | slowed rank named first | runs naming another rank | verdicts |")
    print("| --- | --- | --- | --- | --- |")
    for scenario in chosen:
        runs = [r for r in results[scenario.name] if r["ok"]]
        baseline = sorted(r["median_ms"] for r in results[scenario.healthy_of] if r["ok"])
        mine = sorted(r["median_ms"] for r in runs)
        slowdown = (mine[len(mine) // 2] / baseline[len(baseline) // 2]) if mine and baseline else float("nan")
        first = sum(1 for r in runs if r["named"][:1] == scenario.expected[:1]) if scenario.expected else None
        wrong = sum(1 for r in runs if set(r["named"]) - set(scenario.expected))
        verdicts = ", ".join(f"{v} {n}" for v, n in sorted(Counter(r["verdict"] for r in runs).items()))
        kind = "throttle" if scenario.throttles else "inject" if scenario.inject else "healthy"
        held = " (held out)" if (scenario.name.split()[0], kind) in HELD_OUT else ""
        failed = len(results[scenario.name]) - len(runs)
        print(f"| {scenario.name}{held} | {'-' if scenario.healthy else f'{slowdown:.2f}x'} | "
              f"{'-' if first is None else f'{first}/{len(runs)}'} | {wrong}/{len(runs)} | {verdicts}"
              f"{f', {failed} failed' if failed else ''} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
