"""The detection input of a trace directory that grows while the job runs, built window by window
(online detection). Each window is read, matched, clock-aligned and turned into tables once,
when every rank has written it; an analysis then concatenates the tables and runs the
analyzers. Re-reading, matching and aligning everything before each analysis took 21 of the
29 s of one analysis at 4,096 ranks x 20 iterations, and grew with the run.

Windows are independent units of the pipeline: every collective and P2P message of an
iteration lies in the window that traced it on every rank, and alignment fits and judges each
window on its own (align), but for one guard over the whole trace, applied here over all
windows (`build`). Windows some ranks have written and others not yet (a late or stopped rank) form a
provisional part, built again at each analysis until every rank has them. Directories the
incremental path does not cover (a torchrun restart's attempts, files of several runs, an
unreadable file) are read whole each time (`unusable` says why)."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from megatron.scan.align_check import summarize, worse
from megatron.scan.detect import compute_stats
from megatron.scan.detect.collective import merge_resolved, one_stage_rows, resolve_arrivals
from megatron.scan.detect.model import DetectionInput, gpu_summaries, host_table, roles_of, table_rows
from megatron.scan.load import missing_ranks
from megatron.scan.tail import DirectoryTail, RankTail


class WindowedInput:
    """DetectionInput of everything traced so far in `directory` (`build`), or with `history`, of
    the newest whole windows that hold at least `history` traced iterations: older windows' tables
    and metadata are let go, so that a long run's analyses keep to a bounded memory and time."""

    def __init__(self, directory: str | os.PathLike, tail: DirectoryTail | None = None, *,
                 history: int | None = None) -> None:
        if history is not None and history < 1:
            raise ValueError(f"history={history}: the traced iterations an analysis covers, at least 1 (None: all)")
        self.tail = tail or DirectoryTail(directory)
        self.history = history
        self.committed: list[_Part] = []  # one per window every rank has written (in the history)
        self.done = 0  # windows committed
        self.forgotten = 0  # windows before this one are out of the history (their tables let go)
        self.unusable: str | None = None  # why this directory is read whole instead (then build() is None)

    def build(self) -> DetectionInput | None:
        tails = [t for t in self.tail.poll().values() if t.header is not None or t.error is not None]
        if self.unusable is None:
            self.unusable = _unusable(tails)
            if self.unusable is not None:
                self.tail.drop_events()  # the directory is read whole from now on: no second copy
        if self.unusable is not None or not tails:
            return None
        counts = [len(t.windows) for t in tails]
        common, newest = min(counts), max(counts)
        if common > self.done:
            # One part per window: a history lets go of whole parts (and windows are matched and
            # aligned on their own anyway).
            self.committed.extend(_part(tails, window, window + 1) for window in range(self.done, common))
            for t in tails:
                t.release(common)
            self.done = common
        if self.history is not None:
            self._forget_before(_history_start(max(tails, key=lambda t: len(t.windows)).windows, self.history), tails)
        parts = list(self.committed)
        if newest > common:
            parts.append(_part(tails, common, newest))
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        # As a load of the whole directory does: should the aligned clocks leave the whole trace's
        # figures worse than the raw ones (medians do not add up over windows), every clock is raw.
        def figures(clocks: int) -> dict:  # 0: raw, 1: aligned
            spread, violated = (np.concatenate([p.measures[clocks][k] for p in parts]) for k in (0, 1))
            return summarize(spread, violated, exact=True)

        on_raw = bool(worse(figures(1), figures(0)))
        by_rank = {int(t.header["rank"]): t for t in sorted(tails, key=lambda t: int(t.header["rank"]))}
        windows = {rank: t.windows[self.forgotten:] for rank, t in by_rank.items()}
        data = concatenate([p.raw if on_raw else p.aligned for p in parts],
                           roles=roles_of({rank: t.header for rank, t in by_rank.items()}),
                           host=host_table(windows), gpu=gpu_summaries(windows),
                           warnings=missing_ranks(int(tails[0].header["world_size"]), by_rank))
        return data if on_raw else _with_compute_statistics(data, parts)

    def _forget_before(self, window: int, tails: list[RankTail]) -> None:
        """Let go of the committed windows before `window`: their tables and their metadata."""
        before = self.forgotten
        while self.committed and self.committed[0].windows[1] <= window:
            self.forgotten = self.committed.pop(0).windows[1]
        if self.forgotten > before:
            for t in tails:
                t.forget(self.forgotten)


