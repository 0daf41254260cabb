"""Synthetic 3D-parallel traces in the real file format, for tests and benchmarks at any scale.

The pipeline timeline of each data-parallel replica comes from the app's schedule simulator; TP
peers share it, with TP all-reduces inside every forward/backward that end together; DP gradient
all-reduces and model-parallel grad-norm all-reduces synchronize the step. Each rank's clocks are
then distorted by a known wall-clock offset and monotonic drift, so alignment can be checked."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron.app.schedule import PipelineLayout
from megatron.app.simulator import CostModel, simulate_schedule
from megatron.scan.trace_format import (
    FLAG_BACKWARD,
    FORMAT,
    INT_COLUMNS,
    VERSION,
    trace_file_name,
    window_line,
    write_lines,
)

_US = 1_000  # ns


@dataclass(kw_only=True)
class SyntheticRun:
    tp: int = 2
    pp: int = 2
    dp: int = 2
    microbatches: int | None = None  # default: 2 * pp
    iterations: int = 2
    layers_per_stage: int = 2
    forward_ms: float = 2.0
    backward_ms: float = 4.0
    jitter: float = 0.05
    offsets_ms: dict[int, float] = field(default_factory=dict)  # rank -> wall-clock error
    drift_ppm: dict[int, float] = field(default_factory=dict)  # rank -> monotonic clock rate error
    noise_us: float = 2.0  # measurement noise on every timestamp
    seed: int = 0
    run_id: str = ""
    window_iterations: int | None = None  # iterations per traced window (default: one window of them all)
    # Ranks per host sharing one clock, as on a real job (consecutive ranks: a TP group of up to
    # this many on one host), with host identities in the headers; a rank's clock error
    # (offsets_ms, drift_ppm) is then its host's, the one given for the host's lowest rank that
    # has one. None: no host identities, every rank a clock of its own (traces of old tracers).
    ranks_per_host: int | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """megatron-core's default order: tp fastest, then dp, then pp."""
        return tp + self.tp * (dp + self.dp * pp)


_NAMES = ["iteration", "data", "forward", "backward", "send", "recv", "all_reduce", "grad_sync", "optimizer", "float32"]
_ID = {n: i for i, n in enumerate(_NAMES)}


class _Events:
    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def add(self, name: str, start: float, end: float, iteration: int, microbatch: int = -1, chunk: int = -1,
            size: int = -1, peer: int = -1, group: int = -1, seq: int = -1, flags: int = 0) -> None:
        dtype = _ID["float32"] if size >= 0 else -1
        self.rows.append((_ID[name], start, end, iteration, microbatch, chunk, size, peer, group, seq, -1, flags, dtype))


