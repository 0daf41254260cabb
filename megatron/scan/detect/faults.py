"""Synthetic traces with known faults, for table-driven detection tests and the accuracy benchmark:
any DP x PP x TP layout, ranks whose compute is FACTOR x slower, P2P links that deliver late.
Each replica's pipeline runs on the schedule simulator; all clocks are true (alignment is tested
elsewhere), so a case's expected answer is exactly the faults it was given."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron.app.schedule import PipelineLayout
from megatron.app.simulator import CostModel, simulate_schedule
from megatron.scan.trace_format import FLAG_BACKWARD, FORMAT, INT_COLUMNS, VERSION, trace_file_name, window_line, write_lines

_US = 1_000.0  # ns
_NAMES = ["iteration", "forward", "backward", "send", "recv", "all_reduce", "grad_sync", "optimizer"]
_ID = {n: i for i, n in enumerate(_NAMES)}


@dataclass(kw_only=True)
class FaultCase:
    tp: int = 1
    pp: int = 2
    dp: int = 2
    iterations: int = 4
    microbatches: int | None = None  # default 2 * pp
    forward_ms: float = 2.0
    backward_ms: float = 4.0
    jitter: float = 0.1  # relative, per task and rank
    slow: dict[int, float] = field(default_factory=dict)  # global rank -> compute factor
    link_delay_ms: dict[tuple[int, int], float] = field(default_factory=dict)  # (src, dst) -> ms, same replica and tp
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """megatron-core's order: tp fastest, then dp, then pp."""
        return tp + self.tp * (dp + self.dp * pp)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        return dp, rank // (self.tp * self.dp), tp


