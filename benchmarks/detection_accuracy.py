"""Slow-rank detection accuracy: precision, recall and top-1 localization over scenarios with
known faults: synthetic traces of 8 to 1024 ranks, and (with --real) real 4- and 8-rank CPU runs
with injected slowdowns (1.15x to 3x) and link delays. Prints one row per scenario and a total line.
With --external, real runs whose faults come from outside the job (cgroup CPU quotas through
`python -m megatron.scan fault`) and from the in-process injector, each repeated --repeat times
beside healthy runs of every layout: hit rate, wrong names and job-level slowdown per scenario,
precision / recall / top-1 over all runs, and the resolution. With --replay-online, those kept
runs replayed window by window through the online analysis (wrong alerts over every window); with
--online, live --online-detect runs against a throttle applied mid-run (time to detect). With
--loops, training loops this project did not write (Hugging Face Trainer, Lightning, ignite, plain
DDP) run under `python -m megatron.scan launch`, healthy and with one rank throttled from outside
(benchmarks/detection_loops.py).

    python benchmarks/detection_accuracy.py [--real] [--max-ranks 1024]
    python benchmarks/detection_accuracy.py --external --repeat 5 [--jitter-sweep] [--keep DIR]
    python benchmarks/detection_accuracy.py --replay-online --iterations 14 --keep DIR
    python benchmarks/detection_accuracy.py --online --repeat 3 --iterations 24 [--keep DIR]
    python benchmarks/detection_accuracy.py --loops hf_trainer,lightning,ignite,torch_ddp --repeat 5 [--keep DIR]"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "scan"))

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


def kept_name(scenario_name: str) -> str:
    """The directory name a run of `scenario_name` is kept under (--keep): spaces and other
    separators as "_", arrows without ">" ("link 0->2" -> "link_0-2")."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", scenario_name.replace(">", ""))


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
            directory = os.path.join(keep, kept_name(name)) if keep else scratch
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


PP2, TP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"], \
    ["--pipeline-model-parallel-size", "4"]
LAYOUTS = {"pp2-dp2": (4, PP2), "tp2-pp2": (4, [*TP2, *PP2]), "tp2-dp2": (4, TP2), "dp4": (4, []),
           "pp4": (4, PP4), "tp2-pp2-dp2": (8, [*TP2, *PP2]), "pp4-dp2": (8, PP4)}


