"""MegaDPP benchmark: iteration time of the DPP policies vs static 1F1B on 4 CPU ranks (PP=4 and
PP=2 x DP=2), without perturbation, with a delayed link (--inject-link-delay) and with one slow
stage (--inject-slowdown). Every number comes from real training runs made in this one invocation.

    python benchmarks/dpp.py                       # everything (about 10 minutes on 2 cores)
    python benchmarks/dpp.py --layouts pp4 --iters 6

With --baseline-tree DIR it instead compares two checkouts of this repository on one MegaDPP job
(adaptive policy, --dpp-transport shm, no perturbation): DIR (e.g. a git worktree of an older
commit, with its shm_tensor_rdma extension built) and this tree, alternating, --repeat times each:

    git worktree add /tmp/base <commit> && (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/dpp.py --baseline-tree /tmp/base --layouts tp2xpp2 --repeat 3
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "512", "--device", "cpu", "--log-interval", "1"]
LAYOUTS = {  # name -> (flags, global batch, a link between two stages, a rank of a middle stage)
    "pp4": (["--pipeline-model-parallel-size", "4"], 16, "1:2", 2),
    "pp2xdp2": (["--pipeline-model-parallel-size", "2"], 32, "0:2", 2),
    "tp2xpp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 16, "0:2", 2),
}
SCHEDULES = {"1f1b": [], "adaptive": ["--use-dpp", "--dpp-policy", "adaptive"],
             "dfc": ["--use-dpp", "--dpp-policy", "dfc"], "bfc": ["--use-dpp", "--dpp-policy", "bfc"],
             # Static 1F1B moves tensors over gloo; this column separates the transport's share.
             "adaptive/torch": ["--use-dpp", "--dpp-policy", "adaptive", "--dpp-transport", "torch"]}
ITERATION_TIME = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(layout: str, scenario: list[str], schedule: str, iters: int, root: Path = ROOT,
        extra: list[str] | None = None) -> float:
    """Median iteration time (ms) after the first two iterations, running the checkout at `root`;
    `extra` flags go after the model's (a later flag wins)."""
    flags, global_batch, _, _ = LAYOUTS[layout]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(_port()), "pretrain_gpt.py", *MODEL, *(extra or []), *flags, "--global-batch-size",
               str(global_batch), "--train-iters", str(iters), *scenario, *SCHEDULES[schedule]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    times = [float(t) for t in ITERATION_TIME.findall(proc.stdout)]
    if proc.returncode != 0 or len(times) < iters:
        raise RuntimeError(f"{layout} {schedule} {scenario} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return statistics.median(times[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="parallel layouts to run (default: all)")
    parser.add_argument("--iters", type=int, default=8,
                        help="training iterations per run; the first two are left out (default %(default)s)")
    parser.add_argument("--link-delay-ms", type=float, default=20.0,
                        help="delay of the perturbed pipeline link, in ms (default %(default)s)")
    parser.add_argument("--slowdown", type=float, default=1.5,
                        help="compute slowdown factor of the slow middle-stage rank (default %(default)s)")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="compare another checkout (with its extension built) against this tree instead")
    parser.add_argument("--model-args", default="",
                        help="with --baseline-tree: flags that override the model's, e.g. \"--hidden-size 64 "
                             "--seq-length 1024\" (more bytes moved per unit of compute)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="with --baseline-tree: runs of each tree, alternating (default %(default)s)")
    args = parser.parse_args()
    if args.baseline_tree is not None:
        return compare_trees(args)
    print(f"4 CPU ranks, {os.cpu_count()} cores; median iteration ms of iterations 3..{args.iters}; "
          f"ratio = schedule / static 1F1B in the same scenario")
    header = f"{'layout':<9} {'scenario':<22} " + " ".join(f"{name:>16}" for name in SCHEDULES)
    print(header)
    for layout in args.layouts:
        _, _, link, middle = LAYOUTS[layout]
        scenarios = {
            "none": [],
            f"link {link} +{args.link_delay_ms:g}ms": ["--inject-link-delay", f"{link}:{args.link_delay_ms:g}"],
            f"rank {middle} x{args.slowdown:g}": ["--inject-slowdown", f"{middle}:{args.slowdown:g}"],
        }
        for scenario_name, scenario in scenarios.items():
            times = {schedule: run(layout, scenario, schedule, args.iters) for schedule in SCHEDULES}
            base = times["1f1b"]
            cells = " ".join(f"{t:>8.1f} ({t / base:.2f}x)" for t in times.values())
            print(f"{layout:<9} {scenario_name:<22} {cells}", flush=True)
    return 0


def compare_trees(args) -> int:
    base = args.baseline_tree.resolve()
    if not (base / "pretrain_gpt.py").is_file():
        sys.exit(f"--baseline-tree {base}: no pretrain_gpt.py there; give a checkout of this repository")
    schedule = "adaptive"
    print(f"MegaDPP ({schedule} policy, --dpp-transport shm) {args.model_args}, 4 CPU ranks, {os.cpu_count()} cores; median "
          f"iteration ms of iterations 3..{args.iters}; {args.repeat} runs per tree, alternating")
    for layout in args.layouts:
        times: dict[str, list[float]] = {"baseline": [], "this tree": []}
        for _ in range(args.repeat):
            extra = shlex.split(args.model_args)
            times["baseline"].append(run(layout, [], schedule, args.iters, base, extra))
            times["this tree"].append(run(layout, [], schedule, args.iters, ROOT, extra))
        before, after = (statistics.median(v) for v in times.values())
        for name, values in times.items():
            print(f"{layout:<9} {name:<10} runs {' '.join(f'{t:.1f}' for t in values)}  "
                  f"median {statistics.median(values):.1f}", flush=True)
        print(f"{layout:<9} this tree / baseline = {after / before:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
