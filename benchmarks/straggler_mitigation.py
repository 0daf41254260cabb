"""Straggler mitigation under a rank throttled from outside the job, in one benchmark run.

For each layout (4 CPU ranks over gloo, or 2 for dp2), the same training job runs
  healthy               no fault, no mitigation
  healthy + mitigation  no fault, --straggler-mitigation (its overhead)
  throttled             one rank limited to a fraction of a core by `python -m megatron.scan fault
                        throttle` (a cgroup CPU quota: nothing in the job knows)
  throttled + mitigation
and the table gives the median iteration time of each (iterations after --skip), the ratios to
healthy, and the mitigation's own what-if prediction (its summary line: predicted compute of the
rebalanced plan over the even split's, applied to the throttled time) beside what it achieved.
With --repeat N every configuration runs N times, interleaved, and each cell is the median.

    python benchmarks/straggler_mitigation.py [--repeat 3] [--layouts dp4,pp2-dp2] [--cpu-fraction 0.25]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {
    # name: (ranks, layout flags, the rank to throttle)
    "dp4": (4, [], 3),
    "pp2-dp2": (4, ["--pipeline-model-parallel-size", "2"], 3),
    "tp2-dp2": (4, ["--tensor-model-parallel-size", "2"], 3),
    # one rank per core: no oversubscription, so healthy ranks run at the same speed
    "dp2": (2, [], 1),
}
CONFIGS = ("healthy", "healthy + mitigation", "throttled", "throttled + mitigation")
ITER_MS = re.compile(r" iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")
WHAT_IF = re.compile(r"what-if: ([0-9.]+) s even split -> ([0-9.]+) s rebalanced")
CHANGE = re.compile(r"\[mitigation\] iteration (\d+): DP shares( back to even)? ([0-9,]+) microbatches; (.*?) \(")
QUOTA = re.compile(r"quota stopped it in (\d+) of (\d+) periods")
OWN_COST = re.compile(r"own cost ([0-9.]+) ms per iteration \(([0-9.]+)% of iteration time\)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_args(args) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch_size),
            "--train-iters", str(args.iters), "--lr", "1e-3", "--mock-data", "--vocab-size", "1024",
            "--log-interval", "1", "--device", "cpu"]


def run_once(layout: str, config: str, args) -> dict:
    nproc, flags, slow_rank = LAYOUTS[layout]
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "pretrain_gpt.py", *model_args(args), *flags]
    if "mitigation" in config:
        command.append("--straggler-mitigation")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MEGATRON_PROGRESS="0")
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fault = None
    if config.startswith("throttled"):
        fault = subprocess.Popen([sys.executable, "-m", "megatron.scan", "fault", "throttle", "--rank", str(slow_rank),
                                  "--cpu-fraction", str(args.cpu_fraction), "--job", f":{port}", "--wait", "120"],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = job.communicate(timeout=1800)
        fault_out = fault.communicate(timeout=120)[0] if fault is not None else ""
    finally:
        for proc in (job, fault):
            if proc is not None and proc.poll() is None:
                proc.kill()
    if job.returncode != 0:
        raise SystemExit(f"{layout} {config}: the job failed:\n{out[-3000:]}")
    if fault is not None and "throttled rank" not in fault_out:
        raise SystemExit(f"{layout} {config}: the throttle was not applied:\n{fault_out[-2000:]}")
    times = [float(ms) for it, ms in ITER_MS.findall(out) if int(it) > args.skip]
    what_if = WHAT_IF.search(out)
    quota = QUOTA.search(fault_out)
    own = OWN_COST.search(out)
    return {"median_ms": statistics.median(times), "mean_ms": statistics.mean(times),
            "what_if": (float(what_if.group(1)), float(what_if.group(2))) if what_if else None,
            "changes": [(int(m.group(1)), m.group(3), m.group(4)) for m in CHANGE.finditer(out)],
            "throttled_periods": (int(quota.group(1)), int(quota.group(2))) if quota else None,
            "own_cost_percent": float(own.group(2)) if own else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="dp4,pp2-dp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every configuration (cells: median)")
    parser.add_argument("--cpu-fraction", type=float, default=0.25,
                        help="CPU quota of the throttled rank, in cores (default 0.25: about half of its "
                             "share when 4 ranks share 2 cores; dp2 ranks have a core each, so there it is a "
                             "quarter)")
    parser.add_argument("--iters", type=int, default=40, help="training iterations per run (default %(default)s)")
    parser.add_argument("--skip", type=int, default=15,
                        help="iterations left out of the timing: start-up and the mitigation's first decision "
                             "(default %(default)s)")
    parser.add_argument("--num-layers", type=int, default=4, help="transformer layers (default %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=128, help="hidden size (default %(default)s)")
    parser.add_argument("--seq-length", type=int, default=128, help="sequence length (default %(default)s)")
    parser.add_argument("--global-batch-size", type=int, default=64,
                        help="samples per iteration, micro batch 1 (default %(default)s: 16 or 32 microbatches "
                             "per replica)")
    parser.add_argument("--json", metavar="FILE", help="also write every run's numbers to FILE")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.skip >= args.iters:
        parser.error(f"--skip {args.skip} leaves no iteration of --iters {args.iters} to time")
    print(f"{args.num_layers}-layer GPT, hidden {args.hidden_size}, seq {args.seq_length}, global batch "
          f"{args.global_batch_size} (micro 1), CPU ranks over gloo on {os.cpu_count()} cores; throttle: "
          f"{args.cpu_fraction} core by cgroup quota; iterations {args.skip + 1}..{args.iters}; "
          f"{args.repeat} run(s) each", flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    started = time.monotonic()
    total = len(layouts) * len(CONFIGS) * args.repeat
    done = 0
    for repeat in range(args.repeat):
        for layout in layouts:
            for config in CONFIGS:
                done += 1
                print(f"  [{done}/{total}] {layout}: {config} (run {repeat + 1}) ... ", end="", flush=True)
                result = run_once(layout, config, args)
                results.setdefault((layout, config), []).append(result)
                print(f"{result['median_ms']:.0f} ms/it ({time.monotonic() - started:.0f} s)", flush=True)
    print()
    print("| layout | configuration | ms/iteration | vs healthy | what-if predicted / own cost | runs (ms) |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for layout in layouts:
        healthy = statistics.median(r["median_ms"] for r in results[(layout, "healthy")])
        throttled = statistics.median(r["median_ms"] for r in results[(layout, "throttled")])
        for config in CONFIGS:
            runs = results[(layout, config)]
            ms = statistics.median(r["median_ms"] for r in runs)
            predicted = ""
            if config == "throttled + mitigation":
                ratios = [r["what_if"][1] / r["what_if"][0] for r in runs if r["what_if"]]
                if ratios:
                    value = throttled * statistics.median(ratios)
                    predicted = f"{value:.0f} ms ({value / healthy:.2f}x)"
            if config == "healthy + mitigation":
                own = [r["own_cost_percent"] for r in runs if r["own_cost_percent"] is not None]
                if own:
                    predicted = f"own cost {statistics.median(own):.2f}% of iteration time"
            print(f"| {layout} | {config} | {ms:.0f} | {ms / healthy:.3f}x | {predicted} | "
                  f"{', '.join(format(r['median_ms'], '.0f') for r in runs)} |")
            summary[f"{layout} / {config}"] = {"ms": ms, "vs_healthy": ms / healthy, "runs": runs}
    print()
    for layout in layouts:
        for run in results[(layout, "throttled + mitigation")]:
            first = run["changes"][0] if run["changes"] else None
            print(f"{layout}: throttled + mitigation: {len(run['changes'])} plan change(s)"
                  + (f", first from iteration {first[0]}: shares {first[1]} ({first[2]})" if first else ""))
        for run in results[(layout, "healthy + mitigation")]:
            print(f"{layout}: healthy + mitigation: {len(run['changes'])} plan change(s)"
                  + "".join(f"; iteration {c[0]}: {c[1]} ({c[2]})" for c in run["changes"][:3]))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=list) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
