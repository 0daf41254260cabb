"""Detection accuracy against job size: synthetic TP x PP x DP jobs (megatron.scan.synthetic_job,
calibrated on real traces) of 64 to 16,384 ranks, healthy and faulty, each with its truth, judged
three ways: offline (every rank's tables, as `scripts/aggregate.py -b DIR -d` has them), per node
(each node's summary, combined on rank 0: megatron.scan.detect.summary) and online (an analysis
of everything traced so far at the end of each --online-window iterations, a suspect reported
once confirmed, as online detection does; its time is one analysis, the last and largest).

    python benchmarks/detection_scale.py                       # 64 .. 4,096 ranks, 100 jobs each
    python benchmarks/detection_scale.py --sizes 16384 --jobs 20
    python benchmarks/detection_scale.py --sizes 256,1024 --check-summaries   # per node == offline
    python benchmarks/detection_scale.py --sizes 4096 --jobs 150 --scenarios healthy,healthy,slow_rank_1.1 \
        --paths offline,online        # 100 healthy jobs: the false-alarm goal

Per size it prints: healthy jobs naming anyone, the share of faulty jobs whose fault was named
(recall) per fault kind, precision of the names in faulty jobs, a slow node named as the node,
time to a verdict (median / p95 of the analysis; the per-node path counts rank 0's combine and
analysis, the nodes' summaries running in parallel on the job: their time is the slowest node's),
summary bytes per node and peak memory of the worker. Goals at 4,096 ranks: no name in >= 99 of
100 healthy jobs, one rank 1.1x slower named in >= 95%, a slow node named as the node, offline
verdict <= 60 s, one online analysis <= 10 s."""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.scan.detect import detect  # noqa: E402
from megatron.scan.detect.host import host_starvation  # noqa: E402
from megatron.scan.detect.online import MIN_ITERATIONS, RECENT_ITERATIONS, Confirmation  # noqa: E402
from megatron.scan.detect.summary import split_by_node, summarize_in_process  # noqa: E402
from megatron.scan.load import retain_freed_memory  # noqa: E402
from megatron.scan.synthetic_job import Fault, JobSpec, synthesize  # noqa: E402

LAYOUTS = {64: (2, 4, 8), 256: (4, 4, 16), 1024: (8, 8, 16), 4096: (8, 8, 64), 16384: (8, 8, 256)}
RANKS_PER_NODE = 8
# The faulty jobs, in turn (a job's number picks one); half the jobs are healthy.
SCENARIOS = ("slow_rank_1.1", "slow_rank_random", "slow_rank_mid_run", "slow_rank_bursty", "two_three_slow",
             "slow_node", "slow_link", "hang")


