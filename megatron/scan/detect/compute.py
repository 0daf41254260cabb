"""Stage 1, peer comparison of compute: ranks of one pipeline stage run the same kernels on the
same shapes, so per iteration each rank's busy time is compared with its peers' (robust
statistics on log time); ranks without peers are compared with their own earlier iterations."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from megatron.scan.detect.compute_stats import Z_INSTANCE, compute_statistics
from megatron.scan.detect.model import DetectionInput, table_rows
from megatron.scan.detect.multiplicity import (
    COMPUTE_MEASURES,
    FLOOR_MAX,
    JOB_FALSE_ALARM,
    MedianNull,
    chance_of_late_run,
    compute_floor,
    job_threshold,
)
from megatron.scan.detect.onset import (
    MIN_OWN_SHARE,
    ONSET_PENALTY,
    host_shift,
    onset_shifts,
    own_share_of_onset,
    significant_onset,
)
from megatron.scan.detect.reference import reference_ranks
from megatron.scan.detect.spread import BETWEEN_MIN_RANKS, BaselineErrors, between_rank_spread, series_noise
from megatron.scan.detect.typical import row_medians, typical_ratios
from megatron.scan.speed import log_ratio_to_peers

_MAD = 1.4826  # MAD -> standard deviation for normal noise
# Standard errors a rank's median per-iteration ratio to its peers must stand above zero to be named.
Z_RANK = 3.5
# Iterations an onset needs after it: two tail iterations ending a window (9.1x and 3.5x) read as a
# fault that began in a healthy 64-rank synthetic job, and no test of two values tells them apart
# where tails are heavy. Online detection, analyzing again as iterations come, names a fault that
# began in the last two once it has run a third.
MIN_RUN = 3


@dataclass(kw_only=True)
class ComputeFinding:
    rank: int
    method: str  # "peers" (same stage) | "layers" (same TP index, per layer) | "history"
    peers: list[int]
    instances: int
    slow_instances: int  # task instances individually past the noise
    iterations: int
    slower_iterations: int  # iterations whose busy total is above the peers' (or the baseline)
    slowdown: float  # median over iterations of busy total / peers' (or / own baseline)
    task_slowdown: float  # median over task instances of busy / peers' busy
    z: float  # median log ratio in standard errors
    flagged: bool
    # Among many ranks: the chance, in the job, of a healthy rank's busy-total median this high
    # (multiplicity.MedianNull), which then judges the total; nan where the normal bar did.
    chance: float = float("nan")
    onset_iteration: int | None = None
    worst_ops: list[dict] = field(default_factory=list)
    # What named it: "total" (the busy total per iteration, which bursts move) or "typical" (the
    # median call per iteration, which a steadily slower device moves and host noise hardly does).
    measure: str = "total"
    # The typical call's test, whatever named it (nan where there was no such series).
    typical_slowdown: float = float("nan")  # median over iterations of its median call / peers'
    typical_z: float = float("nan")
    typical_slower_iterations: int = 0
    # The per-iteration log ratios judged, their iterations and noise (not reported; see since).
    series: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, metadata={"internal": True})
    series_iterations: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False,
                                          metadata={"internal": True})
    series_noise: float = field(default=float("nan"), repr=False, metadata={"internal": True})

    @property
    def score(self) -> float:
        return self.slow_instances / self.instances if self.instances else 0.0

    def since(self, iteration: int) -> tuple[float, float] | None:
        """(slowdown, z) over the iterations from `iteration` on: the median per-iteration ratio to
        its peers and that median log ratio in standard errors. None with no such iteration."""
        later = self.series[self.series_iterations >= iteration]
        if not len(later) or not self.series_noise > 0:
            return None
        median = float(np.median(later))
        return float(np.exp(median)), median / (1.2533 * self.series_noise / np.sqrt(len(later)))


@dataclass(kw_only=True)
class ComputeStage:
    findings: dict[int, ComputeFinding]
    noise: float  # robust std of one instance's log busy time
    iteration_noise: float = float("nan")  # robust std of one per-iteration log ratio
    typical_noise: float = float("nan")  # the same for the typical call's series
    layer_typical: bool = False  # whether the typical call is a transformer layer's (else a task's)
    cannot_compare: list[int]  # ranks with neither peers nor enough history
    notes: list[str] = field(default_factory=list)


def peer_comparison(data: DetectionInput, *, z_instance: float = Z_INSTANCE, z_rank: float = Z_RANK,
                    min_slowdown: float | None = None, min_consistency: float = 0.7) -> ComputeStage:
    """Ranks of one stage compared per iteration: each rank's total busy time in an iteration
    against the median of its peers' totals in the same iteration. Totals, not per-task medians,
    because real slowness is often bursty (a throttled or time-shared device stalls some tasks for
    long and leaves others alone): the median task barely moves while the iteration does. A rank
    is flagged when its median per-iteration ratio is `z_rank` standard errors above zero, at
    least `min_slowdown`, and above zero in `min_consistency` of its iterations (one burst of host
    contention is not a slow rank). Per-task ratios past `z_instance` noise widths are counted and
    the slowest listed as evidence. The floor keeps steady few-percent differences of healthy
    hardware, which many iterations make 'significant', from becoming alarms; by default it
    follows the measured noise (multiplicity.compute_floor), and `z_rank` rises with the number
    of ranks compared (multiplicity.job_threshold), so that a healthy job of any size names
    nobody by chance. The per-rank numbers come from compute_stats (made on the ranks' nodes in
    `data.compute_stats`, or here from every rank's rows)."""
    t = data.compute
    findings: dict[int, ComputeFinding] = {}
    cannot: list[int] = []
    notes: list[str] = []
    if data.compute_stats is None and not len(t["rank"]):
        return ComputeStage(findings={}, noise=float("nan"), cannot_compare=data.world,
                            notes=["no forward/backward spans in the trace: compute cannot be compared"])
    if data.compute_stats is None:
        plan, stats = compute_statistics(data, z_instance=z_instance)
    else:
        plan, stats = data.compute_stats["plan"], data.compute_stats["statistics"]
    noise = plan["noise"]
    compared, typical, history = _compared(plan, stats)
    iteration_noise = series_noise([r for r, *_ in compared.values()], default=0.1)
    typical_noise = series_noise([r for _, r in typical.values()], default=0.1)
    z_rank = job_threshold(z_rank, len(data.world) * COMPUTE_MEASURES)
    if min_slowdown is None:
        # The floor falls below 1.2x only among many ranks, where the spread over ranks
        # (between_rank_spread) guards against healthy devices' persistent differences; a small
        # job keeps 1.2x, as tuned (a 2-rank FSDP2 run's busy totals, distorted by its waits,
        # read 1.12x at 4.9% noise while its typical layer call read 1.52x).
        min_slowdown = compute_floor(iteration_noise) if len(compared) >= BETWEEN_MIN_RANKS else FLOOR_MAX
    # Every compared rank's series less its own median: what a run of slow iterations is judged by.
    series_median = dict(zip(compared, row_medians([r for r, *_ in compared.values()])))
    onset_pool = np.sort(np.concatenate([r - series_median[rank] for rank, (r, *_) in compared.items() if len(r)])
                         if compared else np.zeros(0))
    onset_tests = sum(max(len(r) - 4, 1) for r, *_ in compared.values())
    baseline_errors = BaselineErrors(list(compared), [r for r, *_ in compared.values()], list(series_median.values()))
    between = between_rank_spread([r for r, *_ in compared.values()], [r for _, r in typical.values()])
    lengths = [len(r) for r, *_ in compared.values() if len(r)]
    median_null = (MedianNull(onset_pool, between[0], int(np.median(lengths)))
                   if between is not None and lengths else None)
    best_onsets: dict[int, tuple[float, float, int] | None] = {}
    by_length: dict[int, list[int]] = {}
    for rank, (series, *_) in compared.items():
        by_length.setdefault(len(series), []).append(rank)
    for length, ranks_of_length in by_length.items():
        if length:
            best_onsets.update(zip(ranks_of_length, onset_shifts(
                np.stack([compared[r][0] for r in ranks_of_length]), iteration_noise, min_after=MIN_RUN)))
    host_of = {rank: data.roles[rank].host if rank in data.roles else "" for rank in history}
    on_host: dict[str, list[int]] = {}
    for rank in compared:
        on_host.setdefault(host_of[rank], []).append(rank)
    tests = len(data.world) * COMPUTE_MEASURES
    chances: dict[int, float] = {}
    if median_null is not None:  # every rank's at once, by series length
        for length, ranks_of_length in by_length.items():
            if length:
                chances.update(zip(ranks_of_length, median_null.chances(
                    np.array([series_median[r] for r in ranks_of_length]),
                    np.stack([compared[r][0] - series_median[r] for r in ranks_of_length]), tests).tolist()))
    for rank, (per_iteration, iterations, evidence, peers, own) in compared.items():
        if not len(per_iteration):
            continue
        neighbours = [(compared[other][1], compared[other][4]) for other in on_host[host_of[rank]] if other != rank]
        findings[rank] = _finding(rank, peers, per_iteration, iteration_noise, evidence, z_rank, min_slowdown,
                                  min_consistency,
                                  iterations_of=iterations, own=own, neighbours=neighbours,
                                  typical=typical.get(rank), typical_noise=typical_noise,
                                  onset_pool=onset_pool, onset_tests=onset_tests, baseline_errors=baseline_errors,
                                  best_onset=best_onsets.get(rank, False), between=between,
                                  median=series_median[rank], median_null=median_null,
                                  tests=tests, chance=chances.get(rank))
    # Ranks with no same-stage peer (PP-only layouts): with per-layer spans, every transformer
    # layer of any stage runs the same kernels, so ranks of one TP index compare layer by layer.
    lonely = [r for r in data.world if r not in findings]
    if lonely and len(data.layers["rank"]):
        # The reference ranks' layer rows (every rank's but in a stage of more than REFERENCE_PEERS).
        own = np.isin(data.layers["rank"], reference_ranks(data.roles))
        layers = replace(data, layers=table_rows(data.layers, own))
        layer_findings, layer_typical_noise = _layer_peers(layers, lonely, z_rank, min_slowdown, min_consistency)
        findings.update(layer_findings)
        if not typical:
            typical_noise = layer_typical_noise
    alone = [r for r in data.world if r not in findings]
    # Every rank's iteration totals, for what the host did at a lone rank's onset.
    for rank in alone:
        neighbours = [totals[:2] for other, totals in history.items()
                      if other != rank and host_of[other] == host_of.get(rank, "")]
        own = history.get(rank)
        finding = _history(rank, *own, z_rank, min_slowdown, neighbours) if own is not None else None
        if finding is None:
            cannot.append(rank)
        else:
            findings[rank] = finding
    if cannot:
        notes.append(f"rank(s) {cannot} have no peer of the same stage and too few iterations to compare with "
                     f"their own history: their compute cannot be compared")
    return ComputeStage(findings=findings, noise=noise, iteration_noise=iteration_noise,
                        typical_noise=typical_noise if typical or any(f.method == "layers" for f in findings.values())
                        else float("nan"), layer_typical=bool(len(data.layers["rank"])), cannot_compare=cannot,
                        notes=notes)


NO_EVIDENCE = {"instances": 0, "slow": 0, "task_slowdown": 1.0, "worst_ops": []}


def _compared(plan: dict, stats: dict) -> tuple[dict, dict, dict]:
    """From the per-rank statistics (compute_stats): rank -> (per-iteration log ratio of its busy
    total to its peers', those iterations, its task evidence, its peers, its own log totals) for
    every rank of a stage with peers; rank -> (iterations, typical-call log ratio); and rank ->
    (iterations, log busy total over all its tasks, tasks per iteration) for the history test."""
    s = stats["series"]
    order = np.lexsort((s["iteration"], s["rank"]))
    s = table_rows(s, order)
    rank, iteration = s["rank"].astype(np.int64), s["iteration"].astype(np.int64)
    ranks, first = np.unique(rank, return_index=True)
    bounds = np.r_[first, len(rank)]

    def per_rank(mask: np.ndarray, *columns: str) -> dict[int, tuple]:
        out = {}
        for i, r in enumerate(ranks.tolist()):
            rows = slice(bounds[i], bounds[i + 1])
            keep = mask[rows]
            if keep.any():
                out[r] = (iteration[rows][keep], *(s[c][rows][keep] for c in columns))
        return out

    typical = per_rank(~np.isnan(s["typical"]), "typical")
    history = per_rank(~np.isnan(s["all_total"]), "all_total", "tasks")
    evidence = _evidence_of(stats)
    compared = {}
    for entry in plan["stages"].values():
        members = entry["members"]
        if len(members) < 2:
            continue
        iterations = np.unique(entry["shared"] >> 32)
        rows = np.isin(rank, members) & np.isin(iteration, iterations) & ~np.isnan(s["total"])
        totals = np.full((len(iterations), len(members)), np.nan)  # [iteration, rank] log busy total
        totals[np.searchsorted(iterations, iteration[rows]), np.searchsorted(members, rank[rows])] = s["total"][rows]
        ratios = log_ratio_to_peers(totals) if len(iterations) else np.zeros((0, len(members)))
        listed = members.tolist()
        for j, r in enumerate(listed):
            compared[r] = (ratios[:, j], iterations, evidence.get(r, NO_EVIDENCE), listed[:j] + listed[j + 1:],
                           totals[:, j])
    return compared, typical, history


def _evidence_of(stats: dict) -> dict[int, dict]:
    """rank -> its task evidence (ComputeFinding's instances, slow_instances, task_slowdown, worst_ops)."""
    table, worst = stats["ranks"], stats["worst"]
    ops: dict[int, list[dict]] = {}
    for i in np.lexsort((-worst["ratio"], worst["rank"])):
        ops.setdefault(int(worst["rank"][i]), []).append({
            "iteration": int(worst["iteration"][i]), "op": "backward" if worst["kind"][i] else "forward",
            "chunk": int(worst["chunk"][i]), "microbatch": int(worst["microbatch"][i]),
            "slowdown": round(float(np.exp(worst["ratio"][i])), 3)})
    out = {}
    for i, r in enumerate(table["rank"].astype(np.int64).tolist()):
        if table["instances"][i]:
            out[r] = {"instances": int(table["instances"][i]), "slow": int(table["slow"][i]),
                      "task_slowdown": float(np.exp(table["task_median"][i])), "worst_ops": ops.get(r, [])}
    return out


def _layer_peers(data: DetectionInput, lonely: list[int], z_rank: float, min_slowdown: float,
                 min_consistency: float) -> tuple[dict[int, ComputeFinding], float]:
    """Per iteration, each rank's mean busy time per layer call against the median of the other
    ranks of its TP index (all stages), and its typical layer call (typical_ratios, per direction);
    findings for the `lonely` ranks only, and the typical series' noise."""
    t = data.layers
    # MegaFBD's forward and backward instances of one coordinate do different work: never peers.
    tp_of = {r: (role.tp, role.role) for r, role in data.roles.items()}
    findings: dict[int, ComputeFinding] = {}
    groups: dict[tuple[int, str], list[int]] = {}
    for rank in np.unique(t["rank"]).astype(int):
        groups.setdefault(tp_of[int(rank)], []).append(int(rank))
    per_rank: dict[int, tuple[np.ndarray, list[int]]] = {}
    typical: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for ranks in groups.values():
        if len(ranks) < 2:
            continue
        typical.update(typical_ratios(t["rank"], t["iteration"], t["kind"], t["busy"], np.asarray(ranks)))
        iterations = np.unique(t["iteration"][np.isin(t["rank"], ranks)])
        matrix = np.full((len(iterations), len(ranks)), np.nan)  # [iteration, rank] log mean layer busy
        for j, rank in enumerate(ranks):
            for i, it in enumerate(iterations):
                mine = (t["rank"] == rank) & (t["iteration"] == it)
                if mine.any():
                    matrix[i, j] = np.log(max(float(t["busy"][mine].mean()), 1.0))
        ratios = log_ratio_to_peers(matrix)  # [iteration, rank]; nan: nothing to compare
        for j, rank in enumerate(ranks):
            valid = ~np.isnan(ratios[:, j])
            if valid.sum() >= 2:
                per_rank[rank] = (ratios[valid, j], [r for r in ranks if r != rank], iterations[valid],
                                  matrix[valid, j])
    noise = series_noise([r for r, *_ in per_rank.values()], default=0.1)
    typical_noise = series_noise([r for _, r in typical.values()], default=0.1)
    for rank in lonely:
        if rank not in per_rank:
            continue
        ratio, peers, iterations, own = per_rank[rank]
        finding = _finding(rank, peers, ratio, noise, NO_EVIDENCE, z_rank, min_slowdown, min_consistency,
                           iterations_of=iterations, own=own, typical=typical.get(rank), typical_noise=typical_noise)
        finding.method = "layers"
        findings[rank] = finding
    return findings, typical_noise


def _finding(rank: int, peers: list[int], per_iteration: np.ndarray, iteration_noise: float, evidence: dict,
             z_rank: float, min_slowdown: float, min_consistency: float, iterations_of: np.ndarray,
             own: np.ndarray | None = None,
             neighbours: list[tuple[np.ndarray, np.ndarray]] = (),
             typical: tuple[np.ndarray, np.ndarray] | None = None,
             typical_noise: float = float("nan"), onset_pool: np.ndarray | None = None,
             onset_tests: int = 1, baseline_errors: BaselineErrors | None = None,
             best_onset: tuple[float, float, int] | None | bool = False,
             between: tuple[float, float] | None = None, median: float | None = None,
             median_null: MedianNull | None = None, tests: int = 1, chance: float | None = None) -> ComputeFinding:
    """`per_iteration`: the rank's log ratio to its peers per iteration; `evidence`: its task
    instances compared, how many were slow, their median log ratio and the slowest (_compared);
    `own`: its own log busy
    per iteration (same order), which an onset must show beyond what the other ranks of its host
    show at the same iteration (`neighbours`: their (iterations, own log busy); see
    own_share_of_onset). `typical`: (iterations, log ratio of its typical call; typical_ratios),
    judged by the same tests with its own noise when the totals name nothing. An onset must also
    be unlikely as a run of chance iterations among all ranks' (`onset_pool`, `onset_tests`,
    `baseline_errors`: multiplicity.chance_of_late_run), within its share of the job's false-alarm
    budget. `median`: np.median(per_iteration), when known. With `median_null` (many ranks), the
    busy total is judged by the chance of a median this high in a job of `tests` comparisons:
    heavy-tailed iterations make a high median likelier than the ranks' spread says, and a rank
    slow in half its iterations (a burst) stands out by how many, where its median's z or its
    share of slower iterations does not (`chance`: that chance, when already worked out)."""
    median = float(np.median(per_iteration)) if median is None else float(median)
    z = median / (1.2533 * iteration_noise / np.sqrt(len(per_iteration)))
    consistent = bool(np.mean(per_iteration > 0) >= min_consistency) if len(per_iteration) >= 4 else True
    # Among many ranks, also against how far healthy ranks' medians spread (`between`, see
    # between_rank_spread): persistent differences of healthy devices are not iteration noise.
    apart = between is None or median > z_rank * between[0]
    if median_null is not None:
        if chance is None:
            chance = median_null.chance(median, len(per_iteration), tests, own=per_iteration - median)
        flagged = bool(chance < JOB_FALSE_ALARM / COMPUTE_MEASURES and np.exp(median) >= min_slowdown)
    else:
        chance = float("nan")
        flagged = bool(z > z_rank and np.exp(median) >= min_slowdown and consistent and apart)
    measure = "total"
    typical_slowdown, typical_z, typical_slower = float("nan"), float("nan"), 0
    if typical is not None and len(typical[1]):
        series = typical[1]
        typical_median = float(np.median(series))
        typical_slowdown = float(np.exp(typical_median))
        typical_z = typical_median / (1.2533 * typical_noise / np.sqrt(len(series)))
        typical_slower = int(np.sum(series > 0))
        typical_consistent = bool(np.mean(series > 0) >= min_consistency) if len(series) >= 4 else True
        typical_apart = between is None or typical_median > z_rank * between[1]
        if (not flagged and typical_z > z_rank and typical_slowdown >= min_slowdown and typical_consistent
                and typical_apart):
            flagged, measure = True, "typical"
    onset = None
    if not flagged:  # a fault that began mid-run barely moves the whole series' median
        change = significant_onset(per_iteration, iteration_noise, z_rank, min_slowdown, best=best_onset)
        if change is not None and onset_pool is not None and chance_of_late_run(
                onset_pool, per_iteration[change[2]:] - np.median(per_iteration[:change[2]]), onset_tests,
                baseline_errors.at(change[2], rank) if baseline_errors is not None else None,
                own=per_iteration - median, presorted=True) >= JOB_FALSE_ALARM / COMPUTE_MEASURES:
            change = None
        if change is not None and (own is None or own_share_of_onset(
                own, change, host_shift(neighbours, int(iterations_of[change[2]]))) >= MIN_OWN_SHARE):
            flagged, median, z, onset = True, change[0], change[1], int(iterations_of[change[2]])
    if measure == "typical":
        median, z = float(np.log(typical_slowdown)), typical_z
    return ComputeFinding(rank=rank, method="peers", peers=peers, instances=evidence["instances"],
                          slow_instances=evidence["slow"], iterations=len(per_iteration),
                          slower_iterations=int(np.sum(per_iteration > 0)) if measure == "total" else typical_slower,
                          slowdown=float(np.exp(median)), measure=measure, typical_slowdown=typical_slowdown,
                          typical_z=float(typical_z), typical_slower_iterations=typical_slower,
                          task_slowdown=evidence["task_slowdown"], z=float(z), flagged=flagged, chance=chance,
                          worst_ops=evidence["worst_ops"], onset_iteration=onset,
                          series=np.asarray(per_iteration, dtype=np.float64),
                          series_iterations=np.asarray(iterations_of, dtype=np.int64), series_noise=iteration_noise)


def _history(rank: int, iterations: np.ndarray, per_iteration: np.ndarray, tasks: np.ndarray, z_rank: float,
             min_slowdown: float, neighbours: list[tuple[np.ndarray, np.ndarray]] = ()) -> ComputeFinding | None:
    """A rank without peers against itself: the best split of its per-iteration busy totals into
    before/after, flagged when the later part is significantly and materially slower (an onset).
    Noise is the robust spread of successive differences, which one step cannot inflate. Being
    the best of many splits, it must clear ONSET_PENALTY more standard errors, as peer onsets do.
    What the host's other ranks slowed at the same split (`neighbours`: their iteration totals,
    see host_shift) is the host's, not the rank's, and is taken off: both stages of a healthy
    PP=2 run on 2 cores stepped up 1.2x together, and online detection named one of them."""
    if len(iterations) < 4:
        return None
    noise = max(_MAD * float(np.median(np.abs(np.diff(per_iteration)))) / np.sqrt(2.0), 0.02)
    best: tuple[float, int] | None = None
    for split in range(1, len(iterations)):
        if split > 1 and per_iteration[split] <= np.median(per_iteration[:split]) + 2 * noise:
            # The later part starts with a clearly slow iteration: medians (which a few normal
            # iterations hardly move) and the larger later part otherwise put the onset early
            # (4 iterations early on an H100 time-shared mid-run).
            continue
        before, after = per_iteration[:split], per_iteration[split:]
        host = max(host_shift(neighbours, int(iterations[split])), 0.0)
        shift = float(np.median(after) - np.median(before)) - host
        z = shift / (1.2533 * noise * np.sqrt(1 / len(before) + 1 / len(after)))
        if best is None or z > best[0]:
            best = (z, split, shift)
    z, split, shift = best
    flagged = bool(z > z_rank + ONSET_PENALTY and np.exp(shift) >= min_slowdown and len(iterations) - split >= 2)
    return ComputeFinding(rank=rank, method="history", peers=[], instances=int(tasks[split:].sum()),
                          slow_instances=0, iterations=len(iterations) - split,
                          slower_iterations=int(np.sum(per_iteration[split:] > np.median(per_iteration[:split]))),
                          slowdown=float(np.exp(shift)), task_slowdown=float("nan"), z=float(z), flagged=flagged,
                          onset_iteration=int(iterations[split]) if flagged else None)
