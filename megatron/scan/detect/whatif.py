"""What-if: the iteration time the job would have if a suspect were healthy, by replaying each
data-parallel replica's pipeline on measured task costs (suspect at its peers' speed) through the
schedule simulator; TP peers move at their slowest member's pace and DP replicas wait for the slowest."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron.app.schedule import PipelineLayout, Task
from megatron.app.simulator import simulate_schedule
from megatron.scan.detect.combine import Detection
from megatron.scan.detect.compute_stats import busy_medians
from megatron.scan.detect.suspect import Suspect


@dataclass
class _MeasuredCosts:
    """TaskCosts protocol: per (stage, kind) the cost of one task, in ms."""

    forward: dict[int, float]
    backward: dict[int, float]
    transfer: dict[tuple[int, int], float]

    def compute_time(self, rank: int, task: Task) -> float:
        return (self.forward if task.is_forward else self.backward).get(rank, 0.0)

    def transfer_time(self, src_rank: int, dst_rank: int, task: Task) -> float:
        return self.transfer.get((src_rank, dst_rank), 0.0)


def _busy_table(detection: Detection) -> dict[tuple[int, int], float]:
    """(rank, kind) -> median busy ms of one task."""
    return {key: ns / 1e6 for key, ns in busy_medians(detection.data).items()}


def _makespan(detection: Detection, busy: dict[tuple[int, int], float], delays: dict[tuple[int, int], float]) -> float:
    data = detection.data
    pp, dp = data.sizes.get("pp", 1), data.sizes.get("dp", 1)
    t = data.compute
    microbatches = int(t["microbatch"].max()) + 1 if len(t["microbatch"]) else 1
    chunks = int(t["chunk"].max()) + 1 if len(t["chunk"]) else 1
    layout = PipelineLayout(pp_size=pp, num_chunks=chunks, num_microbatches=microbatches)
    by_replica_stage: dict[tuple[int, int], list[int]] = {}
    for rank, role in data.roles.items():
        by_replica_stage.setdefault((role.dp, role.pp), []).append(rank)
    spans = []
    for d in range(dp):
        forward, backward, transfer = {}, {}, {}
        for p in range(pp):
            members = by_replica_stage.get((d, p), [])
            # A TP group finishes a task when its slowest member does.
            forward[p] = max((busy.get((r, 0), 0.0) for r in members), default=0.0)
            backward[p] = max((busy.get((r, 1), 0.0) for r in members), default=0.0)
        for (src, dst), ms in delays.items():
            a, b = data.roles.get(src), data.roles.get(dst)
            if a is not None and b is not None and a.dp == d:
                transfer[(a.pp, b.pp)] = max(transfer.get((a.pp, b.pp), 0.0), ms)
        costs = _MeasuredCosts(forward=forward, backward=backward, transfer=transfer)
        name = "interleaved" if chunks > 1 else "1f1b"
        try:
            spans.append(simulate_schedule(name, layout, costs).makespan)
        except Exception:  # noqa: BLE001 - an unsupported layout gives no estimate, not a failed detection
            return float("nan")
    return max(spans) if spans else float("nan")


def estimate(detection: Detection, suspect: Suspect, busy: dict[tuple[int, int], float]) -> dict[str, float] | None:
    data = detection.data
    it = data.iteration_time
    if not len(it["rank"]):
        return None
    per_iteration = {}
    for i in np.unique(it["iteration"]):
        mine = it["iteration"] == i
        per_iteration[int(i)] = float((it["end"][mine].max() - it["start"][mine].min()) / 1e6)
    measured = float(np.median(list(per_iteration.values())))
    link_delays = {}
    for link in detection.pipeline.links.values():
        link_delays[(link.src, link.dst)] = link.delivery_ms
    baseline = _makespan(detection, busy, link_delays)
    healthy_busy = dict(busy)
    healthy_delays = dict(link_delays)
    if suspect.kind in ("rank", "node"):
        for rank in suspect.ranks:
            finding = detection.compute.findings.get(rank)
            factor = finding.slowdown if finding is not None and finding.slowdown > 1 else 1.0
            for kind in (0, 1):
                if (rank, kind) in busy:
                    healthy_busy[(rank, kind)] = busy[(rank, kind)] / factor
    else:
        link = detection.pipeline.links[(suspect.ranks[0], suspect.ranks[1])]
        healthy_delays[(link.src, link.dst)] = link.baseline_ms
    healthy = _makespan(detection, healthy_busy, healthy_delays)
    if not (baseline == baseline and healthy == healthy) or baseline <= 0:
        return None
    saved = max(baseline - healthy, 0.0)
    return {"measured_ms": round(measured, 3), "healthy_ms": round(max(measured - saved, 0.0), 3),
            "cost_percent": round(100.0 * saved / measured, 2) if measured > 0 else 0.0,
            "pipeline_ms": round(baseline, 3), "pipeline_healthy_ms": round(healthy, 3)}


def estimate_all(detection: Detection, progress=None) -> None:
    """`progress`: a megatron.app.progress.Reporter counting the suspects estimated (default: silent)."""
    busy = _busy_table(detection)
    suspects = detection.suspects if progress is None else progress.iterate("what-if estimates", detection.suspects)
    for suspect in suspects:
        suspect.what_if = estimate(detection, suspect, busy)
