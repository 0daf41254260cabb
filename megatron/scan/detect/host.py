"""Stage 4, host counters: a rank starved of its CPU (a cgroup quota, a noisy neighbour, a
time-shared host) spends its runnable time waiting for a CPU instead of running. Per traced
iteration the tracer records each rank's CPU time and run-queue wait, for the training thread and
for all threads; a rank whose training thread stretches its CPU time with waiting far more than
the other ranks' on the same host, iteration after iteration (or from an onset on), is starved.
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
    ratio: float  # median over iterations of its starvation level (starvation_level) over the other ranks' median
    wait_share: float  # run-queue wait / (wait + cpu time), over all its traced iterations
    training_thread: bool = False  # measured on the training thread (else on all threads)
    z: float
    flagged: bool
    onset_iteration: int | None = None  # starved from this iteration on (not before)


@dataclass(kw_only=True)
class HostStage:
    findings: dict[int, StarvationFinding]
    noise: float = float("nan")
    training_thread: bool = False  # the training thread's own counters were compared (else all threads')
    notes: list[str] = field(default_factory=list)


def host_starvation(data: DetectionInput, *, z_rank: float = 3.5, min_ratio: float = 2.0,
                    min_consistency: float = 0.7) -> HostStage:
    h = data.host
    if not len(h["rank"]):
        return HostStage(findings={}, notes=["no host counters in the trace (not Linux, or traces of an older "
                                             "version): CPU starvation cannot be measured"])
    level, training_thread = starvation_level(h)
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
            wait, cpu = (h["main_wait_ms"], h["main_cpu_ms"]) if training_thread else (h["cpu_wait_ms"], h["cpu_ms"])
            share = float(wait[mine].sum() / max(wait[mine].sum() + cpu[mine].sum(), 1e-9))
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
                                           onset_iteration=onset, training_thread=training_thread)
    return HostStage(findings=findings, noise=noise, training_thread=training_thread)


def starvation_level(h: dict[str, np.ndarray]) -> tuple[np.ndarray, bool]:
    """Per row, how starved the rank was in that iteration, and whether the training thread's own
    counters were used. The training thread's stretch, log((wait + cpu) / cpu): the factor by
    which waiting for a CPU lengthened the compute it ran (0 when never kept waiting). Without
    those counters (traces of an older version), all threads' log wait per CPU time: a gloo rank's
    dozens of communication threads wake briefly and often, which made that series about three
    times as noisy (log spread 0.8-0.9 against 0.26-0.31 over the same iterations of 4 ranks on 2
    cores), so an onset needed more iterations to stand out."""
    main_wait, main_cpu = h.get("main_wait_ms"), h.get("main_cpu_ms")
    if main_wait is not None and len(main_wait) and np.isfinite(main_wait).all() and np.isfinite(main_cpu).all():
        return np.log(main_wait + main_cpu + 1.0) - np.log(main_cpu + 1.0), True
    return np.log(h["cpu_wait_ms"] + 1.0) - np.log(h["cpu_ms"] + 1.0), False