def external_scenarios(iterations: int) -> list:
    """Faults applied from outside (cgroup CPU quotas on one or two ranks, light to heavy, from the
    start or mid-run) and by the in-process injector (constant factor, bursty stalls), on DP, TP,
    PP, PP-only and mixed layouts of 4 and 8 ranks; plus each layout healthy. The healthy runs are
    the job-level baseline and the false-alarm count."""
    from fault_runs import Scenario, Throttle

    def make(name, layout, expected, *, throttles=(), inject=(), links=()):
        nproc, flags = LAYOUTS[layout]
        # Per-layer spans (--trace-granularity full): PP-only ranks have no same-stage peer and are
        # compared layer by layer.
        return Scenario(name=name, nproc=nproc, layout=flags, expected=list(expected), expected_links=list(links),
                        throttles=list(throttles), inject=list(inject), iterations=iterations, granularity="full",
                        healthy_of=f"healthy {layout}")

    mid, early = iterations // 2, iterations // 3
    scenarios = [make(f"healthy {layout}", layout, []) for layout in LAYOUTS]
    scenarios += [
        make("pp2-dp2 throttle r1 0.5 core", "pp2-dp2", [1], throttles=[Throttle(rank=1, fraction=0.5)]),
        make("pp2-dp2 throttle r1 0.3 core", "pp2-dp2", [1], throttles=[Throttle(rank=1, fraction=0.3)]),
        make("pp2-dp2 throttle r1 0.15 core", "pp2-dp2", [1], throttles=[Throttle(rank=1, fraction=0.15)]),
        # The fault tool is started when iteration `early` is logged and takes effect a few
        # iterations later (it starts in about a second): about half the run is throttled.
        make(f"pp2-dp2 throttle r2 0.3 core from it {early}", "pp2-dp2", [2],
             throttles=[Throttle(rank=2, fraction=0.3, onset=early)]),
        make("pp2-dp2 throttle r0+r3 0.3 core", "pp2-dp2", [0, 3],
             throttles=[Throttle(rank=0, fraction=0.3), Throttle(rank=3, fraction=0.3)]),
        # Two ranks that each hold back their own replica: DP peers, and the two ranks of one stage
        # (where neither has a healthy same-stage peer to be compared with).
        make("dp4 throttle r1+r2 0.3 core", "dp4", [1, 2],
             throttles=[Throttle(rank=1, fraction=0.3), Throttle(rank=2, fraction=0.3)]),
        make("pp2-dp2 throttle r2+r3 0.3 core", "pp2-dp2", [2, 3],
             throttles=[Throttle(rank=2, fraction=0.3), Throttle(rank=3, fraction=0.3)]),
        make("tp2-pp2 throttle r2 0.3 core", "tp2-pp2", [2], throttles=[Throttle(rank=2, fraction=0.3)]),
        make("tp2-dp2 throttle r3 0.3 core", "tp2-dp2", [3], throttles=[Throttle(rank=3, fraction=0.3)]),
        make("dp4 throttle r2 0.3 core", "dp4", [2], throttles=[Throttle(rank=2, fraction=0.3)]),
        make("pp4 throttle r1 0.3 core", "pp4", [1], throttles=[Throttle(rank=1, fraction=0.3)]),
        make("pp2-dp2 inject r1 1.5x", "pp2-dp2", [1], inject=["--inject-slowdown", "1:1.5"]),
        make("tp2-pp2 inject r2 stalls 40/100 ms", "tp2-pp2", [2], inject=["--inject-stall", "2:40:100"]),
        make(f"tp2-dp2 inject r1 1.5x from it {mid}", "tp2-dp2", [1], inject=["--inject-slowdown", f"1:1.5:{mid}"]),
        make("pp4 inject r2 1.5x", "pp4", [2], inject=["--inject-slowdown", "2:1.5"]),
        make("pp2-dp2 link 0->2 +20 ms", "pp2-dp2", [], links=[(0, 2)], inject=["--inject-link-delay", "0:2:20"]),
        make("tp2-pp2-dp2 throttle r5 0.3 core", "tp2-pp2-dp2", [5], throttles=[Throttle(rank=5, fraction=0.3)]),
        make("pp4-dp2 throttle r6 0.3 core", "pp4-dp2", [6], throttles=[Throttle(rank=6, fraction=0.3)]),
        # 8 ranks on 2 cores get a quarter core each: only a quota below that slows a rank.
        make("tp2-pp2-dp2 throttle r5 0.1 core", "tp2-pp2-dp2", [5], throttles=[Throttle(rank=5, fraction=0.1)]),
        make("pp4-dp2 throttle r6 0.1 core", "pp4-dp2", [6], throttles=[Throttle(rank=6, fraction=0.1)]),
        make("tp2-pp2-dp2 inject r5 stalls 40/100 ms", "tp2-pp2-dp2", [5], inject=["--inject-stall", "5:40:100"]),
    ]
    return scenarios