def generate_case(case: FaultCase, directory: str | os.PathLike) -> list[Path]:
    rng = np.random.default_rng(case.seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    m = case.microbatches or 2 * case.pp
    layout = PipelineLayout(pp_size=case.pp, num_chunks=1, num_microbatches=m)
    rows: dict[int, list[tuple]] = {r: [] for r in range(case.world_size)}
    groups: dict[tuple, int] = {}
    seqs: dict[int, int] = {}

    def add(rank: int, name: str, start: float, end: float, iteration: int, microbatch: int = -1, size: int = -1,
            peer: int = -1, group: int = -1, seq: int = -1, flags: int = 0) -> None:
        rows[rank].append((_ID[name], start, end, iteration, microbatch, 0, size, peer, group, seq, -1, flags))

    def collective(kind: str, ranks: list[int], arrivals: dict[int, float], cost: float, iteration: int,
                   microbatch: int = -1) -> float:
        gid = groups.setdefault((kind, tuple(sorted(ranks))), len(groups))
        seq = seqs.get(gid, 0)
        seqs[gid] = seq + 1
        end = max(arrivals.values()) + cost
        for r in ranks:
            add(r, "all_reduce", arrivals[r], end, iteration, microbatch, 1 << 20, group=gid, seq=seq)
        return end

    now = 0.0
    for iteration in range(case.iterations):
        begin = now + 50 * _US
        finish: dict[int, float] = {}
        for d in range(case.dp):
            tp_ranks = {p: [case.rank(d, p, t) for t in range(case.tp)] for p in range(case.pp)}
            # The TP group of a stage moves at its slowest member's pace.
            stage_slow = {p: max(case.slow.get(r, 1.0) for r in tp_ranks[p]) for p in range(case.pp)}
            delays = {}
            for (src, dst), ms in case.link_delay_ms.items():
                (sd, sp, _), (dd, dp_, _) = case.coordinates(src), case.coordinates(dst)
                if sd == d and dd == d:
                    delays[(sp, dp_)] = ms
            costs = CostModel(forward_time=case.forward_ms, backward_time=case.backward_ms, rank_slowdown=stage_slow,
                              jitter=case.jitter, p2p_latency=0.05, link_latency=delays,
                              seed=int(rng.integers(0, 2**31)))
            result = simulate_schedule("1f1b", layout, costs)
            free = {r: begin for p in range(case.pp) for r in tp_ranks[p]}
            for record in result.records:
                p, task = record.rank, record.task
                start, end = begin + record.start * 1e6, begin + record.end * 1e6
                forward = task.kind.value == "F"
                name = "forward" if forward else "backward"
                source = layout.input_source(p, task)
                for r in tp_ranks[p]:
                    if source is not None:
                        peer = case.rank(d, source[0], r % case.tp)
                        # Posted as soon as the rank is free; it completes when the message arrives.
                        add(r, "recv", min(free[r], start), start, iteration, task.microbatch,
                            1 << 22, peer, flags=0 if forward else FLAG_BACKWARD)
                    add(r, name, start, end, iteration, task.microbatch)
                    if case.tp > 1:
                        # The row-parallel all-reduce that ends the task: faster members wait in it.
                        own = (end - start) * case.slow.get(r, 1.0) / stage_slow[p] * float(rng.uniform(0.97, 1.0))
                        collective_at = {q: start + (end - start) * case.slow.get(q, 1.0) / stage_slow[p] * 0.98
                                         for q in tp_ranks[p]}
                        collective_at[r] = min(start + own, end - 10 * _US)
                        if r == tp_ranks[p][-1]:
                            collective("TENSOR_MODEL_PARALLEL_GROUP", tp_ranks[p],
                                       {q: min(collective_at[q], end - 10 * _US) for q in tp_ranks[p]}, 0.0, iteration,
                                       task.microbatch)
                    destination = layout.output_destination(p, task)
                    if destination is not None:
                        peer = case.rank(d, destination[0], r % case.tp)
                        add(r, "send", end, end + 30 * _US, iteration, task.microbatch, 1 << 22, peer,
                            flags=0 if forward else FLAG_BACKWARD)
                    free[r] = end + 30 * _US
            finish.update(free)
        synced: dict[int, float] = {}
        for p in range(case.pp):
            for t in range(case.tp):
                members = [case.rank(d, p, t) for d in range(case.dp)]
                arrivals = {r: finish[r] + float(rng.exponential(20 * _US)) for r in members}
                end = (collective("DATA_PARALLEL_GROUP", members, arrivals, 300 * _US, iteration)
                       if case.dp > 1 else max(arrivals.values()))
                for r in members:
                    add(r, "grad_sync", finish[r], end + 5 * _US, iteration)
                    synced[r] = end + 5 * _US
        for r in range(case.world_size):
            add(r, "optimizer", synced[r], synced[r] + 500 * _US, iteration)
            add(r, "iteration", begin, synced[r] + 510 * _US, iteration)
        now = max(synced.values()) + 510 * _US
    return _write(case, directory, rows, groups, now)


def _write(case: FaultCase, directory: Path, rows: dict[int, list[tuple]], groups: dict[tuple, int],
           end_ns: float) -> list[Path]:
    table = {gid: {"name": str(gid + 1), "ranks": list(ranks), "desc": kind} for (kind, ranks), gid in groups.items()}
    wall = 1_700_000_000 * 10**9
    mono = 10**12
    paths = []
    for rank in range(case.world_size):
        data = np.array(rows[rank], dtype=np.float64).reshape(-1, 1 + len(INT_COLUMNS))
        events = {"name": data[:, 0].astype(np.int64).tolist()}
        for i, column in enumerate(INT_COLUMNS, start=1):
            events[column] = np.round(data[:, i]).astype(np.int64).tolist()
        events["dtype"] = [-1] * len(data)
        used = sorted({g for g in events["group"] if g >= 0})
        dp, pp, tp = case.coordinates(rank)
        start = {"wall_ns": wall, "monotonic_ns": mono}
        header = {"type": "header", "format": FORMAT, "version": VERSION, "run_id": f"faults-{case.seed}",
                  "rank": rank, "world_size": case.world_size, "coordinates": {"dp": dp, "pp": pp, "tp": tp},
                  "sizes": {"dp": case.dp, "pp": case.pp, "tp": case.tp, "vpp": 1}, "host": "synthetic", "pid": 0,
                  "clock_reference": start, "device": "synthetic", "timing": "synthetic",
                  "trace": {"interval": case.iterations, "continuous": case.iterations, "granularity": "coarse"}}
        window = window_line(window=0, iterations=[0, case.iterations - 1], clock_start=start,
                             clock_end={"wall_ns": wall + int(end_ns), "monotonic_ns": mono + int(end_ns)},
                             names=_NAMES, groups={str(g): table[g] for g in used}, events=events)
        path = directory / trace_file_name(dp, pp, tp)
        write_lines(path, [header, window, {"type": "end", "windows": 1}])
        paths.append(path)
    return paths
