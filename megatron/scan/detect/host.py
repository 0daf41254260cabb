"""Stage 4, host counters: a rank starved of its CPU (a cgroup quota, a noisy neighbour, a
time-shared host) spends its runnable time waiting for a CPU instead of running. Per traced
iteration the tracer records each rank's CPU time and run-queue wait; a rank whose wait per CPU
second is far above the other ranks' on the same host, iteration after iteration, is starved.
Ranks waiting for their peers sleep and accrue no run-queue wait, so victims stay clean."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.compute import series_noise, significant_onset
from megatron.scan.detect.model import DetectionInput

_MAD = 1.4826


@dataclass(kw_only=True)
class StarvationFinding:
    rank: int
    iterations: int
    starved_iterations: int  # iterations with more wait per CPU second than the host's other ranks
    ratio: float  # median over iterations of (wait / cpu) / the other ranks' median
    wait_share: float  # run-queue wait / (wait + cpu time), over all its traced iterations
    z: float
    flagged: bool
    onset_iteration: int | None = None  # starved from this iteration on (not before)


@dataclass(kw_only=True)
class HostStage:
    findings: dict[int, StarvationFinding]
    noise: float = float("nan")
    notes: list[str] = field(default_factory=list)


def host_starvation(data: DetectionInput, *, z_rank: float = 3.5, min_ratio: float = 2.0,
                    min_consistency: float = 0.7) -> HostStage:
    h = data.host
    if not len(h["rank"]):
        return HostStage(findings={}, notes=["no host counters in the trace (not Linux, or traces of an older "
                                             "version): CPU starvation cannot be measured"])
    level = np.log(h["cpu_wait_ms"] + 1.0) - np.log(h["cpu_ms"] + 1.0)  # log wait per CPU time
    by_host: dict[str, list[int]] = {}
    for rank in np.unique(h["rank"]).astype(int):
        by_host.setdefault(data.roles[rank].host if rank in data.roles else "", []).append(rank)
    ratios: dict[int, tuple[np.ndarray, float]] = {}
    for ranks in by_host.values():
        if len(ranks) < 2:
            continue
        iterations = np.unique(h["iteration"][np.isin(h["rank"], ranks)])
        matrix = np.full((len(iterations), len(ranks)), np.nan)  # [iteration, rank]
        for j, rank in enumerate(ranks):
            mine = h["rank"] == rank
            matrix[np.searchsorted(iterations, h["iteration"][mine]), j] = level[mine]
        for j, rank in enumerate(ranks):
            others = np.delete(matrix, j, axis=1)
            valid = ~np.isnan(matrix[:, j]) & (np.sum(~np.isnan(others), axis=1) > 0)
            if valid.sum() < 2:  # online detection looks at windows of two iterations
                continue
            mine = h["rank"] == rank
            share = float(h["cpu_wait_ms"][mine].sum() / max(h["cpu_wait_ms"][mine].sum() + h["cpu_ms"][mine].sum(), 1e-9))
            ratios[rank] = (matrix[valid, j] - np.nanmedian(others[valid], axis=1), share, iterations[valid])
    if not ratios:
        return HostStage(findings={}, notes=["host counters: no two ranks on one host to compare"])
    noise = series_noise([r for r, *_ in ratios.values()], default=0.3, floor=0.05)
    findings = {}
    for rank, (ratio, share, iterations) in ratios.items():
        median = float(np.median(ratio))
        z = median / (1.2533 * noise / np.sqrt(len(ratio)))
        starved = int(np.sum(ratio > 0))
        flagged = bool(z > z_rank and np.exp(median) >= min_ratio and starved >= min_consistency * len(ratio))
        onset = None
        if not flagged:  # starved from mid-run on (or, online, in the last windows)
            change = significant_onset(ratio, noise, z_rank, min_ratio)
            if change is not None:
                flagged, median, z, onset = True, change[0], change[1], int(iterations[change[2]])
                ratio = ratio[change[2]:]
                starved = len(ratio)
        findings[rank] = StarvationFinding(rank=rank, iterations=len(ratio), starved_iterations=starved,
                                           ratio=float(np.exp(median)), wait_share=share, z=float(z), flagged=flagged,
                                           onset_iteration=onset)
    return HostStage(findings=findings, noise=noise)