def run_external(repeat: int, iterations: int, keep: str | None, only: str | None, max_ranks: int) -> int:
    """Every scenario `repeat` times, round-robin (so that drift in the host's load reaches all
    alike); prints one line per run as it goes, then the table."""
    from fault_runs import run as run_scenario

    scenarios = [s for s in external_scenarios(iterations) if s.nproc <= max_ranks
                 and (only is None or only in s.name or s.healthy)]
    results: dict[str, list[dict]] = {s.name: [] for s in scenarios}
    total = repeat * len(scenarios)
    started = time.perf_counter()
    for round_ in range(repeat):
        for scenario in scenarios:
            with tempfile.TemporaryDirectory() as scratch:
                directory = Path(keep) / f"{kept_name(scenario.name)}-{round_}" if keep \
                    else Path(scratch)
                saved = directory / "run.json"
                if keep and saved.exists():  # kept by an earlier --keep run: re-scored, not re-run
                    entry = json.loads(saved.read_text())
                else:
                    outcome = run_scenario(scenario, directory)
                    entry = {"median_ms": outcome.median_ms(first=max(2, scenario.onset + 1)),
                             "ok": outcome.returncode == 0, "quota_acted": quota_acted("".join(outcome.fault_output))}
                    if keep:
                        directory.mkdir(parents=True, exist_ok=True)
                        saved.write_text(json.dumps(entry))
                        (directory / "job.log").write_text(outcome.stdout + "\n--- fault tool ---\n"
                                                           + "".join(outcome.fault_output))
                    if outcome.returncode != 0:
                        print(f"{scenario.name}: training exited {outcome.returncode}:\n{outcome.stdout[-1500:]}",
                              file=sys.stderr, flush=True)
                log = directory / "job.log"
                if "quota_acted" not in entry and log.exists():
                    entry["quota_acted"] = quota_acted(log.read_text())
                if entry["ok"]:
                    detection = run_detection(directory, jobs=1, what_if=False)
                    entry.update(score(detection, scenario.expected, scenario.expected_links), verdict=detection.verdict)
                results[scenario.name].append(entry)
            done = sum(len(v) for v in results.values())
            print(f"[{done}/{total} {time.perf_counter() - started:.0f}s] {scenario.name}: "
                  f"{entry.get('verdict', 'TRAINING FAILED')} named {entry.get('named')} ({entry['median_ms']:.0f} ms/it)",
                  file=sys.stderr, flush=True)
    return report_external(scenarios, results)


QUOTA_LINE = re.compile(r"released rank (\d+) .*the quota stopped it in (\d+) of (\d+) periods")


def quota_acted(fault_output: str) -> dict[str, float]:
    """{rank: share of scheduler periods in which its quota stopped it}, from the fault tool's
    release lines: how much an external throttle actually bound."""
    return {m.group(1): int(m.group(2)) / int(m.group(3)) for m in QUOTA_LINE.finditer(fault_output)
            if int(m.group(3))}


