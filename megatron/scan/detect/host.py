"""Stage 4, host counters: a rank starved of its CPU (a cgroup quota, a noisy neighbour, a
time-shared host) spends its runnable time waiting for a CPU instead of running. Per traced
iteration the tracer records each rank's CPU time and run-queue wait, for the training thread and
for all threads; a rank that waits for a CPU far more than the other ranks on the same host,
iteration after iteration (or from an onset on), is starved. Ranks waiting for their peers sleep
and accrue no run-queue wait, so victims stay clean.

Two views of the same starvation are judged, each against its own floor, and either names the
rank: the training thread's stretch of its compute (the steadier where a few ranks share cores
between pipeline bubbles) and all threads' wait per CPU second (the stronger where a rank's
communication threads carry its collectives, as in tensor parallelism)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.spread import series_noise
from megatron.scan.detect.onset import significant_onset
from megatron.scan.detect.model import DetectionInput
from megatron.scan.speed import log_ratio_to_peers

# The stretch (wait + cpu) / cpu compresses ratios that wait per CPU second shows in full: a rank
# waiting 3 ms per CPU ms beside peers waiting 0.45 is 6.7x on the latter, 2.8x as a stretch. On
# 4 ranks over 2 cores (10-14 iterations) a quarter-core quota stretched its rank 1.9-2.6x its
# peers' (7 runs of TP=2 x PP=2 and PP=4); healthy ranks reached at most 1.31x.
MIN_STRETCH_RATIO = 1.6
# All threads' wait per CPU second, over the other ranks': in 17 runs of the default-settings
# benchmark (4 ranks on 2 cores, 20 iterations, 2026-11-27) healthy ranks of PP=2 x DP=2 and PP=4
# runs reached 2.21-2.46x (their pipeline stages keep different threads busy) and were named by it
# alone in 4 of 34 healthy-or-injected runs, while every rank under a 0.3-core quota that only
# this measure could name stood 2.99-7.9x. The floor sits between: 2.7x.
MIN_WAIT_RATIO = 2.7
# Ratios of near-nothing: on a host with a core to spare for every thread (16 cores, 4 ranks) the
# ranks wait for a CPU a few ms per iteration, and one rank waiting 2 ms beside peers' 0.3 ms is
# 6x on the all-thread measure. Starved also means the rank's threads spent a material share of
# their runnable time waiting (over the iterations judged): a quota-starved rank's all-thread share
# was 0.94-0.96 on 2 cores, healthy ranks' there 0.7-0.87 (hence the ratio floors), and on an idle
# host healthy shares are near 0. The stretch floor already implies a training-thread share of
# 1 - 1 / 1.6 against unstarved peers; its share floor only guards the smoothing of tiny times.
MIN_WAIT_SHARE = {True: 0.25, False: 0.5}  # training thread, all threads


@dataclass(kw_only=True)
class StarvationFinding:
    rank: int
    iterations: int
    starved_iterations: int  # iterations in which it was more starved than the host's other ranks
    ratio: float  # median over iterations of its starvation level over the other ranks' median
    wait_share: float  # run-queue wait / (wait + cpu time) over the iterations judged, of the measure's threads
    training_thread: bool = False  # judged on the training thread's stretch (else all threads' wait per CPU second)
    z: float
    flagged: bool
    onset_iteration: int | None = None  # starved from this iteration on (not before)


@dataclass(kw_only=True)
class HostStage:
    findings: dict[int, StarvationFinding]
    noise: float = float("nan")  # of the first measure judged (the training thread's, when recorded)
    training_thread: bool = False  # the training thread's own counters were recorded and judged
    notes: list[str] = field(default_factory=list)


def host_starvation(data: DetectionInput, *, z_rank: float = 3.5, min_stretch: float = MIN_STRETCH_RATIO,
                    min_wait: float = MIN_WAIT_RATIO, min_consistency: float = 0.7, recent: int = 0) -> HostStage:
    """Each measure of starvation_levels judged on its own (min_stretch for the training thread's
    stretch, min_wait for all threads' wait per CPU second: how many times the other ranks' level
    a rank's must be); a rank is starved when either measure says so. With `recent` (online
    detection), it must also still be: its median level over the last `recent` iterations above
    the host's other ranks'."""
    h = data.host
    if not len(h["rank"]):
        return HostStage(findings={}, notes=["no host counters in the trace (not Linux, or traces of an older "
                                             "version): CPU starvation cannot be measured"])
    by_host: dict[str, list[int]] = {}
    for rank in np.unique(h["rank"]).astype(int):
        by_host.setdefault(data.roles[rank].host if rank in data.roles else "", []).append(rank)
    measures = starvation_levels(h)
    findings: dict[int, StarvationFinding] = {}
    noises = []  # per measure; the stage reports the first's
    for level, training_thread in measures:
        ratios = _against_host_peers(h, level, training_thread, by_host)
        if not ratios:
            return HostStage(findings={}, notes=["host counters: no two ranks on one host to compare"])
        noise = series_noise([r for r, *_ in ratios.values()], default=0.3, floor=0.05)
        noises.append(noise)
        for rank, (ratio, times, iterations) in ratios.items():
            finding = _judge(rank, ratio, times, iterations, noise, z_rank=z_rank,
                             min_ratio=min_stretch if training_thread else min_wait,
                             min_consistency=min_consistency, training_thread=training_thread, recent=recent)
            if rank not in findings or (finding.flagged and not findings[rank].flagged):
                findings[rank] = finding
    return HostStage(findings=findings, noise=noises[0], training_thread=measures[0][1])


def _against_host_peers(h: dict[str, np.ndarray], level: np.ndarray, training_thread: bool,
                        by_host: dict[str, list[int]]) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per rank with a peer on its host: its level less the median of the other ranks' at each
    iteration (a log ratio), its measure's (wait, cpu) per iteration, and the iterations compared."""
    wait, cpu = (h["main_wait_ms"], h["main_cpu_ms"]) if training_thread else (h["cpu_wait_ms"], h["cpu_ms"])
    ratios = {}
    for ranks in by_host.values():
        if len(ranks) < 2:
            continue
        iterations = np.unique(h["iteration"][np.isin(h["rank"], ranks)])
        matrix = np.full((len(iterations), len(ranks)), np.nan)  # [iteration, rank]
        for j, rank in enumerate(ranks):
            mine = h["rank"] == rank
            matrix[np.searchsorted(iterations, h["iteration"][mine]), j] = level[mine]
        against = log_ratio_to_peers(matrix)  # nan: nothing to compare
        for j, rank in enumerate(ranks):
            valid = ~np.isnan(against[:, j])
            if valid.sum() < 2:  # online detection looks at windows of two iterations
                continue
            mine = h["rank"] == rank
            times = np.zeros((len(iterations), 2))
            times[np.searchsorted(iterations, h["iteration"][mine])] = np.column_stack([wait[mine], cpu[mine]])
            ratios[rank] = (against[valid, j], times[valid], iterations[valid])
    return ratios


