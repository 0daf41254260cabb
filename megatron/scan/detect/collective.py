"""Stage 2, collective arrival: in each synchronous collective instance everybody waits for the
last member to arrive, so its peers' long durations are waiting. Ranks are scored by how much
more often than chance, and by how much, they arrive last; the collectives of one iteration are
one sample (a rank late at a bucket is late at the next), and lateness that costs the job no
time is no fault."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.model import DetectionInput

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


def arrival_order(data: DetectionInput, *, z_rank: float = 3.0, min_lateness_ms: float = 0.2,
                  min_cost_share: float = MIN_COST_SHARE) -> ArrivalStage:
    """Per rank: how often it arrived last against chance (1 / group size per instance), in
    standard errors that take the iteration as the unit: the variance is the larger of the
    binomial one and the between-iteration (cluster) one, because the collectives of one iteration
    are not independent draws (DDP's buckets follow the backward pass in order; one rank's slow
    backward makes it last at all of them). Flagged when `z_rank` clear, its median lateness past
    `min_lateness_ms`, and its peers' wait for it a median `min_cost_share` of the iteration."""
    t = data.collectives
    if not len(t["instance"]):
        return ArrivalStage(findings={}, instances=0,
                            notes=["no complete synchronous collective with two or more members: arrival order "
                                   "cannot be compared"])
    # Only collectives among ranks of one pipeline stage: in a group that spans stages (the
    # embedding group of the first and last stage, a model-parallel group) who arrives last is set
    # by the schedule (the first stage ends its backward last in 1F1B), not by anybody's speed.
    # In every healthy PP=4 run of the default-settings benchmark, rank 0 was last at 20 of 20
    # embedding all-reduces.
    stages = {role.stage: i for i, role in enumerate(data.roles.values())}
    stage = np.array([stages[data.roles[int(r)].stage] if int(r) in data.roles else -1 for r in t["rank"]],
                     dtype=np.int64)
    instance_ids, inverse = np.unique(t["instance"], return_inverse=True)
    low = np.full(len(instance_ids), np.iinfo(np.int64).max)
    high = np.full(len(instance_ids), np.iinfo(np.int64).min)
    np.minimum.at(low, inverse, stage)
    np.maximum.at(high, inverse, stage)
    one_stage = (low == high)[inverse]
    if not one_stage.any():
        return ArrivalStage(findings={}, instances=0,
                            notes=["no collective among ranks of one pipeline stage: arrival order is set by the "
                                   "schedule, not compared"])
    order = np.flatnonzero(one_stage)[np.lexsort((t["arrive"][one_stage], t["instance"][one_stage]))]
    instance, rank, arrive = t["instance"][order], t["rank"][order], t["arrive"][order]
    kind, size = t["kind"][order], t["group_size"][order]
    iteration = t["iteration"][order] if "iteration" in t else np.zeros(len(order), dtype=np.int64)
    last_row = np.flatnonzero(np.append(instance[1:] != instance[:-1], True))  # latest arrival of each instance
    second = last_row - 1  # sorted by arrival within an instance, sizes >= 2
    lateness = (arrive[last_row] - arrive[second]) / 1e6
    members = np.diff(np.concatenate([[0], last_row + 1]))  # rows of each instance
    last_rank = np.repeat(rank[last_row], members)  # per row: the rank that arrived last in its instance
    row_lateness = np.repeat(lateness, members)
    duration = _iteration_duration_ms(data)
    findings: dict[int, ArrivalFinding] = {}
    probability = 1.0 / size
    for r in data.world:
        mine = rank == r
        if not mine.any():
            continue
        was_last = mine & (last_rank == r)
        expected = float(probability[mine].sum())
        binomial = float((probability[mine] * (1 - probability[mine])).sum())
        last = int(was_last.sum())
        its, cluster = np.unique(iteration[mine], return_inverse=True)
        excess = np.bincount(cluster, weights=was_last[mine] - probability[mine], minlength=len(its))
        # The spread of the per-iteration excess around its mean, scaled to the total: a rank late
        # at every bucket of a few iterations varies a lot between iterations, one late in all of
        # them does not. One iteration (or none recorded) has no such spread to measure.
        between = (float(np.sum((excess - excess.mean()) ** 2)) * len(its) / (len(its) - 1)
                   if len(its) >= 2 else 0.0)
        z = (last - expected) / np.sqrt(max(binomial, between, 1e-9))
        late = row_lateness[was_last]
        # What the job lost to it in an iteration: its largest lateness there (a rank a constant
        # 1 ms behind is 1 ms late at each of ten buckets, and costs the iteration 1 ms, not 10).
        waited = np.zeros(len(its))
        np.maximum.at(waited, cluster, np.where(was_last[mine], row_lateness[mine], 0.0))
        shares = [w / duration[i] for i, w in zip(its.tolist(), waited) if duration.get(i, 0.0) > 0]
        cost = float(np.median(shares)) if shares else float("nan")
        groups = Counter(data.group_kinds[k] for k in kind[was_last] if k >= 0)
        median = float(np.median(late)) if len(late) else 0.0
        findings[r] = ArrivalFinding(rank=r, instances=int(mine.sum()), last=last, expected_last=expected,
                                     z=float(z), waited_on_ms=float(late.sum()), median_lateness_ms=median,
                                     groups=dict(groups.most_common()), iterations=len(its), cost_share=cost,
                                     flagged=bool(z > z_rank and median > min_lateness_ms
                                                  and not cost < min_cost_share))
    return ArrivalStage(findings=findings, instances=len(last_row))


def _iteration_duration_ms(data: DetectionInput) -> dict[int, float]:
    """Per iteration, the median over ranks of its traced iteration span (ms)."""
    t = data.iteration_time
    if not len(t["rank"]):
        return {}
    span = (t["end"] - t["start"]).astype(np.float64) / 1e6
    return {int(i): float(np.median(span[t["iteration"] == i])) for i in np.unique(t["iteration"])}