def report_external(scenarios: list, results: dict[str, list[dict]]) -> int:
    import statistics

    print("| scenario | ranks | expected | job slowdown | quota acted (median share of periods) | named (hit rate) "
          "| runs with a wrong name | verdicts |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    totals = {"true_positive": 0, "false_positive": 0, "false_negative": 0, "top1": 0, "runs": 0}
    healthy_runs = healthy_alarms = 0
    resolution: list[tuple[float, float]] = []
    for scenario in scenarios:
        runs = [r for r in results[scenario.name] if r["ok"]]
        baseline = [r["median_ms"] for r in results.get(scenario.healthy_of, []) if r["ok"]]
        mine = [r["median_ms"] for r in runs]
        slowdown = statistics.median(mine) / statistics.median(baseline) if mine and baseline else float("nan")
        expected = scenario.expected + [tuple(link) for link in scenario.expected_links]
        hits = sum(1 for r in runs if set(expected) <= set(r["named"])) if expected else \
            sum(1 for r in runs if not r["named"])
        wrong = sum(1 for r in runs if set(r["named"]) - set(expected))
        verdicts = ", ".join(f"{v} {n}" for v, n in sorted(statistics_counter(r["verdict"] for r in runs).items()))
        failed = len(results[scenario.name]) - len(runs)
        acted = {}
        for r in runs:
            for rank, share in (r.get("quota_acted") or {}).items():
                acted.setdefault(rank, []).append(share)
        quota = ", ".join(f"r{rank} {statistics.median(v):.0%}" for rank, v in sorted(acted.items())) or "-"
        print(f"| {scenario.name} | {scenario.nproc} | {expected or '-'} | "
              f"{'-' if scenario.healthy else f'{slowdown:.2f}x'} | {quota} | {hits}/{len(runs)} | {wrong}/{len(runs)} | "
              f"{verdicts}{f', {failed} failed to train' if failed else ''} |", flush=True)
        for r in runs:
            for key in ("true_positive", "false_positive", "false_negative"):
                totals[key] += r[key]
            totals["top1"] += bool(r["top1"])
            totals["runs"] += 1
        if scenario.healthy:
            healthy_runs += len(runs)
            healthy_alarms += sum(1 for r in runs if r["named"])
        elif runs and scenario.expected:
            resolution.append((slowdown, hits / len(runs)))
    tp, fp, fn = totals["true_positive"], totals["false_positive"], totals["false_negative"]
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    print(f"\nprecision {precision:.3f}, recall {recall:.3f}, top-1 {totals['top1']}/{totals['runs']} runs, "
          f"healthy runs with a name {healthy_alarms}/{healthy_runs}")
    goal = [(s, rate) for s, rate in resolution if s >= 1.2]
    print(f"faults that slowed the job >= 1.2x: {sum(1 for _, rate in goal if rate >= 0.9)} of {len(goal)} scenarios "
          f"named in >= 90% of their runs (goal: all)")
    named_90 = sorted(s for s, rate in resolution if rate >= 0.9 and s == s)
    missed = sorted((s, rate) for s, rate in resolution if rate < 0.9)
    print(f"resolution: smallest job-level slowdown named in >= 90% of runs: "
          f"{f'{named_90[0]:.2f}x' if named_90 else 'none'}; scenarios below 90%: "
          f"{', '.join(f'{s:.2f}x ({100 * r:.0f}%)' for s, r in missed) or 'none'}")
    return 0


ONLINE_ALERT = re.compile(r"online detection \(iterations (\d+)-(\d+)\): rank (\d+) ")


def windows_between(applied: int, last: int, interval: int, continuous: int) -> int:
    """Traced windows from the first one holding an iteration >= `applied` to the one ending at
    `last`, both counted (window k traces iterations k*interval .. k*interval + continuous - 1)."""
    first_window = max(0, -(-(applied - continuous + 1) // interval))
    return (last - continuous + 1) // interval - first_window + 1


def windows_begun_after(applied: int, last: int, interval: int, continuous: int) -> int:
    """Like windows_between, counting from the first window that began after the fault took
    effect: iteration `applied` is the one whose log line came first after it, so it may have run
    partly before it, and the iterations after it began under the fault. (The first window
    holding an iteration >= applied + continuous is the first one starting after `applied`.)"""
    return windows_between(applied + continuous, last, interval, continuous)


def run_online(repeat: int, iterations: int, window: tuple[int, int] = (1, 1),
               fractions: tuple[float, ...] = (0.15, 0.3), keep: str | None = None) -> None:
    """--online-detect against a throttle applied from outside mid-run (windows of `window` =
    (--trace-interval, --continuous-trace-iterations)): time from the throttle to the first alert
    naming its rank, in traced windows and seconds, and the job's slowdown and how often the quota
    bound (a quota near what the rank asks for binds rarely and slows it little). With `keep`,
    each run's traces are kept under it and replayed window by window after the run
    (replay_windows): an alert of the live run that the replay does not raise came from the
    live setting (the analysis process beside the job), not from the detectors."""
    import statistics

    from fault_runs import Scenario, Throttle
    from fault_runs import run as run_scenario

    onset = iterations // 2
    interval, continuous = window
    extra = ["--online-detect", "--trace-interval", str(interval), "--continuous-trace-iterations", str(continuous)]
    shape = f"windows {continuous}/{interval}"
    # The same layouts without a fault: any alert there is a wrong one.
    scenarios = [Scenario(name=f"{layout} healthy, {shape}", nproc=4, layout=LAYOUTS[layout][1], expected=[],
                          iterations=iterations, extra=extra) for layout in ("pp2-dp2", "tp2-pp2")]
    for fraction in fractions:
        scenarios += [
            Scenario(name=f"pp2-dp2 throttle r1 {fraction:g} core from it {onset}, {shape}", nproc=4,
                     layout=LAYOUTS["pp2-dp2"][1], expected=[1],
                     throttles=[Throttle(rank=1, fraction=fraction, onset=onset)], iterations=iterations, extra=extra),
            Scenario(name=f"tp2-pp2 throttle r2 {fraction:g} core from it {onset}, {shape}", nproc=4,
                     layout=LAYOUTS["tp2-pp2"][1], expected=[2],
                     throttles=[Throttle(rank=2, fraction=fraction, onset=onset)], iterations=iterations, extra=extra),
        ]
    rows = {s.name: [] for s in scenarios}
    for round_ in range(repeat):
        for scenario in scenarios:
            replayed = None
            with tempfile.TemporaryDirectory() as scratch:
                directory = Path(keep) / f"online-{kept_name(scenario.name)}-{round_}" \
                    if keep else Path(scratch)
                outcome = run_scenario(scenario, directory)
                if keep and outcome.returncode == 0:
                    (directory / "job.log").write_text(outcome.stdout)
                    replayed = sum(1 for _, alerts in replay_windows(directory)
                                   if {a["ranks"][0] for a in alerts if a["kind"] == "rank"} - set(scenario.expected))
            lines = outcome.stdout.splitlines(keepends=True)
            first, wrong = None, []
            applied = outcome.onset_iteration()  # the tool starts in ~1 s: a few iterations after `onset`
            applied = onset if applied is None else applied
            for line, at in zip(lines, outcome.line_times):
                match = ONLINE_ALERT.search(line)
                if not match:
                    continue
                last, rank = int(match.group(2)), int(match.group(3))
                if rank in scenario.expected and last >= applied:
                    if first is None:
                        first = (windows_between(applied, last, interval, continuous),
                                 at - outcome.fault_started[0] if outcome.fault_started else float("nan"),
                                 windows_begun_after(applied, last, interval, continuous))
                else:  # another rank, or the right one before the throttle was applied
                    if not wrong:  # the first one's evidence, to see why
                        print(f"[online] wrong alert: {line.strip()[:600]}", file=sys.stderr, flush=True)
                    wrong.append(f"rank {rank} at iteration {last}")
            # The job's own slowdown: iterations with the quota in force against those before it
            # (log lines count from 1; the first two are start-up).
            slowdown = outcome.median_ms(first=applied + 2) / outcome.median_ms(first=3, last=applied)
            acted = quota_acted("".join(outcome.fault_output)).get(str(scenario.expected[0]), float("nan")) \
                if scenario.expected else float("nan")
            rows[scenario.name].append({"ok": outcome.returncode == 0, "first": first, "wrong": len(wrong),
                                        "slowdown": slowdown, "acted": acted, "replayed_wrong": replayed})
            print(f"[online {round_ + 1}/{repeat}] {scenario.name}: throttle applied at iteration {applied}, job "
                  f"{slowdown:.2f}x, quota bound in {acted:.0%} of periods; first alert (windows, seconds) {first}; "
                  f"wrong alerts {len(wrong)}: {', '.join(wrong) or '-'}"
                  f"{'' if replayed is None else f'; replayed from its traces, analyses with a wrong alert {replayed}'}",
                  file=sys.stderr, flush=True)
    print("\n| online scenario | runs | job slowdown (median) | quota bound (median share of periods) | detected "
          "| within 2 windows | windows to detect (median / max) | within 2 windows begun under the fault "
          "| seconds (median / max) | runs with a wrong alert | the same runs replayed (--keep) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for scenario in scenarios:
        runs = [r for r in rows[scenario.name] if r["ok"]]
        replayed = [r["replayed_wrong"] for r in runs if r["replayed_wrong"] is not None]
        replay = f"{sum(1 for n in replayed if n)}/{len(replayed)}" if replayed else "-"
        found = [r["first"] for r in runs if r["first"] is not None]
        windows = [f[0] for f in found]
        seconds = [f[1] for f in found]
        slow = statistics.median(r["slowdown"] for r in runs) if runs else float("nan")
        acted = statistics.median(r["acted"] for r in runs) if runs else float("nan")
        if not scenario.expected:
            print(f"| {scenario.name} | {len(runs)} | - | - | - | - | - | - | - | "
                  f"{sum(1 for r in runs if r['wrong'])}/{len(runs)} | {replay} |")
            continue
        print(f"| {scenario.name} | {len(runs)} | {slow:.2f}x | {acted:.0%} | {len(found)}/{len(runs)} | "
              f"{sum(1 for w in windows if w <= 2)}/{len(runs)} | "
              f"{f'{statistics.median(windows):g} / {max(windows)}' if found else '-'} | "
              f"{sum(1 for f in found if f[2] <= 2)}/{len(runs)} | "
              f"{f'{statistics.median(seconds):.1f} / {max(seconds):.1f}' if found else '-'} | "
              f"{sum(1 for r in runs if r['wrong'])}/{len(runs)} | {replay} |", flush=True)


def kept_runs(keep: str, scenario) -> list[Path]:
    """The kept --external runs of `scenario` under `keep` that trained to the end."""
    runs, round_ = [], 0
    while (Path(keep) / f"{kept_name(scenario.name)}-{round_}" / "run.json").exists():
        directory = Path(keep) / f"{kept_name(scenario.name)}-{round_}"
        if json.loads((directory / "run.json").read_text())["ok"]:
            runs.append(directory)
        round_ += 1
    return runs


def replay_windows(directory: Path, confirm_analyses: int = 2):
    """Yield, for k = MIN_ITERATIONS.. the number of windows every rank wrote, (k, online alerts)
    of `online.analyze` on a copy of `directory` whose trace files hold their first k windows:
    what --online-detect saw after each window of that run (the same code on the same bytes; only
    the analysis process's own CPU use, which runs at idle priority, is missing). Alerts are those
    Confirmation(confirm_analyses) reports, as --online-detect-confirm does live."""
    from megatron.scan.detect.incremental import WindowedInput
    from megatron.scan.detect.online import MIN_ITERATIONS, Confirmation, analyze, default_history

    lines = {path.name: path.read_bytes().splitlines(keepends=True)
             for path in directory.glob("benchmark-data-*.json")}
    ends = {name: [i + 1 for i, line in enumerate(rows) if line.startswith(b'{"type":"window"')]
            for name, rows in lines.items()}
    fitted: dict = {}
    confirm = Confirmation(confirm_analyses)
    with tempfile.TemporaryDirectory() as scratch:
        # as the analysis process reads the growing files
        source = WindowedInput(scratch, history=default_history(len(lines)))
        for k in range(MIN_ITERATIONS, min(len(e) for e in ends.values()) + 1):
            for name, rows in lines.items():
                (Path(scratch) / name).write_bytes(b"".join(rows[:ends[name][k - 1]]))
            result = analyze(scratch, k - 1, k - 1, fitted, source=source)
            yield k, confirm((result or {}).get("alerts", []))[0]


def replay_online(keep: str, iterations: int, only: str | None, max_ranks: int, confirm: int = 2) -> int:
    """--replay-online: every kept --external run replayed window by window through the online
    analysis (one-iteration windows, as those runs were traced). Per scenario: runs in which any
    analysis named a rank or link it should not have (in a healthy run, any alert; the online
    false-alarm rate, over many more analyses than one offline verdict), and for faults present
    from the start, in how many runs and after how many windows the faulty ranks were all named."""
    import statistics

    scenarios = [s for s in external_scenarios(iterations) if s.nproc <= max_ranks
                 and (only is None or only in s.name or s.healthy)]
    print("| scenario | runs | runs with a wrong alert | analyses with a wrong alert | named online "
          "| windows to name (median / max) | wrong alerts, first of each run |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    total_runs = total_wrong = healthy_runs = healthy_wrong = 0
    for scenario in scenarios:
        expected = set(scenario.expected) | {tuple(link) for link in scenario.expected_links}
        runs = kept_runs(keep, scenario)
        wrong_runs, analyses, wrong_analyses, firsts, examples = 0, 0, 0, [], []
        for directory in runs:
            first, wrong = None, []
            for k, alerts in replay_windows(directory, confirm):
                analyses += 1
                named = {a["ranks"][0] if a["kind"] == "rank" else tuple(a["ranks"]) for a in alerts}
                if named - expected:
                    wrong_analyses += 1
                    wrong.append(f"{sorted(map(str, named - expected))} after {k}")
                if expected and first is None and expected <= named:
                    first = k
            wrong_runs += bool(wrong)
            examples += wrong[:1]
            if first is not None:
                firsts.append(first)
            print(f"[replay] {directory.name}: named after {first} windows; wrong alerts: {len(wrong)}",
                  file=sys.stderr, flush=True)
        total_runs += len(runs)
        total_wrong += wrong_runs
        if scenario.healthy:
            healthy_runs += len(runs)
            healthy_wrong += wrong_runs
        # Mid-run faults: the windows before the fault took effect are counted too.
        timing = f"{statistics.median(firsts):g} / {max(firsts)}" if firsts and scenario.onset == 0 else "-"
        print(f"| {scenario.name} | {len(runs)} | {wrong_runs}/{len(runs)} | {wrong_analyses}/{analyses} | "
              f"{f'{len(firsts)}/{len(runs)}' if expected else '-'} | {timing} | {'; '.join(examples) or '-'} |",
              flush=True)
    print(f"\nruns with a wrong online alert: {total_wrong}/{total_runs} (healthy runs: {healthy_wrong}/{healthy_runs})")
    return 0


def statistics_counter(values) -> dict:
    from collections import Counter

    return dict(Counter(values))


def jitter_sweep(factors=(1.1, 1.15, 1.2, 1.3, 1.5), jitters=(0.1, 0.2, 0.3, 0.4), seeds: int = 5) -> None:
    """Synthetic detection-limit curve: hit rate of a slowed rank per (per-task jitter, factor)."""
    print("\n| jitter | " + " | ".join(f"{f}x" for f in factors) + " | healthy runs with a name |")
    print("| --- |" + " --- |" * (len(factors) + 1))
    for jitter in jitters:
        cells = []
        for factor in factors:
            hits = 0
            for seed in range(seeds):
                with tempfile.TemporaryDirectory() as directory:
                    generate_case(FaultCase(tp=2, pp=2, dp=2, slow={5: factor}, iterations=8, jitter=jitter, seed=seed),
                                  directory)
                    named = [s.ranks[0] for s in run_detection(directory, jobs=1, what_if=False).suspects]
                hits += named[:1] == [5]
            cells.append(f"{hits}/{seeds}")
        alarms = 0
        for seed in range(seeds):
            with tempfile.TemporaryDirectory() as directory:
                generate_case(FaultCase(tp=2, pp=2, dp=2, iterations=8, jitter=jitter, seed=100 + seed), directory)
                alarms += bool(run_detection(directory, jobs=1, what_if=False).suspects)
        print(f"| {jitter:.0%} | " + " | ".join(cells) + f" | {alarms}/{seeds} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true", help="also run the real 4- and 8-rank CPU scenarios (minutes)")
    parser.add_argument("--real-only", action="store_true", help="only the real 4- and 8-rank runs, no synthetic traces")
    parser.add_argument("--external", action="store_true",
                        help="the real scenarios with faults from outside (cgroup throttles) and the in-process "
                             "injector, repeated, with healthy baselines (an hour and more on 2 cores)")
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="runs per --external scenario")
    parser.add_argument("--iterations", type=int, default=16, help="training iterations per --external run (all traced)")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="--external: only scenarios whose name contains TEXT (and the healthy ones)")
    parser.add_argument("--online", action="store_true",
                        help="--online-detect against a throttle applied mid-run: time to detect (--repeat runs each)")
    parser.add_argument("--online-window", default="1:1", metavar="INTERVAL:CONTINUOUS",
                        help="--online: trace windows of CONTINUOUS iterations out of every INTERVAL (default 1:1, every "
                             "iteration its own window; --trace's defaults are 5:2)")
    parser.add_argument("--online-fractions", default="0.15,0.3", metavar="F[,F...]",
                        help="--online: the throttles applied mid-run, in cores (default 0.15,0.3: a rank of these "
                             "layouts uses about 0.35 core, so 0.3 binds lightly and 0.15 heavily)")
    parser.add_argument("--replay-online", action="store_true",
                        help="replay the --external runs kept under --keep window by window through the online "
                             "analysis: wrong online alerts over every window, windows to name a fault (minutes)")
    parser.add_argument("--confirm", type=int, default=2, metavar="N",
                        help="--replay-online: report a suspect one analyzer names once N analyses in a row name it, "
                             "as --online-detect-confirm N does live (default 2; 1 reports every finding at once)")
    parser.add_argument("--jitter-sweep", action="store_true", help="synthetic detection-limit curve over jitter 10-40%%")
    parser.add_argument("--max-ranks", type=int, default=1024, help="skip scenarios with more ranks than this")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep the real runs' traces under DIR; --external traces already there are re-scored, "
                             "not re-run; --online runs kept there are also replayed after each run")
    from detection_loops import add_arguments as add_loop_arguments, run_from_arguments as run_loops

    add_loop_arguments(parser)
    args = parser.parse_args()
    if args.loops:
        return run_loops(args, parser)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.confirm < 1:
        parser.error("--confirm must be >= 1 (1 reports every finding at once)")
    if args.online:
        try:
            interval, continuous = (int(x) for x in args.online_window.split(":"))
        except ValueError:
            parser.error(f"--online-window takes INTERVAL:CONTINUOUS (e.g. 5:2), got {args.online_window!r}")
        if not 1 <= continuous <= interval:
            parser.error(f"--online-window needs 1 <= CONTINUOUS <= INTERVAL, got {args.online_window}")
        try:
            fractions = tuple(float(x) for x in args.online_fractions.split(","))
        except ValueError:
            parser.error(f"--online-fractions takes comma-separated core fractions (e.g. 0.15,0.3), "
                         f"got {args.online_fractions!r}")
        if not all(0 < f < 2 for f in fractions):
            parser.error(f"--online-fractions: each fraction of a core must be in (0, 2), got {args.online_fractions}")
        run_online(args.repeat, args.iterations, (interval, continuous), fractions, args.keep)
        if not args.external:
            return 0
    if args.replay_online:
        if not args.keep:
            parser.error("--replay-online replays kept runs: pass --keep DIR (a directory an --external --keep run wrote)")
        return replay_online(args.keep, args.iterations, args.only, args.max_ranks, args.confirm)
    if args.external:
        code = run_external(args.repeat, args.iterations, args.keep, args.only, args.max_ranks)
        if args.jitter_sweep:
            jitter_sweep()
        return code
    if args.jitter_sweep:
        jitter_sweep()
        return 0
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