def _history_start(windows: list[dict], history: int) -> int:
    """The newest window from which `windows` hold at least `history` traced iterations (0 when
    they hold fewer)."""
    held = 0
    for k in range(len(windows) - 1, -1, -1):
        first, last = windows[k]["iterations"]
        held += last - first + 1
        if held >= history:
            return k
    return 0


def _unusable(tails: list[RankTail]) -> str | None:
    for t in tails:
        if t.error is not None:
            return t.error
    runs = {t.header["run_id"] for t in tails}
    if len(runs) > 1:
        return f"files of {len(runs)} runs"
    if any(int(t.header.get("attempt", 0) or 0) for t in tails):
        return "a restarted attempt's files (torchrun restart)"
    ranks = [int(t.header["rank"]) for t in tails]
    if len(set(ranks)) < len(ranks):
        return "two files of one rank"
    return None


@dataclass(kw_only=True)
class _Part:
    """Some windows' tables on the aligned clocks and on the raw ones, and the alignment's
    measures of both (align_check.Judge.measures), for the whole-trace guard."""

    aligned: DetectionInput
    raw: DetectionInput
    measures: tuple
    windows: tuple[int, int]  # the windows it holds, first .. last-1
    # (the job's stages it was made for, compute_stats.window_part of `aligned`)
    compute: tuple = (None, None)


def _part(tails: list[RankTail], first: int, last: int) -> _Part | None:
    """Windows first .. last-1 of every rank that has them, loaded, matched, aligned, as tables."""
    from megatron.scan.aggregate import Aggregation
    from megatron.scan.align import align
    from megatron.scan.detect.model import from_aggregation
    from megatron.scan.load import merge
    from megatron.scan.match import match_collectives, match_p2p

    by_rank = {int(t.header["rank"]): t.part(first, last) for t in tails if len(t.windows) > first}
    if not by_rank:
        return None
    trace = merge(by_rank)
    trace.run_id = tails[0].header["run_id"]
    collectives, p2p = match_collectives(trace), match_p2p(trace)
    start, end = trace.columns["start"].copy(), trace.columns["end"].copy()
    alignment = align(trace, collectives, p2p, whole=False)
    aggregation = Aggregation(trace=trace, collectives=collectives, p2p=p2p, alignment=alignment)
    aligned = raw = from_aggregation(aggregation)
    if not (np.array_equal(start, trace.columns["start"]) and np.array_equal(end, trace.columns["end"])):
        trace.columns["start"], trace.columns["end"] = start, end
        raw = from_aggregation(aggregation)
    # The raw clocks' tables are rarely read (the whole-trace guard): their instances are resolved
    # by the analysis that needs them.
    return _Part(aligned=_resolved(aligned), raw=raw, measures=alignment.measures, windows=(first, last))


def _resolved(data: DetectionInput) -> DetectionInput:
    """`data` with its collective instances resolved (who arrived last, and by how much: what the
    arrival analyzer would find in them, as per-node summaries send it), and no collective rows:
    an instance lies in one window, so each window's are resolved once, not at every analysis
    (2.6 of an analysis's 7.7 s at 4,096 ranks x 20 iterations)."""
    c = data.collectives
    stats, late, instances = resolve_arrivals(c, one_stage_rows(data, c))
    return replace(data, collectives=table_rows(c, np.zeros(len(c["instance"]), dtype=bool)),
                   arrivals={"stats": stats, "late": late, "instances": instances})


def _with_compute_statistics(data: DetectionInput, parts: list[_Part]) -> DetectionInput:
    """`data` (the parts' aligned tables) with the compute analyzer's statistics, joined from
    each part's own, which a committed part keeps while the job's stages stay as they were made
    for: an analysis makes only the new window's (made from every window's rows, they took 3 of
    an analysis's 14 s at 4,096 ranks x 20 iterations). The same numbers as from the rows."""
    t = data.compute
    ranks = np.unique(t["rank"]).astype(np.int64)
    if not len(ranks) or not np.isin(ranks, list(data.roles)).all():
        return data  # ranks without a role: the analyzer works from the rows
    stages = compute_stats.plan_stages(data.roles, ranks, np.unique(data.layers["rank"]).astype(np.int64))
    made_for = [(stage, e["members"].tobytes(), e["layers"], e["reference"].tobytes()) for stage, e in stages.items()]
    for p in parts:
        if p.compute[0] != made_for:
            p.compute = (made_for, compute_stats.window_part(p.aligned, stages))
    plan, statistics = compute_stats.windows_statistics([p.compute[1] for p in parts], data, stages,
                                                        z_instance=compute_stats.Z_INSTANCE)
    return replace(data, compute_stats={"plan": plan, "statistics": statistics})