def generate(run: SyntheticRun, directory: str | os.PathLike) -> list[Path]:
    """Write one trace file per rank; returns their paths. Times are simulated in ns."""
    rng = np.random.default_rng(run.seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    m = run.microbatches or 2 * run.pp
    run_id = run.run_id or f"{int(rng.integers(0, 2**62)):016x}"
    layout = PipelineLayout(pp_size=run.pp, num_chunks=1, num_microbatches=m)
    groups: dict[tuple, int] = {}  # (kind, ranks) -> gid, shared by every rank's file
    seqs: dict[int, int] = {}
    events = {r: _Events() for r in range(run.world_size)}
    activation_bytes = 4 * 1024 * 1024

    def group_id(kind: str, ranks: list[int]) -> int:
        return groups.setdefault((kind, tuple(sorted(ranks))), len(groups))

    def collective(gid: int, ranks: list[int], arrivals: dict[int, float], cost_ns: float, iteration: int,
                   microbatch: int = -1, size: int = 1 << 20) -> float:
        seq = seqs.get(gid, 0)
        seqs[gid] = seq + 1
        end = max(arrivals.values()) + cost_ns
        for r in ranks:
            events[r].add("all_reduce", arrivals[r], end, iteration, microbatch, 0, size, group=gid, seq=seq)
        return end

    now = 0.0
    iteration_bounds = []
    for iteration in range(run.iterations):
        iteration_start = now + 50 * _US
        finish: dict[int, float] = {}
        for dp in range(run.dp):
            costs = CostModel(forward_time=run.forward_ms, backward_time=run.backward_ms, jitter=run.jitter,
                              p2p_latency=0.05, seed=int(rng.integers(0, 2**31)))
            result = simulate_schedule("1f1b", layout, costs)
            arrival = {(t.dst_rank, t.dst_task): t.arrival_time for t in result.transfers}
            last_end = {p: iteration_start for p in range(run.pp)}
            for record in result.records:
                p, task = record.rank, record.task
                start = iteration_start + record.start * 1e6
                end = iteration_start + record.end * 1e6
                tp_ranks = [run.rank(dp, p, t) for t in range(run.tp)]
                forward = task.kind.value == "F"
                if forward and p == 0:
                    for r in tp_ranks:
                        events[r].add("data", start - 20 * _US, start - 5 * _US, iteration, task.microbatch, 0)
                source = layout.input_source(p, task)
                if source is not None:
                    for r in tp_ranks:
                        peer = run.rank(dp, source[0], r % run.tp)
                        wait_from = max(last_end[p], start - 200 * _US)
                        events[r].add("recv", wait_from, start, iteration, task.microbatch, 0, activation_bytes, peer,
                                      flags=0 if forward else FLAG_BACKWARD)
                name = "forward" if forward else "backward"
                for r in tp_ranks:
                    events[r].add(name, start, end, iteration, task.microbatch, 0)
                # TP all-reduces inside the task: two per layer, all TP peers finish them together.
                if run.tp > 1:
                    gid = group_id("TENSOR_MODEL_PARALLEL_GROUP", tp_ranks)
                    count = 2 * run.layers_per_stage
                    for j in range(count):
                        point = start + (end - start) * (j + 0.8) / (count + 0.5)
                        arrivals = {r: point + float(rng.exponential(15 * _US)) for r in tp_ranks}
                        collective(gid, tp_ranks, arrivals, 10 * _US, iteration, task.microbatch)
                destination = layout.output_destination(p, task)
                if destination is not None:
                    for r in tp_ranks:
                        peer = run.rank(dp, destination[0], r % run.tp)
                        events[r].add("send", end, end + 30 * _US, iteration, task.microbatch, 0, activation_bytes,
                                      peer, flags=0 if forward else FLAG_BACKWARD)
                last_end[p] = end + 30 * _US
            for p in range(run.pp):
                for t in range(run.tp):
                    finish[run.rank(dp, p, t)] = last_end[p]
        # Gradient sync across DP replicas, then the grad-norm all-reduce over each model-parallel group.
        synced: dict[int, float] = {}
        for p in range(run.pp):
            for t in range(run.tp):
                dp_ranks = [run.rank(d, p, t) for d in range(run.dp)]
                arrivals = {r: finish[r] + float(rng.exponential(20 * _US)) for r in dp_ranks}
                end = collective(group_id("DATA_PARALLEL_GROUP", dp_ranks), dp_ranks, arrivals, 300 * _US,
                                 iteration, size=64 << 20) if run.dp > 1 else max(arrivals.values())
                for r in dp_ranks:
                    events[r].add("grad_sync", finish[r], end + 5 * _US, iteration)
                    synced[r] = end + 5 * _US
        done: dict[int, float] = {}
        for d in range(run.dp):
            mp_ranks = [run.rank(d, p, t) for p in range(run.pp) for t in range(run.tp)]
            arrivals = {r: synced[r] + float(rng.exponential(20 * _US)) for r in mp_ranks}
            end = collective(group_id("MODEL_PARALLEL_GROUP", mp_ranks), mp_ranks, arrivals, 20 * _US, iteration,
                             size=8)
            for r in mp_ranks:
                events[r].add("optimizer", synced[r], end + 500 * _US, iteration)
                done[r] = end + 500 * _US
        for r in range(run.world_size):
            events[r].add("iteration", iteration_start, done[r] + 10 * _US, iteration)
        now = max(done.values())
        iteration_bounds.append((iteration_start, now))

    group_table = {gid: {"name": str(gid + 1), "ranks": list(ranks), "desc": kind} for (kind, ranks), gid in groups.items()}
    paths = []
    wall_epoch = 1_700_000_000 * 10**9
    per_window = run.window_iterations or run.iterations
    windows = [(first, min(first + per_window, run.iterations) - 1) for first in range(0, run.iterations, per_window)]
    bounds = [(iteration_bounds[first][0] - 100 * _US, iteration_bounds[last][1] + 100 * _US) for first, last in windows]
    for dp in range(run.dp):
        for p in range(run.pp):
            for t in range(run.tp):
                r = run.rank(dp, p, t)
                paths.append(_write_rank(directory / trace_file_name(dp, p, t), run, r, (dp, p, t), run_id, events[r],
                                         group_table, rng, wall_epoch, windows, bounds))
    return paths


def _write_rank(path: Path, run: SyntheticRun, rank: int, coordinates: tuple[int, int, int], run_id: str,
                events: _Events, group_table: dict, rng, wall_epoch: int, windows: list[tuple[int, int]],
                bounds: list[tuple[float, float]]) -> Path:
    drift = _clock_error(run, run.drift_ppm, rank) * 1e-6
    offset_ns = _clock_error(run, run.offsets_ms, rank) * 1e6
    mono_base = float(rng.integers(10**12, 10**13))  # each host's monotonic clock starts anywhere

    def monotonic(true_ns):
        return mono_base + np.asarray(true_ns) * (1.0 + drift)

    def pair(true_ns: float) -> dict[str, int]:
        return {"wall_ns": int(wall_epoch + true_ns + offset_ns), "monotonic_ns": int(monotonic(true_ns))}

    rows = np.array(events.rows, dtype=np.float64).reshape(-1, 2 + len(INT_COLUMNS))
    noise = rng.normal(0.0, run.noise_us * _US, size=(len(rows), 2)) if run.noise_us else 0.0
    true_times = rows[:, 1:3] + noise
    dp, pp, tp = coordinates
    lines = []
    for index, ((first, last), (start, end)) in enumerate(zip(windows, bounds)):
        t0 = pair(start)
        if not lines:
            header = {"type": "header", "format": FORMAT, "version": VERSION, "run_id": run_id, "rank": rank,
                      "world_size": run.world_size, "coordinates": {"dp": dp, "pp": pp, "tp": tp},
                      "sizes": {"dp": run.dp, "pp": run.pp, "tp": run.tp, "vpp": 1}, "host": f"synthetic-{rank // 8}",
                      "pid": 0, "clock_reference": t0, "device": "synthetic", "timing": "synthetic",
                      "trace": {"interval": run.iterations, "continuous": run.iterations, "granularity": "coarse"},
                      "synthetic": {"offset_ms": _clock_error(run, run.offsets_ms, rank),
                                    "drift_ppm": _clock_error(run, run.drift_ppm, rank)}}
            if run.ranks_per_host:
                header["host"] = f"synthetic-{rank // run.ranks_per_host}"
                header["host_id"] = f"{header['host']}/{run_id}"
            lines.append(header)
        keep = (rows[:, 3] >= first) & (rows[:, 3] <= last)
        times = monotonic(true_times[keep]) - t0["monotonic_ns"]
        columns = {"name": rows[keep, 0].astype(np.int64).tolist()}
        columns["start_ns"] = np.round(times[:, 0]).astype(np.int64).tolist()
        columns["end_ns"] = np.round(np.maximum(times[:, 1], times[:, 0])).astype(np.int64).tolist()
        for i, column in enumerate(INT_COLUMNS[2:], start=3):
            columns[column] = rows[keep, i].astype(np.int64).tolist()
        columns["dtype"] = rows[keep, -1].astype(np.int64).tolist()
        used = sorted({g for g in columns["group"] if g >= 0})
        lines.append(window_line(window=index, iterations=[first, last], clock_start=t0, clock_end=pair(end),
                                 names=_NAMES, groups={str(g): group_table[g] for g in used}, events=columns))
    lines.append({"type": "end", "windows": len(windows)})
    write_lines(path, lines)
    return path


def _clock_error(run: SyntheticRun, errors: dict[int, float], rank: int) -> float:
    """The rank's clock error: its own, or with ranks_per_host its host's."""
    if not run.ranks_per_host:
        return errors.get(rank, 0.0)
    first = rank - rank % run.ranks_per_host
    return next((errors[r] for r in range(first, first + run.ranks_per_host) if r in errors), 0.0)


def _parse_mapping(items: list[str], what: str) -> dict[int, float]:
    result = {}
    for item in items:
        try:
            rank, value = item.split(":")
            result[int(rank)] = float(value)
        except ValueError:
            raise SystemExit(f"error: {what} wants RANK:VALUE, got {item!r}") from None
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="directory the synthetic rank trace files are written to")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default %(default)s)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default %(default)s)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default %(default)s)")
    parser.add_argument("--iterations", type=int, default=2,
                        help="training iterations to synthesize (default %(default)s)")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per iteration (default 2 x --pp)")
    parser.add_argument("--offset", action="append", default=[], metavar="RANK:MS",
                        help="wall-clock error of a rank (with --ranks-per-host: of its host)")
    parser.add_argument("--drift", action="append", default=[], metavar="RANK:PPM",
                        help="clock drift of a rank (with --ranks-per-host: of its host)")
    parser.add_argument("--ranks-per-host", type=int, default=None, metavar="N",
                        help="N consecutive ranks share a host and its clock, named in the headers as real traces "
                             "name them (default: no host identities, a clock per rank)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the timing jitter and noise (default %(default)s)")
    parser.add_argument("--window", type=int, default=None, metavar="N",
                        help="iterations per traced window, as --trace-interval writes them (default: one window of "
                             "every iteration)")


def run(args: argparse.Namespace) -> int:
    spec = SyntheticRun(tp=args.tp, pp=args.pp, dp=args.dp, iterations=args.iterations, microbatches=args.microbatches,
                        offsets_ms=_parse_mapping(args.offset, "--offset"), drift_ppm=_parse_mapping(args.drift, "--drift"),
                        seed=args.seed, window_iterations=args.window, ranks_per_host=args.ranks_per_host)
    if args.window is not None and args.window < 1:
        raise SystemExit(f"error: --window {args.window}: a window holds at least 1 iteration")
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        raise SystemExit(f"error: --ranks-per-host {args.ranks_per_host}: a host holds at least 1 rank")
    paths = generate(spec, args.directory)
    print(f"wrote {len(paths)} synthetic rank traces to {args.directory}")
    return 0
