"""Slow-rank detection on training loops this project did not write (tests/scan/loops/: Hugging
Face Trainer, Lightning, ignite, a plain DDP script), each run as its users run it under the
zero-code launcher at its default settings (`python -m megatron.scan launch --trace-dir D --
torchrun --nproc-per-node 4 loop.py`: every one of the first 20 optimizer steps traced, then 2 in
every 5), healthy and
with one rank throttled from outside by a cgroup CPU quota (`python -m megatron.scan fault
throttle`, applied as soon as the rank's process exists), and with one rank's device made slower
in-process (`launch --inject-slowdown RANK:FACTOR`: each call of the model's repeated blocks takes
FACTOR x as long, or each call of a module holding parameters in a model without blocks), each --repeat
times, round-robin. Per loop and scenario: the job's slowdown against the loop's healthy runs,
runs in which the faulty rank was named first, runs in which any healthy rank was named, and the
verdicts.

    python benchmarks/detection_accuracy.py --loops hf_trainer,lightning,ignite,torch_ddp --repeat 5
    python benchmarks/detection_loops.py --loops all --repeat 5 [--loop-fraction 0.2] [--keep DIR]"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (ROOT, ROOT / "tests", ROOT / "tests" / "scan", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

LOOPS_DIR = ROOT / "tests" / "scan" / "loops"


@dataclass(frozen=True)
class Loop:
    name: str
    script: str
    requires: str  # the package whose loop it is ("" for torch alone)
    library: str  # what runs the loop, for the report
    # Sizes for 4 ranks on 2 cores: a step of roughly 0.1-0.3 s, so that a CPU quota on one rank
    # shows in every traced step and 40 steps take well under a minute.
    args: tuple[str, ...] = ()
    # The default quota of the throttled rank, in cores: one that slowed the job 1.3x or more here.
    fraction: float = 0.2


LOOPS = {loop.name: loop for loop in [
    Loop("hf_trainer", "hf_trainer.py", "transformers", "transformers.Trainer (DDP through accelerate)",
         ("--width", "128", "--layers", "2", "--batch", "4", "--seq-length", "64"), 0.15),
    Loop("lightning", "lightning_ddp.py", "lightning", "lightning.Trainer, strategy='ddp'",
         ("--width", "256", "--layers", "2", "--batch", "64")),
    Loop("ignite", "ignite_trainer.py", "ignite", "ignite create_supervised_trainer + idist",
         ("--width", "256", "--layers", "2", "--batch", "64")),
    Loop("torch_ddp", "torch_ddp.py", "", "plain DDP, no_sync accumulation (baseline)",
         ("--width", "256", "--layers", "2", "--batch", "64")),
    Loop("fsdp2", "fsdp2.py", "", "FSDP2 fully_shard per block, gloo (baseline)",
         ("--width", "256", "--layers", "2", "--batch", "64")),
]}
SCENARIOS = ("healthy", "throttle", "inject")
# The in-process slowdown of the `inject` scenario (the trainer's benchmark uses the same factor).
INJECT_FACTOR = 1.25


@dataclass(kw_only=True)
class LoopScenario:
    loop: Loop
    kind: str  # "healthy" | "throttle" | "inject"
    rank: int = -1  # the throttled or slowed rank
    fraction: float = 0.0  # its CPU quota, in cores
    factor: float = INJECT_FACTOR  # inject: how much slower its device computes

    @property
    def name(self) -> str:
        if self.kind == "inject":
            return f"{self.loop.name} inject r{self.rank} {self.factor:g}x"
        return f"{self.loop.name} healthy" if self.kind == "healthy" else \
            f"{self.loop.name} throttle r{self.rank} {self.fraction:g} core"

    @property
    def expected(self) -> list[int]:
        return [self.rank] if self.kind in ("throttle", "inject") else []


@dataclass(kw_only=True)
class JobResult:
    returncode: int
    output: str
    fault_output: str = ""
    seconds: float = 0.0
    error: str = ""  # why the fault was not applied, when it was not
    extra: dict = field(default_factory=dict)


def launch_command(loop: Loop, trace_dir: Path, port: int, nproc: int, steps: int,
                   inject: tuple[str, ...] = ()) -> list[str]:
    """The user's command under the launcher, launcher options at their defaults (`inject`: the
    --inject-slowdown values of an in-process fault)."""
    injected = [arg for value in inject for arg in ("--inject-slowdown", value)]
    return [sys.executable, "-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir), *injected, "--",
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(port), str(LOOPS_DIR / loop.script), "--steps", str(steps), *loop.args]


def run_job(scenario: LoopScenario, trace_dir: Path, *, nproc: int, steps: int, timeout: float) -> JobResult:
    """One launched run; a throttle is applied from outside once the rank's process exists and
    released (by SIGINT to the fault tool, which then reports how much the quota bound) at the end."""
    from fault_runs import Throttle
    from launch import env, free_port, kill_tree

    port = free_port()
    started = time.monotonic()
    inject = (f"{scenario.rank}:{scenario.factor:g}",) if scenario.kind == "inject" else ()
    job = subprocess.Popen(launch_command(scenario.loop, trace_dir, port, nproc, steps, inject), cwd=ROOT, env=env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)  # never blocks the job
    reader.start()
    fault, first, error = None, "", ""
    try:
        if scenario.kind == "throttle":
            fault = subprocess.Popen(Throttle(rank=scenario.rank, fraction=scenario.fraction).command(port), cwd=ROOT,
                                     env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            first = fault.stdout.readline()
            if "[fault] throttled" not in first:
                error = f"the fault did not apply: {first.strip()}"
                kill_tree(job.pid)
        try:
            job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(job.pid)
            job.wait()
            error = error or f"the job did not finish in {timeout:g} s"
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()
        fault_text = first
        if fault is not None:
            if fault.poll() is None:
                fault.send_signal(signal.SIGINT)
            try:
                fault_text += fault.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                fault.kill()
                fault_text += fault.communicate()[0]
        reader.join(timeout=10)
    return JobResult(returncode=job.returncode if not error else -1, output="".join(lines), fault_output=fault_text,
                     seconds=time.monotonic() - started, error=error)


def median_step_ms(trace_dir: Path) -> float:
    """Median traced optimizer step (the launcher's `iteration` span), step 0 (warm-up) left out,
    over every rank's file."""
    from megatron.scan.trace_format import read_rank_file

    times = []
    for path in trace_dir.glob("benchmark-data-*.json"):
        trace = read_rank_file(path)
        if "iteration" not in trace.names:
            continue
        c = trace.columns
        rows = (c["name"] == trace.names.index("iteration")) & (c["iteration"] >= 1)
        times += ((c["end_ns"][rows] - c["start_ns"][rows]) / 1e6).tolist()
    return statistics.median(times) if times else float("nan")


def verdict_line(detection) -> str:
    """The detection report's verdict and what it adds about it (power, leading candidate)."""
    from megatron.scan.detect.report import text_report

    keep = ("MegaScan detection", "no suspect", "power:", "leading candidate")
    lines = [line.strip() for line in text_report(detection).splitlines() if line.strip().startswith(keep)]
    return " | ".join(lines) or detection.verdict


def score_run(scenario: LoopScenario, directory: Path) -> dict:
    from megatron.scan.detect import run_detection

    detection = run_detection(directory, jobs=1, what_if=False)
    named = [s.ranks[0] for s in detection.suspects if s.kind == "rank"]
    return {"named": named, "links": [list(s.ranks) for s in detection.suspects if s.kind != "rank"],
            "first": bool(scenario.expected) and named[:1] == scenario.expected,
            "wrong": sorted(set(named) - set(scenario.expected)), "verdict": detection.verdict,
            "verdict_line": verdict_line(detection)}


def make_scenarios(loops: list[str], kinds: list[str], rank: int, fraction: float | None) -> list[LoopScenario]:
    scenarios = []
    for name in loops:
        loop = LOOPS[name]
        for kind in kinds:
            scenarios.append(LoopScenario(loop=loop, kind=kind, rank=rank, fraction=fraction or loop.fraction)
                             if kind != "healthy" else LoopScenario(loop=loop, kind=kind))
    return scenarios


def run_loops(loops: list[str], kinds: list[str], *, repeat: int, steps: int, nproc: int, rank: int,
              fraction: float | None, keep: str | None, timeout: float = 600) -> int:
    """Every scenario `repeat` times, round-robin; one line per run as it goes, then the table."""
    from detection_accuracy import kept_name, quota_acted

    scenarios = make_scenarios(loops, kinds, rank, fraction)
    results: dict[str, list[dict]] = {s.name: [] for s in scenarios}
    total, started = repeat * len(scenarios), time.perf_counter()
    for round_ in range(repeat):
        for scenario in scenarios:
            with tempfile.TemporaryDirectory() as scratch:
                directory = Path(keep) / f"{kept_name(scenario.name)}-{round_}" if keep else Path(scratch)
                saved = directory / "run.json"
                if keep and saved.exists():  # kept by an earlier --keep run: re-scored, not re-run
                    entry = json.loads(saved.read_text())
                else:
                    directory.mkdir(parents=True, exist_ok=True)
                    outcome = run_job(scenario, directory, nproc=nproc, steps=steps, timeout=timeout)
                    entry = {"ok": outcome.returncode == 0, "seconds": outcome.seconds, "error": outcome.error,
                             "median_ms": median_step_ms(directory) if outcome.returncode == 0 else float("nan"),
                             "quota_acted": quota_acted(outcome.fault_output)}
                    if keep:
                        saved.write_text(json.dumps(entry))
                        (directory / "job.log").write_text(outcome.output + "\n--- fault tool ---\n"
                                                           + outcome.fault_output)
                    if not entry["ok"]:
                        print(f"{scenario.name}: {outcome.error or f'exited {outcome.returncode}'}\n"
                              f"{outcome.output[-2000:]}", file=sys.stderr, flush=True)
                if entry["ok"]:
                    entry.update(score_run(scenario, directory))
                results[scenario.name].append(entry)
            done = sum(len(v) for v in results.values())
            print(f"[{done}/{total} {time.perf_counter() - started:.0f}s] {scenario.name}: "
                  f"{entry.get('verdict_line', 'RUN FAILED')}; named {entry.get('named')} "
                  f"({entry['median_ms']:.0f} ms/step, job {entry['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return report(scenarios, results)


def report(scenarios: list[LoopScenario], results: dict[str, list[dict]]) -> int:
    print("| loop | scenario | runs | job slowdown | quota acted | faulty rank named first | a healthy rank named "
          "| verdicts | last verdict line |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for scenario in scenarios:
        runs = [r for r in results[scenario.name] if r["ok"]]
        failed = len(results[scenario.name]) - len(runs)
        healthy = [r["median_ms"] for r in results.get(f"{scenario.loop.name} healthy", []) if r["ok"]]
        mine = [r["median_ms"] for r in runs]
        slowdown = statistics.median(mine) / statistics.median(healthy) if mine and healthy else float("nan")
        acted = [r["quota_acted"].get(str(scenario.rank)) for r in runs if r.get("quota_acted")]
        acted = [a for a in acted if a is not None]
        verdicts = ", ".join(f"{v} {n}" for v, n in sorted(Counter(r["verdict"] for r in runs).items()))
        what = {"healthy": "-", "throttle": f"throttle r{scenario.rank} {scenario.fraction:g} core",
                "inject": f"in-process r{scenario.rank} {scenario.factor:g}x"}[scenario.kind]
        first = f"{sum(1 for r in runs if r['first'])}/{len(runs)}" if scenario.expected else "-"
        print(f"| {scenario.loop.name} | {what} | {len(runs)}{f' ({failed} failed)' if failed else ''} | "
              f"{f'{slowdown:.2f}x' if scenario.kind != 'healthy' and slowdown == slowdown else '-'} | "
              f"{f'{statistics.median(acted):.0%}' if acted else '-'} | {first} | "
              f"{sum(1 for r in runs if r['wrong'])}/{len(runs)} | {verdicts or '-'} | "
              f"{runs[-1]['verdict_line'] if runs else '-'} |", flush=True)
    loops = dict.fromkeys(s.loop for s in scenarios)
    print("\nloops: " + "; ".join(f"{loop.name} = {loop.library}" for loop in loops))
    return 0


def add_arguments(parser: argparse.ArgumentParser, standalone: bool = False) -> None:
    """The loop benchmark's flags (also on detection_accuracy.py, which shares --repeat and --keep)."""
    parser.add_argument("--loops", default=None if not standalone else "all", metavar="NAME[,NAME...]",
                        help=f"run the launched-loop scenarios for these loops ({', '.join(LOOPS)}, or all) under "
                             f"`python -m megatron.scan launch` at default settings, --repeat times each")
    parser.add_argument("--loop-scenarios", default="healthy,throttle,inject", metavar="S[,S...]",
                        help="--loops: which scenarios (healthy, throttle from outside, inject in-process "
                             f"{INJECT_FACTOR:g}x; default all three)")
    parser.add_argument("--loop-steps", type=int, default=40, metavar="N",
                        help="--loops: optimizer steps per run (default 40: 16 traced at the launcher's 2 in 5)")
    parser.add_argument("--loop-nproc", type=int, default=4, metavar="N", help="--loops: ranks (default 4)")
    parser.add_argument("--loop-rank", type=int, default=2, metavar="R",
                        help="--loops: the throttled or slowed rank (default 2)")
    parser.add_argument("--loop-fraction", type=float, default=None, metavar="CORES",
                        help="--loops: the throttled rank's CPU quota in cores (default per loop, 0.15 for "
                             "hf_trainer and 0.2 for the others: 4 ranks on 2 cores use about half a core each, and "
                             "these slowed each loop's job 1.3x or more on a 2-core host)")
    if standalone:
        parser.add_argument("--repeat", type=int, default=5, metavar="N", help="runs per scenario (default 5)")
        parser.add_argument("--keep", default=None, metavar="DIR",
                            help="keep each run's traces and log under DIR; runs already there are re-scored, "
                                 "not re-run")


def run_from_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import importlib.util

    names = list(LOOPS) if args.loops == "all" else [n for n in args.loops.split(",") if n]
    unknown = [n for n in names if n not in LOOPS]
    kinds = [k for k in args.loop_scenarios.split(",") if k]
    if unknown or not names:
        parser.error(f"--loops: unknown {unknown or names}; choose from {', '.join(LOOPS)} or all")
    if not kinds or set(kinds) - set(SCENARIOS):
        parser.error(f"--loop-scenarios takes {', '.join(SCENARIOS)}, got {args.loop_scenarios!r}")
    if args.repeat < 1 or args.loop_steps < 1 or not 0 <= args.loop_rank < args.loop_nproc \
            or not (args.loop_fraction is None or args.loop_fraction > 0):
        parser.error("need --repeat >= 1, --loop-steps >= 1, 0 <= --loop-rank < --loop-nproc and --loop-fraction > 0")
    missing = [n for n in names if LOOPS[n].requires and importlib.util.find_spec(LOOPS[n].requires) is None]
    if missing:
        parser.error(f"not installed: {', '.join(LOOPS[n].requires for n in missing)} (pip install -e .[test])")
    return run_loops(names, kinds, repeat=args.repeat, steps=args.loop_steps, nproc=args.loop_nproc,
                     rank=args.loop_rank, fraction=args.loop_fraction, keep=args.keep)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, standalone=True)
    return run_from_arguments(parser.parse_args(), parser)


if __name__ == "__main__":
    sys.exit(main())
