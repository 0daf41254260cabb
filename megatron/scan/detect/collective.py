"""Stage 2, collective arrival: in each synchronous collective instance everybody waits for the
last member to arrive, so its peers' long durations are waiting. Ranks are scored by how much
more often than chance, and by how much, they arrive last; the collectives of one iteration are
one sample (a rank late at a bucket is late at the next), and lateness that costs the job no
time is no fault."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.model import DetectionInput, unique_rows
from megatron.scan.detect.multiplicity import job_threshold
from megatron.scan.detect.typical import group_median

# The share of an iteration the other ranks must spend waiting for a rank (median over iterations)
# before its arriving last can name it: a rank of a loaded host that arrives last by a few ms at
# most collectives costs a 100 ms iteration 2-3% and nobody cares; a rank 1.2x slower than its
# peers costs a DDP iteration 10-15%. A healthy 4-rank DDP job launched on 2 cores (a public
# script) had rank 2 last at 34 of 81 bucket all-reduces, 20 by chance, and it was named.
MIN_COST_SHARE = 0.05


@dataclass(kw_only=True)
class ArrivalFinding:
    rank: int
    instances: int
    last: int
    expected_last: float  # by chance: sum over instances of 1 / group size
    z: float
    waited_on_ms: float  # total time the second-to-last member waited for this rank
    median_lateness_ms: float
    groups: dict[str, int] = field(default_factory=dict)  # group kind -> instances it was last to
    iterations: int = 0  # iterations its collectives fell in (the independent samples)
    cost_share: float = float("nan")  # median over iterations of its largest lateness / iteration time
    flagged: bool = False

    @property
    def score(self) -> float:
        return self.last / self.instances if self.instances else 0.0


@dataclass(kw_only=True)
class ArrivalStage:
    findings: dict[int, ArrivalFinding]
    instances: int
    notes: list[str] = field(default_factory=list)


# Per (rank, iteration) summary of the collectives a rank took part in (see resolve_arrivals).
STAT_COLUMNS = ("rank", "iteration", "instances", "sum_p", "sum_pq", "last", "max_late_ms")
LATE_COLUMNS = ("rank", "iteration", "lateness_ms", "kind")  # one row per instance a rank was last at


def one_stage_rows(data: DetectionInput, t: dict[str, np.ndarray]) -> np.ndarray:
    """Rows of collective instances whose members are all of one pipeline stage. In a group that
    spans stages (the embedding group of the first and last stage, a model-parallel group) who
    arrives last is set by the schedule (the first stage ends its backward last in 1F1B), not by
    anybody's speed. In every healthy PP=4 run of the default-settings benchmark, rank 0 was last
    at 20 of 20 embedding all-reduces."""
    if not len(t["instance"]):
        return np.zeros(0, dtype=bool)
    stages = {role.stage: i for i, role in enumerate(data.roles.values())}
    stage_of_rank = np.full(max(max(data.roles, default=0), int(t["rank"].max())) + 1, -1, dtype=np.int64)
    for r, role in data.roles.items():
        stage_of_rank[r] = stages[role.stage]
    stage = stage_of_rank[t["rank"].astype(np.int64)]
    instance_ids, inverse = unique_rows(np.asarray(t["instance"])[:, None])
    low = np.full(len(instance_ids), np.iinfo(np.int64).max)
    high = np.full(len(instance_ids), np.iinfo(np.int64).min)
    np.minimum.at(low, inverse, stage)
    np.maximum.at(high, inverse, stage)
    return (low == high)[inverse]


def resolve_arrivals(t: dict[str, np.ndarray], rows: np.ndarray | None = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """Who arrived last at each complete collective instance, and by how much (its arrival less
    the second-latest), summed per (rank, iteration): STAT_COLUMNS and LATE_COLUMNS tables and the
    number of instances. `rows`: which rows of `t` (every member of an instance, or none of it)."""
    order = np.flatnonzero(rows) if rows is not None else np.arange(len(t["instance"]))
    if not len(order):
        return ({c: np.zeros(0, dtype=np.float64 if c in ("sum_p", "sum_pq", "max_late_ms") else np.int64)
                 for c in STAT_COLUMNS},
                {c: np.zeros(0, dtype=np.float64 if c == "lateness_ms" else np.int64) for c in LATE_COLUMNS}, 0)
    # Rows grouped by instance (one sort of integers; no sort by arrival within an instance is
    # needed: the latest and second-latest arrivals are maxima).
    order = order[np.argsort(t["instance"][order], kind="stable")]
    instance, rank, arrive = t["instance"][order], t["rank"][order], t["arrive"][order]
    kind, size = t["kind"][order], t["group_size"][order]
    iteration = t["iteration"][order] if "iteration" in t else np.zeros(len(order), dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, instance[1:] != instance[:-1]])
    latest = np.maximum.reduceat(arrive, starts)
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(order)]))
    # the latest arrival's row (of equal arrivals, the one recorded last, as a stable sort by
    # arrival has it)
    tied = arrive == latest[group]
    chosen = np.maximum.reduceat(np.where(tied, order, -1), starts)
    last_row = np.flatnonzero(tied & (order == chosen[group]))
    others = arrive.copy()
    others[last_row] = np.iinfo(arrive.dtype).min if arrive.dtype.kind in "iu" else -np.inf
    lateness = (arrive[last_row] - np.maximum.reduceat(others, starts)) / 1e6  # sizes >= 2
    probability = 1.0 / size
    was_last = np.zeros(len(order), dtype=bool)
    was_last[last_row] = True
    cells, cell_of = unique_rows(np.column_stack([rank, iteration]))
    count = len(cells)
    max_late = np.zeros(count)
    np.maximum.at(max_late, cell_of[last_row], lateness)
    stats = {"rank": cells[:, 0].astype(np.int64), "iteration": cells[:, 1].astype(np.int64),
             "instances": np.bincount(cell_of, minlength=count).astype(np.int64),
             "sum_p": np.bincount(cell_of, weights=probability, minlength=count),
             "sum_pq": np.bincount(cell_of, weights=probability * (1 - probability), minlength=count),
             "last": np.bincount(cell_of, weights=was_last, minlength=count).astype(np.int64),
             "max_late_ms": max_late}
    late = {"rank": rank[last_row].astype(np.int64), "iteration": iteration[last_row].astype(np.int64),
            "lateness_ms": lateness, "kind": kind[last_row].astype(np.int64)}
    return stats, late, len(last_row)


def merge_stats(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """STAT_COLUMNS tables of disjoint instance sets, one row per (rank, iteration)."""
    rank = np.concatenate([p["rank"] for p in parts])
    iteration = np.concatenate([p["iteration"] for p in parts])
    cells, cell_of = unique_rows(np.column_stack([rank, iteration]))
    out = {"rank": cells[:, 0].astype(np.int64), "iteration": cells[:, 1].astype(np.int64)}
    for column in ("instances", "sum_p", "sum_pq", "last"):
        values = np.bincount(cell_of, weights=np.concatenate([p[column] for p in parts]), minlength=len(cells))
        out[column] = values.astype(np.int64) if column in ("instances", "last") else values
    out["max_late_ms"] = np.zeros(len(cells))
    np.maximum.at(out["max_late_ms"], cell_of, np.concatenate([p["max_late_ms"] for p in parts]))
    return out


def merge_resolved(parts: list[dict]) -> dict:
    """Resolved instances of disjoint sets (DetectionInput.arrivals: per-node summaries, windows
    resolved one by one) as one."""
    return {"stats": merge_stats([a["stats"] for a in parts]),
            "late": {c: np.concatenate([a["late"][c] for a in parts]) for c in LATE_COLUMNS},
            "instances": sum(int(a["instances"]) for a in parts)}


def arrival_order(data: DetectionInput, *, z_rank: float = 3.0, min_lateness_ms: float = 0.2,
                  min_cost_share: float = MIN_COST_SHARE) -> ArrivalStage:
    """Per rank: how often it arrived last against chance (1 / group size per instance), in
    standard errors that take the iteration as the unit: the variance is the larger of the
    binomial one and the between-iteration (cluster) one, because the collectives of one iteration
    are not independent draws (DDP's buckets follow the backward pass in order; one rank's slow
    backward makes it last at all of them). Flagged when `z_rank` clear (raised with the number of
    ranks judged, see multiplicity.job_threshold), its median lateness past `min_lateness_ms`, and
    its peers' wait for it a median `min_cost_share` of the iteration. Instances already resolved
    on the ranks' nodes (`data.arrivals`, from per-node summaries) count as the rows do."""
    t = data.collectives
    resolved = data.arrivals
    if not len(t["instance"]) and resolved is None:
        return ArrivalStage(findings={}, instances=0,
                            notes=["no complete synchronous collective with two or more members: arrival order "
                                   "cannot be compared"])
    one_stage = one_stage_rows(data, t)
    stats, late, instances = resolve_arrivals(t, one_stage)
    if resolved is not None:
        stats = merge_stats([stats, resolved["stats"]])
        late = {c: np.concatenate([late[c], resolved["late"][c]]) for c in LATE_COLUMNS}
        instances += int(resolved["instances"])
    if not instances:
        return ArrivalStage(findings={}, instances=0,
                            notes=["no collective among ranks of one pipeline stage: arrival order is set by the "
                                   "schedule, not compared"])
    duration = _iteration_duration_ms(data)
    z_rank = job_threshold(z_rank, len(data.world))
    # Every rank's sums at once (bincounts over its rows): at thousands of ranks a loop over ranks
    # of masks, or even of slices, cost seconds.
    present, row_of = np.unique(stats["rank"], return_inverse=True)
    row_of = row_of.reshape(-1)
    n = len(present)
    iterations = np.bincount(row_of, minlength=n)
    expected = np.bincount(row_of, weights=stats["sum_p"], minlength=n)
    binomial = np.bincount(row_of, weights=stats["sum_pq"], minlength=n)
    last = np.bincount(row_of, weights=stats["last"], minlength=n).astype(np.int64)
    count = np.bincount(row_of, weights=stats["instances"], minlength=n).astype(np.int64)
    # The spread of the per-iteration excess around its mean, scaled to the total: a rank late at
    # every bucket of a few iterations varies a lot between iterations, one late in all of them
    # does not. One iteration (or none recorded) has no such spread to measure.
    excess = stats["last"] - stats["sum_p"]
    centred = excess - (np.bincount(row_of, weights=excess, minlength=n) / iterations)[row_of]
    squares = np.bincount(row_of, weights=centred ** 2, minlength=n)
    between = np.where(iterations >= 2, squares * iterations / np.maximum(iterations - 1, 1), 0.0)
    z = (last - expected) / np.sqrt(np.maximum(np.maximum(binomial, between), 1e-9))
    late_of = np.searchsorted(present, late["rank"])
    waited_on = np.bincount(late_of, weights=late["lateness_ms"], minlength=n)
    median = np.zeros(n)
    has_late, medians = group_median(late["lateness_ms"], late_of)
    median[has_late] = medians
    # What the job lost to it in an iteration: its largest lateness there (a rank a constant 1 ms
    # behind is 1 ms late at each of ten buckets, and costs the iteration 1 ms, not 10).
    known = np.array(sorted(duration), dtype=np.int64)
    spans = np.array([duration[i] for i in known.tolist()], dtype=np.float64)
    at = np.clip(np.searchsorted(known, stats["iteration"]), 0, max(len(known) - 1, 0))
    timed = (known[at] == stats["iteration"]) & (spans[at] > 0) if len(known) else np.zeros(len(at), dtype=bool)
    share = np.full(len(at), np.nan)
    share[timed] = stats["max_late_ms"][timed] / spans[at[timed]]
    cost = np.full(n, np.nan)
    has_cost, costs = group_median(share, row_of)
    cost[has_cost] = costs
    # The group kinds it was last at, most often first (ties by name: the same whatever the
    # rows' order, which differs between a whole load and the windows resolved one by one).
    kinds = len(data.group_kinds)
    named = late["kind"] >= 0
    times_last = np.bincount(late_of[named] * kinds + late["kind"][named], minlength=n * kinds).reshape(n, kinds)
    findings: dict[int, ArrivalFinding] = {}
    for r in data.world:
        j = int(np.searchsorted(present, r))
        if j == n or present[j] != r:
            continue
        groups = {data.group_kinds[k]: count for k, count in enumerate(times_last[j].tolist()) if count}
        findings[r] = ArrivalFinding(rank=r, instances=int(count[j]), last=int(last[j]),
                                     expected_last=float(expected[j]), z=float(z[j]),
                                     waited_on_ms=float(waited_on[j]), median_lateness_ms=float(median[j]),
                                     groups=dict(sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))),
                                     iterations=int(iterations[j]),
                                     cost_share=float(cost[j]),
                                     flagged=bool(z[j] > z_rank and median[j] > min_lateness_ms
                                                  and not cost[j] < min_cost_share))
    return ArrivalStage(findings=findings, instances=instances)


def _iteration_duration_ms(data: DetectionInput) -> dict[int, float]:
    """Per iteration, the median over ranks of its traced iteration span (ms)."""
    t = data.iteration_time
    if not len(t["rank"]):
        return {}
    span = (t["end"] - t["start"]).astype(np.float64) / 1e6
    return {int(i): float(np.median(span[t["iteration"] == i])) for i in np.unique(t["iteration"])}
