"""Stage 2, collective arrival: in each synchronous collective instance everybody waits for the
last member to arrive, so its peers' long durations are waiting. Ranks are scored by how much
more often than chance, and by how much, they arrive last."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.model import DetectionInput


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
    flagged: bool = False

    @property
    def score(self) -> float:
        return self.last / self.instances if self.instances else 0.0


@dataclass(kw_only=True)
class ArrivalStage:
    findings: dict[int, ArrivalFinding]
    instances: int
    notes: list[str] = field(default_factory=list)


def arrival_order(data: DetectionInput, *, z_rank: float = 3.0, min_lateness_ms: float = 0.2) -> ArrivalStage:
    t = data.collectives
    if not len(t["instance"]):
        return ArrivalStage(findings={}, instances=0,
                            notes=["no complete synchronous collective with two or more members: arrival order "
                                   "cannot be compared"])
    order = np.lexsort((t["arrive"], t["instance"]))
    instance, rank, arrive = t["instance"][order], t["rank"][order], t["arrive"][order]
    kind, size = t["kind"][order], t["group_size"][order]
    last_row = np.flatnonzero(np.append(instance[1:] != instance[:-1], True))  # latest arrival of each instance
    second = last_row - 1  # sorted by arrival within an instance, sizes >= 2
    lateness = (arrive[last_row] - arrive[second]) / 1e6
    findings: dict[int, ArrivalFinding] = {}
    probability = 1.0 / size
    for r in data.world:
        mine = rank == r
        if not mine.any():
            continue
        was_last = rank[last_row] == r
        expected = float(probability[mine].sum())
        variance = float((probability[mine] * (1 - probability[mine])).sum())
        last = int(was_last.sum())
        z = (last - expected) / np.sqrt(max(variance, 1e-9))
        late = lateness[was_last]
        groups = Counter(data.group_kinds[k] for k in kind[last_row][was_last] if k >= 0)
        median = float(np.median(late)) if len(late) else 0.0
        findings[r] = ArrivalFinding(rank=r, instances=int(mine.sum()), last=last, expected_last=expected,
                                     z=float(z), waited_on_ms=float(late.sum()), median_lateness_ms=median,
                                     groups=dict(groups.most_common()),
                                     flagged=bool(z > z_rank and median > min_lateness_ms))
    return ArrivalStage(findings=findings, instances=len(last_row))