_ROWS = ("compute", "layers", "iteration_time")


def concatenate(parts: list[DetectionInput], *, roles: dict, host: dict, gpu: dict,
                warnings: list[str]) -> DetectionInput:
    """Parts of one job's input that hold different windows, as one: rows in rank order (as a
    load of the whole directory has them), collective instances numbered apart, group kinds
    mapped onto their union, instances resolved in their windows (`arrivals`) merged. `roles`,
    `host`, `gpu` and `warnings` are the whole job's."""
    kinds = sorted({kind for p in parts for kind in p.group_kinds})

    def ordered(tables: list[dict[str, np.ndarray]], by: str) -> dict[str, np.ndarray]:
        joined = {column: np.concatenate([t[column] for t in tables]) for column in tables[-1]}
        order = np.argsort(joined[by], kind="stable")
        return {column: values[order] for column, values in joined.items()}

    collectives, resolved = [], []
    offset = 0
    for p in parts:
        remap = np.array([kinds.index(k) for k in p.group_kinds] + [-1], dtype=np.int64)
        table = {**p.collectives, "kind": remap[p.collectives["kind"]], "instance": p.collectives["instance"] + offset}
        if len(table["instance"]):
            offset = int(table["instance"].max()) + 1
        collectives.append(table)
        if p.arrivals is not None:
            resolved.append({**p.arrivals, "late": {**p.arrivals["late"], "kind": remap[p.arrivals["late"]["kind"]]}})
    # Instances resolved in their windows: every (rank, iteration) of them lies in one window.
    arrivals = merge_resolved(resolved) if resolved else None
    return replace(parts[-1], roles=roles, group_kinds=kinds, collectives=ordered(collectives, "rank"),
                   arrivals=arrivals,
                   p2p=ordered([p.p2p for p in parts], "dst"), host=host, gpu=gpu, warnings=warnings,
                   **{name: ordered([getattr(p, name) for p in parts], "rank") for name in _ROWS})


def differences(a: DetectionInput, b: DetectionInput) -> list[str]:
    """The tables in which the window-by-window input `a` differs from a load of the whole
    directory `b` (rows compared as sets where their order may differ; resolved instances against
    resolving `b`'s rows): tests/scan/test_tail.py, benchmarks/incremental_equality.py."""
    bad = [f"{name}.{column}" for name in ("compute", "layers", "iteration_time", "host")
           for column in getattr(b, name)
           if not np.array_equal(getattr(a, name)[column], getattr(b, name)[column], equal_nan=True)]

    def rows(table, kinds=None) -> list:
        columns = [c for c in table if c not in ("instance", "kind")]
        named = [[kinds[k] if k >= 0 else None for k in table["kind"].tolist()]] if kinds is not None else []
        return sorted(zip(*named, *[table[c].tolist() for c in columns]))

    if rows(a.p2p) != rows(b.p2p):
        bad.append("p2p")
    if a.arrivals is None:
        if rows(a.collectives, a.group_kinds) != rows(b.collectives, b.group_kinds):
            bad.append("collectives")
    else:  # instances resolved window by window: what the whole load's rows resolve to
        stats, late, instances = resolve_arrivals(b.collectives, one_stage_rows(b, b.collectives))
        if len(a.collectives["instance"]) or instances != a.arrivals["instances"]:
            bad.append("collectives")
        bad.extend(f"arrivals.{c}" for c in stats if not np.array_equal(stats[c], a.arrivals["stats"][c]))
        if rows(late, b.group_kinds) != rows(a.arrivals["late"], a.group_kinds):
            bad.append("arrivals.late")
    if a.compute_stats is not None:  # against the statistics of the whole load's rows
        plan, statistics = compute_stats.compute_statistics(b, z_instance=compute_stats.Z_INSTANCE)
        mine = a.compute_stats["plan"]
        if (mine["noise"], mine["slow_bar"], list(mine["stages"])) != (plan["noise"], plan["slow_bar"], list(plan["stages"])):
            bad.append("compute_stats.plan")
        else:
            bad.extend(f"compute_stats.plan.{key}" for stage, entry in plan["stages"].items() for key in
                       ("members", "shared", "layers", "reference")
                       if not np.array_equal(entry[key], mine["stages"][stage][key]))
        bad.extend(f"compute_stats.{name}.{column}" for name, table in statistics.items() for column in table
                   if not np.array_equal(table[column], a.compute_stats["statistics"][name][column], equal_nan=True))
    if a.gpu != b.gpu:
        bad.append("gpu")
    if a.roles != b.roles:
        bad.append("roles")
    return bad
