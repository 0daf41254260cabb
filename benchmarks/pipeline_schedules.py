"""Pipeline schedules on CPU: measured tokens/s of 1F1B, interleaved 1F1B, ZB-H1, ZB-H2 and MegaDPP with
split backwards (dpp+W), beside the dry-run simulator's prediction for the same cell.

Every cell is a real training run (`pretrain_gpt.py` under torchrun, gloo, one process per pipeline
rank, DP=1, m = 2p microbatches). Tokens/s = global batch x seq length / median iteration time of
iterations 3..N. Three scenarios: equal stages; one slow link (--inject-link-delay on a middle link,
both directions); one slow stage (--inject-slowdown of a middle rank).

The simulator is calibrated once per layout, before any measured run, from two traced equal-stage
runs that are not among the measured ones: a 1f1b run (forward and unsplit backward per rank, and
per-layer times to cut a rank's work into the interleaved chunks) and a zb-h1 run (forward, input
gradient I and weight gradient W per rank). Each scenario's costs are derived from that: the slow
link adds the injected delay to the link's latency, the slow stage sets rank_slowdown. The simulator
models the pipeline only: no optimizer step, no gradient / embedding all-reduce, no Python overhead
between tasks; so compare the ratios to 1F1B, not the absolute figures.

    python benchmarks/pipeline_schedules.py --layouts pp2 --repeat 3 --json pp2.json
    python benchmarks/pipeline_schedules.py --layouts pp4 --repeat 2 --iters 6
    python benchmarks/pipeline_schedules.py --dry-run          # print the commands only
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import runpy
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Layout:
    name: str
    pp: int
    num_layers: int
    slow_link: tuple[int, int]  # a middle link (global ranks; DP = TP = 1, so pp rank = global rank)
    slow_rank: int  # a middle stage's rank

    @property
    def microbatches(self) -> int:
        return 2 * self.pp


LAYOUTS = {
    "pp2": Layout("pp2", 2, 4, (0, 1), 1),  # two ranks: the only link; rank 1 (the last stage) is slowed
    "pp4": Layout("pp4", 4, 8, (1, 2), 2),
}
SCENARIOS = ("equal", "slow-link", "slow-stage")
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-h2", "dpp+W")
VIRTUAL_CHUNKS = 2  # interleaved: chunks per rank


@dataclass
class Model:
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    micro_batch: int = 2
    vocab: int = 512

    def flags(self, layout: Layout) -> list[str]:
        return ["--num-layers", str(layout.num_layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
                "--micro-batch-size", str(self.micro_batch), "--mock-data", "--vocab-size", str(self.vocab),
                "--device", "cpu", "--log-interval", "1", "--pipeline-model-parallel-size", str(layout.pp),
                "--global-batch-size", str(self.global_batch(layout))]

    def global_batch(self, layout: Layout) -> int:
        return layout.microbatches * self.micro_batch

    def tokens(self, layout: Layout) -> int:
        return self.global_batch(layout) * self.seq


def schedule_flags(schedule: str, layout: Layout, dpp_transport: str | None) -> list[str]:
    if schedule == "1f1b":
        return ["--pipeline-schedule", "1f1b"]
    if schedule == "interleaved":
        per_chunk = layout.num_layers // (layout.pp * VIRTUAL_CHUNKS)
        return ["--pipeline-schedule", "interleaved", "--num-layers-per-virtual-pipeline-stage", str(per_chunk)]
    if schedule in ("zb-h1", "zb-h2"):
        return ["--pipeline-schedule", schedule]
    if schedule == "dpp+W":
        flags = ["--use-dpp", "--dpp-policy", "adaptive", "--dpp-split-backward"]
        return flags + (["--dpp-transport", dpp_transport] if dpp_transport else [])
    raise ValueError(schedule)


def scenario_flags(scenario: str, layout: Layout, link_delay_ms: float, slowdown: float) -> list[str]:
    if scenario == "equal":
        return []
    if scenario == "slow-link":
        a, b = layout.slow_link
        # The flag delays one direction (receives at DST from SRC); a slow link is slow both ways.
        return ["--inject-link-delay", f"{a}:{b}:{link_delay_ms:g}", "--inject-link-delay", f"{b}:{a}:{link_delay_ms:g}"]
    if scenario == "slow-stage":
        return ["--inject-slowdown", f"{layout.slow_rank}:{slowdown:g}"]
    raise ValueError(scenario)


def scenario_label(scenario: str, layout: Layout, link_delay_ms: float, slowdown: float) -> str:
    if scenario == "slow-link":
        a, b = layout.slow_link
        return f"slow-link {a}<->{b} +{link_delay_ms:g}ms"
    if scenario == "slow-stage":
        return f"slow-stage rank {layout.slow_rank} x{slowdown:g}"
    return "equal"


# ------------------------------------------------------------------------------------- running

ITERATION_TIME = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
MEMORY = re.compile(r"\[rank (\d+)\] pp rank (\d+): peak activation memory ([0-9.]+) MiB \((\d+) bytes kept for "
                    r"backward\), peak stored activations (\d+)")


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CPU_PERIOD_US = 10_000  # a short period, so the quota spreads a rank's share evenly over each task


def command(layout: Layout, model: Model, flags: list[str], iters: int, cgroup: Path | None = None) -> list[str]:
    """The training run; with `cgroup` each rank first joins cgroup/rank<LOCAL_RANK> (--cpu-per-rank)."""
    script = ["pretrain_gpt.py"] if cgroup is None else [str(Path(__file__).resolve()), WORKER_FLAG, str(cgroup),
                                                          "pretrain_gpt.py"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(layout.pp),
            "--master-addr", "127.0.0.1", "--master-port", "PORT", *script, *model.flags(layout),
            "--train-iters", str(iters), "--report-activation-memory", *flags]


WORKER_FLAG = "--as-rank-in-cgroup"


def run_as_rank_in_cgroup(argv: list[str]) -> None:
    """What torchrun starts with --cpu-per-rank: join GROUP/rank<LOCAL_RANK> (every thread started
    later stays in it), then run the training script as __main__."""
    group, script, *rest = argv
    (Path(group) / f"rank{os.environ['LOCAL_RANK']}" / "cgroup.procs").write_text(str(os.getpid()))
    sys.argv = [script, *rest]
    sys.path.insert(0, str(ROOT))
    runpy.run_path(str(ROOT / script), run_name="__main__")


class RankCpuShares:
    """One cgroup (v1 cpu) per local rank, each with a quota of `fraction` of a core, so that ranks
    outnumbering the cores each run as on a core of their own that is 1/fraction times slower:
    a rank waiting in a bubble cannot lend its time to another. Removed by `close()`."""

    def __init__(self, ranks: int, fraction: float) -> None:
        if not (CGROUP_V1 / "cpu.cfs_quota_us").exists() or not os.access(CGROUP_V1, os.W_OK):
            raise SystemExit(f"--cpu-per-rank needs a writable cgroup v1 cpu hierarchy at {CGROUP_V1} (run as root)")
        self.group = CGROUP_V1 / f"pipeline-schedules-{os.getpid()}"
        self.group.mkdir()
        self.ranks = [self.group / f"rank{rank}" for rank in range(ranks)]
        for directory in self.ranks:
            directory.mkdir()
            (directory / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (directory / "cpu.cfs_quota_us").write_text(str(max(1000, int(fraction * CPU_PERIOD_US))))

    def close(self) -> None:
        for directory in [*self.ranks, self.group]:
            for pid in (directory / "cgroup.procs").read_text().split() if directory.exists() else []:
                (CGROUP_V1 / "cgroup.procs").write_text(pid)  # a straggler goes back to the root group
            if directory.exists():
                directory.rmdir()


@dataclass
class RunResult:
    iteration_ms: list[float]
    median_ms: float
    memory_mib: dict[int, float]  # pp rank -> peak MiB kept for backward
    stored: dict[int, int]  # pp rank -> peak stored activations
    wall_s: float


def run(cmd: list[str], iters: int, timeout_s: float) -> RunResult:
    cmd = [str(_port()) if part == "PORT" else part for part in cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    begun = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - begun
    times = [float(t) for t in ITERATION_TIME.findall(proc.stdout)]
    if proc.returncode != 0 or len(times) < iters:
        raise RuntimeError(f"run failed (exit {proc.returncode}, {len(times)}/{iters} iterations): "
                           f"{shlex.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    memory, stored = {}, {}
    for _, pp_rank, mib, _, peak in MEMORY.findall(proc.stdout):
        memory[int(pp_rank)] = float(mib)
        stored[int(pp_rank)] = int(peak)
    return RunResult(times, statistics.median(times[2:]), memory, stored, wall)


# --------------------------------------------------------------------------------- calibration


def _span_durations(trace_dir: Path, first_iteration: int) -> dict[int, dict[str, list[float]]]:
    """pp rank -> span name -> durations (ms) of the spans of iterations >= first_iteration."""
    from megatron.scan.trace_format import iter_trace_files, read_rank_file

    out: dict[int, dict[str, list[float]]] = {}
    files = list(iter_trace_files(trace_dir))
    if not files:
        raise RuntimeError(f"calibration: no trace files in {trace_dir}")
    for path in files:
        trace = read_rank_file(path)
        pp_rank = int(trace.header["coordinates"]["pp"])
        c = trace.columns
        spans: dict[str, list[float]] = {}
        for name, start, end, iteration in zip(c["name"], c["start_ns"], c["end_ns"], c["iteration"]):
            if int(iteration) >= first_iteration:
                spans.setdefault(trace.names[name], []).append((int(end) - int(start)) / 1e6)
        out[pp_rank] = spans
    return out


def _median(spans: dict[str, list[float]], name: str) -> float:
    values = spans.get(name)
    if not values:
        raise RuntimeError(f"calibration: no {name!r} spans in the trace (have {sorted(spans)})")
    return statistics.median(values)


@dataclass
class Calibration:
    """Per pp rank median times (ms) from the traced equal-stage runs."""

    layout: str
    unsplit: dict[int, dict]  # 1f1b run: forward, backward, layer_forward, layer_backward, outside
    split: dict[int, dict]  # zb-h1 run: forward, input_grad, weight_grad, outside (grad_sync, optimizer)
    layers_per_rank: int
    runs: dict[str, list[float]] = field(default_factory=dict)  # the calibration runs' median iteration ms

    def to_dict(self) -> dict:
        return {"layout": self.layout, "unsplit_1f1b_trace": self.unsplit, "split_zb_h1_trace": self.split,
                "layers_per_rank": self.layers_per_rank, "calibration_run_median_iteration_ms": self.runs}


def calibrate(layout: Layout, model: Model, iters: int, timeout_s: float, work: Path, progress,
              cgroup: Path | None = None) -> Calibration:
    unsplit: dict[int, dict[str, float]] = {}
    split: dict[int, dict[str, float]] = {}
    runs = {}
    for schedule in ("1f1b", "zb-h1"):
        trace_dir = work / f"calibrate-{layout.name}-{schedule}"
        trace_dir.mkdir(parents=True, exist_ok=True)
        for old in trace_dir.iterdir():
            old.unlink()
        flags = [*schedule_flags(schedule, layout, None), "--trace", "--trace-dir", str(trace_dir),
                 "--trace-interval", "1", "--continuous-trace-iterations", "1", "--trace-granularity", "full"]
        progress(f"calibrating {layout.name}: traced equal-stage {schedule} run ({iters} iterations)")
        result = run(command(layout, model, flags, iters, cgroup), iters, timeout_s)
        runs[schedule] = [result.median_ms]
        progress(f"  done in {result.wall_s:.0f} s, median iteration {result.median_ms:.1f} ms (traced)")
        spans = _span_durations(trace_dir, first_iteration=2)
        for pp_rank, s in sorted(spans.items()):
            outside = {name: _median(s, name) for name in ("grad_sync", "optimizer") if s.get(name)}
            if schedule == "1f1b":
                unsplit[pp_rank] = {"forward": _median(s, "forward"), "backward": _median(s, "backward"),
                                    "layer_forward": _median(s, "layer_forward"),
                                    "layer_backward": _median(s, "layer_backward"), "outside": outside}
            else:
                split[pp_rank] = {"forward": _median(s, "forward"), "input_grad": _median(s, "backward"),
                                  "weight_grad": _median(s, "backward_weight"), "outside": outside}
    return Calibration(layout.name, unsplit, split, layout.num_layers // layout.pp, runs)


# ---------------------------------------------------------------------------------- prediction


def interleaved_chunk_times(cal: Calibration, pp: int, kind: str) -> dict[tuple[int, int], float]:
    """(rank, chunk) -> ms of one chunk's forward or backward on the interleaved layout, cut from the
    1f1b trace: each chunk gets its share of the rank's layers at that rank's per-layer time, plus
    the rank's non-layer time (embedding on virtual stage 0, output layer and loss on the last
    virtual stage) where that part lands; every other chunk gets the smallest per-chunk remainder
    seen (the work of a chunk outside its layers)."""
    per_chunk_layers = cal.layers_per_rank / VIRTUAL_CHUNKS
    layer_key = "layer_forward" if kind == "forward" else "layer_backward"
    extra = {r: max(0.0, t[kind] - cal.layers_per_rank * t[layer_key]) for r, t in cal.unsplit.items()}
    middle = [extra[r] for r in range(1, pp - 1)]
    generic = statistics.median(middle) if middle else min(extra.values())
    out = {}
    for rank in range(pp):
        for chunk in range(VIRTUAL_CHUNKS):
            ends = (rank == 0 and chunk == 0) or (rank == pp - 1 and chunk == VIRTUAL_CHUNKS - 1)
            out[(rank, chunk)] = per_chunk_layers * cal.unsplit[rank][layer_key] + (extra[rank] if ends else generic)
    return out


class LinkStallCosts:
    """The slow link as this repository's injector delivers it to a static order: the receive
    completes DELAY after the receiver starts waiting for a message that has arrived (or after it
    arrives), so the receiving task starts DELAY after max(ready, arrival) -- a stall on the
    receiver, not a latency the receiver can overlap with earlier work."""

    def __init__(self, base, delays: dict[tuple[int, int], float], layout) -> None:
        self.base, self.delays, self.layout = base, delays, layout

    def compute_time(self, rank: int, task) -> float:
        extra = 0.0
        source = self.layout.input_source(rank, task)
        if source is not None:
            extra = self.delays.get((source[0], rank), 0.0)
        return self.base.compute_time(rank, task) + extra

    def transfer_time(self, src_rank: int, dst_rank: int, task) -> float:
        return self.base.transfer_time(src_rank, dst_rank, task)


def predict(cal: Calibration, layout: Layout, schedule: str, scenario: str, link_delay_ms: float,
            slowdown: float) -> dict:
    """Simulated makespan (ms) of one iteration of `schedule` in `scenario`: the latency model (the
    injected delay added to the link's latency) and, for the slow link, the stall model."""
    from megatron.app.schedule import PipelineLayout
    from megatron.app.simulator import CostModel, simulate, simulate_schedule
    from megatron.dpp.policy import dpp_policies

    p, m = layout.pp, layout.microbatches
    if schedule in ("1f1b", "interleaved"):
        chunks = 1 if schedule == "1f1b" else VIRTUAL_CHUNKS
        pl = PipelineLayout(p, chunks, m)
        if chunks == 1:
            fwd = {(r, 0): cal.unsplit[r]["forward"] for r in range(p)}
            bwd = {(r, 0): cal.unsplit[r]["backward"] for r in range(p)}
        else:
            fwd = interleaved_chunk_times(cal, p, "forward")
            bwd = interleaved_chunk_times(cal, p, "backward")
        fraction = 0.5
    else:
        pl = PipelineLayout(p, 1, m, split_backward=True)
        fwd = {(r, 0): cal.split[r]["forward"] for r in range(p)}
        bwd = {(r, 0): cal.split[r]["input_grad"] + cal.split[r]["weight_grad"] for r in range(p)}
        fraction = (sum(cal.split[r]["weight_grad"] for r in range(p)) /
                    sum(cal.split[r]["input_grad"] + cal.split[r]["weight_grad"] for r in range(p)))
    base = dict(stage_forward_time=fwd, stage_backward_time=bwd, weight_grad_fraction=fraction,
                forward_time=statistics.mean(fwd.values()), backward_time=statistics.mean(bwd.values()))
    links: dict[tuple[int, int], float] = {}
    slow: dict[int, float] = {}
    if scenario == "slow-link":
        a, b = layout.slow_link
        links = {(a, b): link_delay_ms, (b, a): link_delay_ms}
    elif scenario == "slow-stage":
        slow = {layout.slow_rank: slowdown}
    costs = CostModel(**base, link_latency=links, rank_slowdown=slow)

    def makespan(c) -> float:
        if schedule == "dpp+W":
            return simulate(pl, dpp_policies(pl, "adaptive"), c).makespan
        return simulate_schedule(schedule, pl, c).makespan

    out = {"makespan_ms": makespan(costs)}
    if scenario == "slow-link":
        out["stall_makespan_ms"] = makespan(LinkStallCosts(CostModel(**base, rank_slowdown=slow), links, pl))
    return out


def uniform_ratios(layout: Layout, schedules) -> dict[str, float]:
    """Simulated 1F1B makespan / each schedule's on uniform costs (F 1, B 2 split as I 1 + W 1, free
    links; interleaved chunks cost half): the zero-bubble goal's reference figure."""
    from megatron.app.schedule import PipelineLayout
    from megatron.app.simulator import CostModel, simulate, simulate_schedule
    from megatron.dpp.policy import dpp_policies

    p, m = layout.pp, layout.microbatches
    costs = CostModel(forward_time=1.0, backward_time=2.0, weight_grad_fraction=0.5)
    spans = {}
    for schedule in schedules:
        if schedule == "1f1b":
            spans[schedule] = simulate_schedule("1f1b", PipelineLayout(p, 1, m), costs).makespan
        elif schedule == "interleaved":
            half = CostModel(forward_time=1.0 / VIRTUAL_CHUNKS, backward_time=2.0 / VIRTUAL_CHUNKS)
            spans[schedule] = simulate_schedule("interleaved", PipelineLayout(p, VIRTUAL_CHUNKS, m), half).makespan
        else:
            pl = PipelineLayout(p, 1, m, split_backward=True)
            spans[schedule] = (simulate(pl, dpp_policies(pl, "adaptive"), costs) if schedule == "dpp+W"
                               else simulate_schedule(schedule, pl, costs)).makespan
    return {s: spans["1f1b"] / v for s, v in spans.items()}


# ------------------------------------------------------------------------------------- report


def _fmt_ranks(values: dict[int, float] | None, spec: str) -> str:
    if not values:
        return "-"
    return "/".join(format(values[r], spec) for r in sorted(values))


def print_table(layout: Layout, cells: dict, scenarios, schedules, labels: dict[str, str],
                cpu_per_rank: float | None = None) -> None:
    shared = f"each rank capped at {cpu_per_rank:g} of a core, " if cpu_per_rank is not None else (
        "oversubscribed: " if layout.pp > (os.cpu_count() or 1) else "")
    print(f"\n== {layout.name}: PP={layout.pp}, m={layout.microbatches}, {shared}{layout.pp} ranks on "
          f"{os.cpu_count()} cores ==")
    head = (f"{'scenario':<28} {'schedule':<12} {'tok/s meas (range)':>24} {'x1F1B':>6} {'tok/s pred':>10} "
            f"{'x1F1B':>6} {'meas/pred':>9}  {'peak act MiB per rank':<24} {'stored':<10}")
    print(head)
    for scenario in scenarios:
        base = cells.get((scenario, "1f1b"))
        for schedule in schedules:
            cell = cells.get((scenario, schedule))
            if cell is None:
                continue
            meas = cell["tokens_per_s"]
            pred = cell["predicted_tokens_per_s"]
            ratio = meas["median"] / base["tokens_per_s"]["median"] if base else float("nan")
            pratio = pred / base["predicted_tokens_per_s"] if base else float("nan")
            rng = f"{meas['median']:.0f} ({meas['min']:.0f}-{meas['max']:.0f})"
            stall = ""
            if "predicted_stall_tokens_per_s" in cell and base:
                stall = (f"  [stall model: {cell['predicted_stall_tokens_per_s']:.0f} tok/s, "
                         f"x{cell['predicted_stall_tokens_per_s'] / base['predicted_stall_tokens_per_s']:.2f}]")
            print(f"{labels[scenario]:<28} {schedule:<12} {rng:>24} {ratio:>6.2f} {pred:>10.0f} {pratio:>6.2f} "
                  f"{meas['median'] / pred:>9.2f}  {_fmt_ranks(cell['memory_mib'], '.1f'):<24} "
                  f"{_fmt_ranks(cell['stored'], 'd'):<10}{stall}", flush=True)


# --------------------------------------------------------------------------------------- main


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:  # a rank started by torchrun under --cpu-per-rank
        run_as_rank_in_cgroup(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="pipeline layouts: pp2 (2 ranks, 4 layers, global batch 8) and pp4 (4 ranks, 8 layers, "
                             "global batch 16); m = 2p microbatches of --micro-batch-size, DP=1 (default: both)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                        help="equal stages; slow-link (a middle link delayed both ways); slow-stage (a middle "
                             "rank's compute --slowdown x slower) (default: all)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                        help="pipeline orders to measure; 1f1b is always run (the ratios are to it); interleaved "
                             f"uses {VIRTUAL_CHUNKS} virtual chunks per rank, same total layers; dpp+W is MegaDPP's "
                             "adaptive policy with --dpp-split-backward (default: all)")
    parser.add_argument("--iters", type=int, default=8,
                        help="training iterations per run; the median of iterations 3..N is used (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per cell; the schedules of a scenario run alternately, the first one rotating "
                             "each round; the median run and the range are reported (default %(default)s)")
    parser.add_argument("--link-delay-ms", type=float, default=None,
                        help="delay of the slow link, each direction, in ms (default: one forward of the link's "
                             "upstream rank, from the calibration trace, rounded to 1 ms)")
    parser.add_argument("--slowdown", type=float, default=1.5,
                        help="compute slowdown factor of the slow stage (default %(default)s)")
    parser.add_argument("--dpp-transport", choices=["shm", "torch"], default=None,
                        help="dpp+W's transport (default: the trainer's default, shm; the static orders use gloo)")
    parser.add_argument("--hidden-size", type=int, default=256, help="model hidden size (default %(default)s)")
    parser.add_argument("--seq-length", type=int, default=256, help="sequence length (default %(default)s)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="micro batch size (default %(default)s)")
    parser.add_argument("--calibration-iters", type=int, default=6,
                        help="iterations of each traced calibration run; spans of iterations 3.. are used "
                             "(default %(default)s)")
    parser.add_argument("--run-timeout", type=float, default=600,
                        help="seconds before a single training run is abandoned (default %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where calibration traces go (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every result (runs, medians, predictions, calibration, commands) here; "
                             "rewritten after each cell")
    parser.add_argument("--cpu-per-rank", type=float, default=None, metavar="FRACTION",
                        help="cap each rank at FRACTION of a core with a cgroup (v1 cpu quota, root), e.g. 0.5 to "
                             "run PP=4 on 2 cores as 4 half-speed cores: a rank idle in a bubble then cannot lend "
                             "its time to another (default: no cap; ranks beyond the cores share them)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the measured runs' training commands and exit (no calibration, no runs)")
    args = parser.parse_args()
    if args.iters < 3 or args.calibration_iters < 3:
        parser.error("--iters and --calibration-iters must be >= 3 (iterations 1-2 are left out)")
    schedules = ["1f1b"] + [s for s in args.schedules if s != "1f1b"]
    model = Model(hidden=args.hidden_size, seq=args.seq_length, micro_batch=args.micro_batch_size)
    cores = os.cpu_count() or 1

    if args.dry_run:
        for name in args.layouts:
            layout = LAYOUTS[name]
            delay = args.link_delay_ms if args.link_delay_ms is not None else 30.0
            if "slow-link" in args.scenarios and args.link_delay_ms is None:
                print(f"# {name}: slow-link delay shown as {delay:g} ms; a real run without --link-delay-ms "
                      f"uses one forward of the link's upstream rank from the calibration trace")
            for scenario in args.scenarios:
                for schedule in schedules:
                    flags = schedule_flags(schedule, layout, args.dpp_transport) + \
                        scenario_flags(scenario, layout, delay, args.slowdown)
                    print(shlex.join(command(layout, model, flags, args.iters)))
        return 0

    started = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {text}", flush=True)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pipeline-schedules-"))
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": cores, "argv": sys.argv,
                    "model": vars(model), "iters": args.iters, "repeat": args.repeat, "slowdown": args.slowdown,
                    "dpp_transport": args.dpp_transport or "shm (trainer default)", "static_transport": "gloo",
                    "note": "predicted = tokens / simulated makespan; the simulator models the pipeline only "
                            "(no optimizer step, no DP/embedding all-reduce, no Python overhead)",
                    "layouts": {}}

    def save() -> None:
        if args.json is not None:
            tmp = args.json.with_suffix(args.json.suffix + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(args.json)

    print(f"pipeline schedules on CPU: {cores} cores, tokens/s = global batch x seq / median iteration of "
          f"iterations 3..{args.iters}, {args.repeat} run(s) per cell; static orders over gloo, dpp+W over "
          f"{args.dpp_transport or 'shm (the default --dpp-transport)'}")
    print("predicted = tokens / simulated makespan; the simulator models the pipeline only (no optimizer step, "
          "no DP/embedding all-reduce, no Python overhead): compare the ratios to 1F1B", flush=True)
    shares = None
    if args.cpu_per_rank is not None:
        if not 0 < args.cpu_per_rank <= 1:
            parser.error(f"--cpu-per-rank is a share of one core in (0, 1], got {args.cpu_per_rank}")
        shares = RankCpuShares(max(LAYOUTS[name].pp for name in args.layouts), args.cpu_per_rank)
        report["cpu_per_rank"] = args.cpu_per_rank
    try:
        measure(args, report, schedules, model, cores, work, progress, save, shares)
    finally:
        if shares is not None:
            shares.close()
    progress(f"finished; {'results in ' + str(args.json) if args.json else 'no --json given'}")
    return 0


def measure(args, report, schedules, model, cores, work, progress, save, shares) -> None:
    """Calibrate, run and print every layout's cells (main's loop)."""
    cgroup = shares.group if shares is not None else None
    for name in args.layouts:
        layout = LAYOUTS[name]
        if shares is not None:
            progress(f"{name}: each rank capped at {args.cpu_per_rank:g} of a core (cgroup quota, "
                     f"{CPU_PERIOD_US // 1000} ms periods): {layout.pp} x {args.cpu_per_rank:g} = "
                     f"{layout.pp * args.cpu_per_rank:g} cores of {cores}")
        elif layout.pp > cores:
            progress(f"{name}: {layout.pp} ranks on {cores} cores: OVERSUBSCRIBED, ranks share cores (the slow "
                     f"stage's injected time is then a sleep, which frees its core); figures are not one core "
                     f"per rank")
        cal = calibrate(layout, model, args.calibration_iters, args.run_timeout, work, progress, cgroup)
        for r in sorted(cal.split):
            u, s = cal.unsplit[r], cal.split[r]
            progress(f"  pp rank {r}: 1f1b trace F {u['forward']:.1f} B {u['backward']:.1f} (per layer F "
                     f"{u['layer_forward']:.1f} B {u['layer_backward']:.1f}) | zb-h1 trace F {s['forward']:.1f} "
                     f"I {s['input_grad']:.1f} W {s['weight_grad']:.1f} ms | outside the pipeline (1f1b trace): "
                     + ", ".join(f"{k.replace('_', ' ')} {v:.1f} ms" for k, v in u["outside"].items())
                     + " (grad sync includes waiting for the other end's embedding all-reduce)")
        upstream = layout.slow_link[0]
        delay = args.link_delay_ms if args.link_delay_ms is not None else \
            float(max(1, round(cal.unsplit[upstream]["forward"])))
        labels = {s: scenario_label(s, layout, delay, args.slowdown) for s in args.scenarios}
        uniform = uniform_ratios(layout, schedules)
        progress("  uniform-cost simulator (F 1, B 2 = I 1 + W 1, free links), x1F1B: "
                 + ", ".join(f"{s} {r:.2f}" for s, r in uniform.items()))
        entry = {"pp": layout.pp, "microbatches": layout.microbatches, "num_layers": layout.num_layers,
                 "global_batch": model.global_batch(layout), "tokens_per_iteration": model.tokens(layout),
                 "oversubscribed": layout.pp > cores and shares is None, "link_delay_ms": delay, "slow_link": list(layout.slow_link),
                 "slow_rank": layout.slow_rank, "calibration": cal.to_dict(),
                 "uniform_cost_ratio_to_1f1b": uniform, "cells": []}
        report["layouts"][name] = entry
        save()
        cells: dict = {}
        total = len(args.scenarios) * len(schedules) * args.repeat
        done = 0
        for scenario in args.scenarios:
            runs: dict[str, list[RunResult]] = {s: [] for s in schedules}
            commands = {}
            for round_ in range(args.repeat):
                shift = round_ % len(schedules)
                for schedule in schedules[shift:] + schedules[:shift]:
                    flags = schedule_flags(schedule, layout, args.dpp_transport) + \
                        scenario_flags(scenario, layout, delay, args.slowdown)
                    cmd = command(layout, model, flags, args.iters, cgroup)
                    commands[schedule] = shlex.join(cmd)
                    done += 1
                    result = run(cmd, args.iters, args.run_timeout)
                    runs[schedule].append(result)
                    progress(f"{name} [{done}/{total}] {labels[scenario]} {schedule} run {round_ + 1}/{args.repeat}: "
                             f"median {result.median_ms:.1f} ms = {model.tokens(layout) / result.median_ms * 1e3:.0f} "
                             f"tok/s ({result.wall_s:.0f} s)")
            for schedule in schedules:
                medians = [r.median_ms for r in runs[schedule]]
                tps = [model.tokens(layout) / ms * 1e3 for ms in medians]
                pred = predict(cal, layout, schedule, scenario, delay, args.slowdown)
                mem = {r: max(x.memory_mib.get(r, 0.0) for x in runs[schedule]) for r in runs[schedule][0].memory_mib}
                stored = {r: max(x.stored.get(r, 0) for x in runs[schedule]) for r in runs[schedule][0].stored}
                cell = {"scenario": scenario, "label": labels[scenario], "schedule": schedule,
                        "command": commands[schedule],
                        "runs_iteration_ms": [r.iteration_ms for r in runs[schedule]],
                        "runs_median_ms": medians, "median_ms": statistics.median(medians),
                        "tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps),
                                         "runs": tps},
                        "predicted_makespan_ms": pred["makespan_ms"],
                        "predicted_tokens_per_s": model.tokens(layout) / pred["makespan_ms"] * 1e3,
                        "memory_mib": mem, "stored": stored}
                if "stall_makespan_ms" in pred:
                    cell["predicted_stall_makespan_ms"] = pred["stall_makespan_ms"]
                    cell["predicted_stall_tokens_per_s"] = model.tokens(layout) / pred["stall_makespan_ms"] * 1e3
                cells[(scenario, schedule)] = cell
                base = cells[(scenario, "1f1b")]
                cell["ratio_to_1f1b_measured"] = cell["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
                cell["ratio_to_1f1b_predicted"] = cell["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
                if "predicted_stall_tokens_per_s" in cell:
                    cell["ratio_to_1f1b_predicted_stall"] = (cell["predicted_stall_tokens_per_s"]
                                                             / base["predicted_stall_tokens_per_s"])
                entry["cells"].append({k: ({str(r): v for r, v in val.items()} if isinstance(val, dict) and
                                           k in ("memory_mib", "stored") else val) for k, val in cell.items()})
            save()
            print_table(layout, {k: v for k, v in cells.items() if k[0] == scenario}, [scenario], schedules, labels,
                        args.cpu_per_rank)
        print_table(layout, cells, args.scenarios, schedules, labels, args.cpu_per_rank)


if __name__ == "__main__":
    sys.exit(main())