def _judge(rank: int, ratio: np.ndarray, times: np.ndarray, iterations: np.ndarray, noise: float, *, z_rank: float,
           min_ratio: float, min_consistency: float, training_thread: bool, recent: int = 0) -> StarvationFinding:
    """Starved over the whole series (z, ratio, and more starved than the others in
    min_consistency of the iterations), or else from an onset on (or, online, in the last windows);
    either way waiting at least MIN_WAIT_SHARE of its runnable time in the iterations judged, and
    with `recent`, still more starved than the others over the last `recent` iterations (median)."""
    def share(since: int = 0) -> float:
        wait, cpu = times[since:].sum(axis=0)
        return float(wait / max(wait + cpu, 1e-9))

    min_share = MIN_WAIT_SHARE[training_thread]
    # Starved earlier but no longer: online alerts are about the present. Two ranks on 2 cores,
    # rank 0 waited 3-14x as long as its peer in iterations 0-4 (a process starting beside it) and
    # 0.01x once the peer was throttled; over iterations 0-6 the whole-series test still named it.
    still = not recent or float(np.median(ratio[-recent:])) > 0
    median = float(np.median(ratio))
    z = median / (1.2533 * noise / np.sqrt(len(ratio)))
    starved = int(np.sum(ratio > 0))
    flagged = bool(z > z_rank and np.exp(median) >= min_ratio and starved >= min_consistency * len(ratio)
                   and share() >= min_share)
    onset, since = None, 0
    if not flagged:
        # Starved from an onset on means starved from then on: min_ratio times the other ranks'
        # level, not a step of min_ratio from the rank's own earlier standing. A healthy rank of a
        # real PP=2 x DP=2 run, less starved than the others for 8 iterations (0.7x), then 1.6x
        # them for 3, stepped up 2.3x and was named on the step alone.
        change = significant_onset(ratio, noise, z_rank, min_ratio, min_level=min_ratio)
        if change is not None and share(change[2]) >= min_share:
            flagged, median, z, onset, since = True, change[0], change[1], int(iterations[change[2]]), change[2]
            ratio = ratio[since:]
            starved = len(ratio)
    return StarvationFinding(rank=rank, iterations=len(ratio), starved_iterations=starved, ratio=float(np.exp(median)),
                             wait_share=share(since), z=float(z), flagged=flagged and still, onset_iteration=onset,
                             training_thread=training_thread)


def starvation_levels(h: dict[str, np.ndarray]) -> list[tuple[np.ndarray, bool]]:
    """Per row, how starved the rank was in that iteration, by each measure the trace allows, with
    whether it is the training thread's. The training thread's stretch, log((wait + cpu) / cpu):
    the factor by which waiting for a CPU lengthened the compute it ran (0 when never kept
    waiting). A gloo rank's dozens of communication threads wake briefly and often: in a PP=2 x
    DP=2 run under a 0.15-core quota the stretch was about three times less noisy than the
    all-thread series (log spread 0.26-0.31 against 0.8-0.9) and named the rank two iterations
    sooner. All threads' log wait per CPU time: in TP=2 layouts under a 0.3-core quota it stood
    about twice as far above its noise as the stretch (the communication threads, busy with the
    collectives, wait too). Traces of older versions have only the latter."""
    all_threads = np.log(h["cpu_wait_ms"] + 1.0) - np.log(h["cpu_ms"] + 1.0)
    main_wait, main_cpu = h.get("main_wait_ms"), h.get("main_cpu_ms")
    if main_wait is not None and len(main_wait) and np.isfinite(main_wait).all() and np.isfinite(main_cpu).all():
        return [(np.log(main_wait + main_cpu + 1.0) - np.log(main_cpu + 1.0), True), (all_threads, False)]
    return [(all_threads, False)]