def job(size: int, index: int, seed: int, iterations: int, scenarios: tuple[str, ...] | None = None,
        traced: int | None = None) -> tuple[JobSpec, str]:
    """The index-th job of a size: even indices healthy, odd ones a fault scenario in turn; with
    `scenarios`, the index-th of them in turn ("healthy" or one of SCENARIOS). Faults are timed
    by `iterations`; the job runs `traced` iterations (default: as many)."""
    tp, pp, dp = LAYOUTS[size]
    rng = np.random.default_rng([seed, size, index])
    world = tp * pp * dp
    base = JobSpec(tp=tp, pp=pp, dp=dp, ranks_per_node=RANKS_PER_NODE, iterations=max(iterations, traced or 0),
                   seed=int(rng.integers(2**31)))
    if scenarios:
        scenario = scenarios[index % len(scenarios)]
    elif index % 2 == 0:
        scenario = "healthy"
    else:
        scenario = SCENARIOS[(index // 2) % len(SCENARIOS)]
    if scenario == "healthy":
        return base, "healthy"
    rank = int(rng.integers(world))
    if scenario == "slow_rank_1.1":
        faults = (Fault("slow_rank", ranks=(rank,), factor=1.1),)
    elif scenario == "slow_rank_random":
        faults = (Fault("slow_rank", ranks=(rank,), factor=float(rng.uniform(1.05, 2.0))),)
    elif scenario == "slow_rank_mid_run":
        faults = (Fault("slow_rank", ranks=(rank,), factor=1.3, start_iteration=iterations // 2),)
    elif scenario == "slow_rank_bursty":
        faults = (Fault("slow_rank", ranks=(rank,), factor=1.5, bursty=0.5),)
    elif scenario == "two_three_slow":
        ranks = tuple(int(r) for r in rng.choice(world, size=int(rng.integers(2, 4)), replace=False))
        faults = (Fault("slow_rank", ranks=ranks, factor=float(rng.uniform(1.2, 1.5))),)
    elif scenario == "slow_node":
        faults = (Fault("slow_node", node=int(rng.integers(world // RANKS_PER_NODE)), factor=1.2),)
    elif scenario == "slow_link":
        # a pipeline link: a rank of a stage that sends to the next one
        src_pp = int(rng.integers(pp - 1))
        d, t = int(rng.integers(dp)), int(rng.integers(tp))
        faults = (Fault("slow_link", ranks=(base.rank(d, src_pp, t), base.rank(d, src_pp + 1, t)), factor=30.0),)
    else:
        faults = (Fault("hang", ranks=(rank,), start_iteration=iterations - 3),)
    return replace(base, faults=faults), scenario


def judge(detection, truth, scenario: str) -> dict:
    """What the names were worth against the truth."""
    names, right = [], 0
    for s in detection.suspects:
        if s.kind == "rank":
            ok = s.ranks[0] in truth.slow_ranks or s.ranks[0] == truth.hung_rank
        elif s.kind == "node":
            ok = any(r // RANKS_PER_NODE in truth.slow_nodes for r in s.ranks) or bool(set(s.ranks) & truth.slow_ranks)
        else:
            ok = tuple(s.ranks) in truth.slow_links
        names.append([s.kind, s.ranks[:2] if s.kind != "node" else [s.ranks[0] // RANKS_PER_NODE], ok])
        right += ok
    if scenario == "healthy":
        found = None
    elif scenario == "slow_node":
        found = any(s.kind == "node" and any(r // RANKS_PER_NODE in truth.slow_nodes for r in s.ranks)
                    for s in detection.suspects)
    elif scenario == "slow_link":
        found = any(s.kind == "link" and tuple(s.ranks) in truth.slow_links for s in detection.suspects)
    elif scenario == "hang":
        found = any(truth.hung_rank in s.ranks for s in detection.suspects)
    else:
        named = {s.ranks[0] for s in detection.suspects if s.kind == "rank"}
        named |= {r for s in detection.suspects if s.kind == "node" for r in s.ranks}
        found = truth.slow_ranks <= named
    return {"names": names, "wrong": len(names) - right, "found": found, "verdict": detection.verdict}


def until(data, end: int):
    """The rows of the iterations before `end` (what online detection has seen by then)."""
    def keep(table):
        return {c: v[table["iteration"] < end] for c, v in table.items()}
    return replace(data, compute=keep(data.compute), collectives=keep(data.collectives), p2p=keep(data.p2p),
                   iteration_time=keep(data.iteration_time), layers=keep(data.layers), host=keep(data.host))


def run_job(arguments: tuple) -> dict:
    size, index, seed, iterations, online_window, check, paths, scenarios, online_iterations = arguments
    retain_freed_memory()  # as the analysis processes (detect, aggregate, online) do
    spec, scenario = job(size, index, seed, iterations, scenarios, traced=online_iterations)
    started = time.perf_counter()
    whole, truth = synthesize(spec)
    data = until(whole, iterations) if online_iterations > iterations else whole
    synthesized = time.perf_counter() - started
    result = {"size": size, "index": index, "scenario": scenario, "synthesize_s": synthesized}
    result["summary_bytes"] = 0
    if "offline" in paths or check:
        started = time.perf_counter()
        offline = detect(data)
        result["offline_s"] = time.perf_counter() - started
        result["offline"] = judge(offline, truth, scenario)
    if "per_node" in paths or check:
        _per_node(data, truth, scenario, result, offline if check else None)
    if "online" in paths:
        _online(whole, truth, scenario, online_iterations, online_window, result)
    result["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def _per_node(data, truth, scenario: str, result: dict, offline) -> None:
    # Per node: the three rounds (each round's slowest node is the job's time for it), rank 0's
    # work between and after them, then rank 0's analysis.
    combined, cost = summarize_in_process(split_by_node(data, RANKS_PER_NODE))
    started = time.perf_counter()
    per_node = detect(combined)
    result["per_node_s"] = time.perf_counter() - started + cost["nodes_s"] + cost["rank0_s"]
    result["node_summary_s"] = cost["nodes_s"]
    result["rank0_s"] = time.perf_counter() - started + cost["rank0_s"]
    result["summary_bytes"] = cost["bytes"]
    result["rank0_rows"] = _rows(combined)
    result["job_rows"] = _rows(data)
    result["per_node"] = judge(per_node, truth, scenario)
    if offline is not None:
        result["same_names"] = ([(s.kind, s.ranks) for s in offline.suspects]
                                == [(s.kind, s.ranks) for s in per_node.suspects])


def _rows(data) -> int:
    """Table rows an input holds (what the analyzers read)."""
    return sum(len(getattr(data, name)["rank" if name != "p2p" else "dst"])
               for name in ("compute", "layers", "p2p", "collectives", "iteration_time", "host"))


def _online(data, truth, scenario: str, iterations: int, online_window: int, result: dict) -> None:
    # Online: an analysis of everything traced so far at the end of each window, from
    # MIN_ITERATIONS on, with its confirmation across analyses (as OnlineDetector runs them).
    confirm, reported, slowest, named_by = Confirmation(), {}, 0.0, {}
    for end in range(online_window, iterations + 1, online_window):
        if end < MIN_ITERATIONS:
            continue
        started = time.perf_counter()
        analysis = detect(until(data, end), host=functools.partial(host_starvation, recent=RECENT_ITERATIONS))
        slowest = max(slowest, time.perf_counter() - started)
        alerts = [{"kind": s.kind, "ranks": s.ranks, "named_by": s.named_by, "suspect": s} for s in analysis.suspects]
        for alert in confirm(alerts)[0]:
            reported.setdefault((alert["kind"], tuple(alert["ranks"])), alert["suspect"])
        named_by[end] = judge(SimpleNamespace(suspects=list(reported.values()), verdict=""), truth, scenario)
    result["online_s"] = slowest
    # What had been reported by the end of each window: when the fault was named, when a healthy job first named anyone.
    result["online_by"] = {end: (j["found"], bool(j["names"])) for end, j in named_by.items()}
    result["online"] = judge(SimpleNamespace(suspects=list(reported.values()), verdict=""), truth, scenario)


def table(results: list[dict], sizes: list[int]) -> str:
    lines = ["| ranks | jobs | path | healthy jobs naming anyone | 1.1x rank named | any fault named | slow node as node "
             "| precision in faulty jobs | verdict s (median / p95) | summary KB per node | peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        mine = [r for r in results if r["size"] == size]
        if not mine:
            continue
        for path in ("offline", "per_node", "online"):
            if path not in mine[0]:
                continue
            healthy = [r for r in mine if r["scenario"] == "healthy"]
            faulty = [r for r in mine if r["scenario"] != "healthy"]
            slow11 = [r for r in faulty if r["scenario"] == "slow_rank_1.1"]
            nodes = [r for r in faulty if r["scenario"] == "slow_node"]
            named = sum(1 for r in healthy if r[path]["names"])
            names = sum(len(r[path]["names"]) for r in faulty)
            wrong = sum(r[path]["wrong"] for r in faulty)
            seconds = sorted(r[f"{path}_s"] for r in mine)
            p95 = seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))]
            lines.append(
                f"| {size} | {len(mine)} | {path} | {named}/{len(healthy)} | "
                f"{sum(r[path]['found'] for r in slow11)}/{len(slow11)} | "
                f"{sum(r[path]['found'] for r in faulty)}/{len(faulty)} | "
                f"{sum(r[path]['found'] for r in nodes)}/{len(nodes)} | "
                f"{(names - wrong) / names:.3f} ({names - wrong}/{names}) | " if names else
                f"| {size} | {len(mine)} | {path} | {named}/{len(healthy)} | "
                f"{sum(r[path]['found'] for r in slow11)}/{len(slow11)} | "
                f"{sum(r[path]['found'] for r in faulty)}/{len(faulty)} | "
                f"{sum(r[path]['found'] for r in nodes)}/{len(nodes)} | - | ")
            lines[-1] += (f"{statistics.median(seconds):.2f} / {p95:.2f} | "
                          f"{statistics.median(r['summary_bytes'] for r in mine) / 1024:.0f} | "
                          f"{max(r['rss_mb'] for r in mine):.0f} |")
    return "\n".join(lines)


def per_scenario(results: list[dict], sizes: list[int]) -> str:
    lines = ["| ranks | scenario | offline named | per node named | online named |", "|---|---|---|---|---|"]
    for size in sizes:
        for scenario in SCENARIOS:
            mine = [r for r in results if r["size"] == size and r["scenario"] == scenario]
            if mine:
                lines.append(f"| {size} | {scenario} | " + " | ".join(
                    f"{sum(r[p]['found'] for r in mine)}/{len(mine)}" if p in mine[0] else "-"
                    for p in ("offline", "per_node", "online")) + " |")
    return "\n".join(lines)


def per_node_cost(results: list[dict], sizes: list[int]) -> str:
    """What the per-node path costs rank 0 against the job's size (medians over jobs)."""
    lines = ["| ranks | nodes | rank 0 s (plan, combine, analysis) | slowest node s (3 rounds) | KB one node sends "
             "(most) | rows rank 0 reads | rows of the whole job |", "|---|---|---|---|---|---|---|"]
    for size in sizes:
        mine = [r for r in results if r["size"] == size and "rank0_s" in r]
        if mine:
            lines.append(f"| {size} | {size // RANKS_PER_NODE} | {statistics.median(r['rank0_s'] for r in mine):.2f} | "
                         f"{statistics.median(r['node_summary_s'] for r in mine):.3f} | "
                         f"{max(r['summary_bytes'] for r in mine) / 1024:.0f} | "
                         f"{statistics.median(r['rank0_rows'] for r in mine):,.0f} | "
                         f"{statistics.median(r['job_rows'] for r in mine):,.0f} |")
    return "\n".join(lines)


def online_by(results: list[dict], sizes: list[int]) -> str:
    """Online: by the end of each window, the faulty jobs whose fault had been reported and the
    healthy jobs that had named anyone."""
    ends = sorted({int(e) for r in results for e in r.get("online_by", {})})
    lines = ["| ranks | scenario | " + " | ".join(f"by iteration {e}" for e in ends) + " |",
             "|---|---|" + "---|" * len(ends)]
    for size in sizes:
        for scenario in ("healthy", *SCENARIOS):
            mine = [r for r in results if r["size"] == size and r["scenario"] == scenario]
            if mine:
                column = 1 if scenario == "healthy" else 0  # healthy: named anyone; faulty: the fault found
                lines.append(f"| {size} | {scenario}{' (named anyone)' if column else ''} | " + " | ".join(
                    f"{sum(bool(r['online_by'][e][column]) for r in mine if e in r['online_by'])}/{len(mine)}"
                    for e in ends) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024,4096",
                        help="job sizes in ranks, comma-separated, of 64, 256, 1024, 4096, 16384 (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=100, help="synthetic jobs per size, half healthy (default %(default)s)")
    parser.add_argument("--iterations", type=int, default=20, help="traced iterations per job (default %(default)s)")
    parser.add_argument("--online-iterations", type=int, default=None,
                        help="iterations the online path watches (default: --iterations); the job runs this long, "
                             "its faults timed as for --iterations, and the offline and per-node paths analyze its "
                             "first --iterations")
    parser.add_argument("--online-window", type=int, default=5,
                        help="iterations per trace window: online detection analyzes everything traced so far at "
                             "the end of each (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the job set (default %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="processes running jobs (default %(default)s)")
    parser.add_argument("--check-summaries", action="store_true",
                        help="also report whether the per-node path named exactly what the offline one did")
    parser.add_argument("--paths", default="offline,per_node,online",
                        help="which analyses to run, comma-separated, of offline, per_node, online (default "
                             "%(default)s)")
    parser.add_argument("--scenarios", default=None,
                        help="comma-separated jobs in turn, each 'healthy' or one of " + ", ".join(SCENARIOS)
                             + " (default: every other job healthy, the others each fault in turn); e.g. "
                               "healthy,healthy,slow_rank_1.1 for the false-alarm goal")
    parser.add_argument("--json", default=None, metavar="FILE", help="write every job's result here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    paths = tuple(args.paths.split(","))
    if not paths or set(paths) - {"offline", "per_node", "online"}:
        parser.error(f"--paths: choose from offline, per_node, online (got {args.paths!r})")
    scenarios = tuple(args.scenarios.split(",")) if args.scenarios else None
    if scenarios and set(scenarios) - {"healthy", *SCENARIOS}:
        parser.error(f"--scenarios: unknown {sorted(set(scenarios) - {'healthy', *SCENARIOS})}; choose from "
                     f"healthy, {', '.join(SCENARIOS)}")
    unknown = [s for s in sizes if s not in LAYOUTS]
    if unknown:
        parser.error(f"--sizes: no layout for {unknown}; choose from {sorted(LAYOUTS)}")
    results: list[dict] = []
    started = time.perf_counter()
    for size in sizes:
        online_iterations = max(args.online_iterations or args.iterations, args.iterations)
        work = [(size, i, args.seed, args.iterations, args.online_window, args.check_summaries, paths, scenarios,
                 online_iterations) for i in range(args.jobs)]
        # A fresh pool per size, so that a worker's peak memory is that size's.
        with multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=None) as pool:
            for done, result in enumerate(pool.imap_unordered(run_job, work), 1):
                results.append(result)
                if done % max(1, args.jobs // 10) == 0 or done == args.jobs:
                    print(f"[detection_scale] {size} ranks: {done}/{args.jobs} jobs "
                          f"({time.perf_counter() - started:.0f} s)", flush=True)
    print(table(results, sizes))
    print()
    print(per_scenario(results, sizes))
    if "per_node" in paths:
        print()
        print(per_node_cost(results, sizes))
    if "online" in paths:
        print()
        print(online_by(results, sizes))
    if args.check_summaries:
        for size in sizes:
            mine = [r for r in results if r["size"] == size]
            print(f"per-node summaries named exactly what the offline analysis named: "
                  f"{sum(r['same_names'] for r in mine)}/{len(mine)} jobs at {size} ranks")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
