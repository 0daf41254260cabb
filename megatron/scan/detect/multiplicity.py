"""Tests of many ranks at once: the bar one rank's test must clear so that false alarms are
controlled per job, not per rank, and the compute floor that noise allows.

Each analyzer compares every rank (or link) with its peers; a test that wrongly names a healthy
rank once in 1,000 names four of them in every healthy 4,096-rank job. The bar of a job of n
comparisons is the one-sided normal quantile of JOB_FALSE_ALARM / n (Bonferroni), never below
the analyzer's own bar, which was tuned on jobs of 4-16 ranks and is what small jobs keep. Where
one analyzer asks several questions of every rank (compute: its busy total, its typical call and
an onset), each question's bar is set for its share of the job's budget (COMPUTE_MEASURES)."""
from __future__ import annotations

from math import lgamma
from statistics import NormalDist

import numpy as np

# Share of healthy jobs, at any size, in which an analyzer may name somebody by chance alone
# (under its noise model: robust spreads of per-iteration ratios, normal tails).
JOB_FALSE_ALARM = 0.01
# The compute analyzer asks three questions of each rank (busy total, typical call, onset); each
# gets a third of the budget. With one each, 100 healthy 4,096-rank synthetic jobs named a rank in
# 5 (offline): one by its total, one by its typical call, three by onsets.
COMPUTE_MEASURES = 3


def job_threshold(base: float, tests: int, *, false_alarm: float = JOB_FALSE_ALARM) -> float:
    """The z a single comparison must clear in a job of `tests` comparisons (at least `base`)."""
    if tests <= 1:
        return base
    return max(base, NormalDist().inv_cdf(1.0 - false_alarm / tests))


# The compute floor: a rank is named only if it is at least this much slower than its peers.
# Healthy hardware differs by a few per cent, which many iterations make "significant"; on a
# noisy host (CPU ranks sharing cores: 6-60% per iteration, where healthy ranks also stood
# 1.1-1.15x apart for whole runs) the floor stays FLOOR_MAX, as tuned there; where an iteration is
# measured to within QUIET_NOISE (GPU ranks: the recorded H100 run's steps varied 3.4%, a ratio of
# two such 4-5%) it is FLOOR_MIN, above the spread of healthy devices (the fitted per-rank speed
# spread is 1%: the slowest of 16,384 healthy ranks stands about 1.04x) and below what a device
# 1.1x slower reads against its peers (1.07-1.09x in 5 of 21 synthetic jobs with a 1.08 floor);
# linear in between. peer_comparison uses it only among many ranks (between_rank_spread).
FLOOR_MAX = 1.2
FLOOR_MIN = 1.05
QUIET_NOISE = 0.05
NOISY = 0.06


def compute_floor(iteration_noise: float, *, ceiling: float = FLOOR_MAX) -> float:
    """The smallest slowdown worth naming, given the per-iteration noise (log ratio spread)."""
    if iteration_noise != iteration_noise:  # nan: nothing measured
        return ceiling
    share = min(1.0, max(0.0, (iteration_noise - QUIET_NOISE) / (NOISY - QUIET_NOISE)))
    return min(ceiling, FLOOR_MIN + share * (FLOOR_MAX - FLOOR_MIN))


def chance_of_late_run(pool: np.ndarray, later: np.ndarray, tests: int,
                       baseline_errors: np.ndarray | None = None, own: np.ndarray | None = None,
                       presorted: bool = False) -> float:
    """How likely, in a job of `tests` (rank, split) comparisons, some rank's series ends in a run
    as high as `later` (each value less the rank's baseline, the median before the split) by
    chance: the share q of all ranks' values (each less its own median: `pool`) at least as high
    as the run's lowest value, to the power of the run's length, times the tests. Nonparametric:
    heavy-tailed iterations (a GPU's rare slow step, a host's stall) make q larger and a short run
    at the end of the window no longer an onset, where a normal model of the noise would call two
    outlying iterations a fault that began.

    The run's values share one baseline, the median of a few iterations, so they are not
    independent: a baseline that fell low by chance lifts all of them at once. `baseline_errors`
    (the other ranks' medians before the same split less their whole medians) is that baseline's
    error as it falls across ranks; the chance is then the mean over those errors e of q(lowest +
    e) to the run's length. Without it, q^k counted runs after a low baseline as rarer than they
    are, and 3 of 100 healthy 4,096-rank jobs named an onset. `own`: the judged rank's values in
    `pool`, left out of it: a run is no evidence of how common runs are (in a stage of two ranks,
    its own four slow iterations made q at least 4 in 24). `presorted`: `pool` is sorted already
    (one sort per analysis, not one per candidate onset)."""
    ordered = pool if presorted else np.sort(pool)
    own = np.sort(own) if own is not None else np.zeros(0)
    size = len(ordered) - len(own)
    if size <= 0 or not len(later):
        return 1.0
    lowest = float(np.min(later))
    thresholds = lowest + (np.asarray(baseline_errors, dtype=np.float64)
                           if baseline_errors is not None and len(baseline_errors) else np.zeros(1))
    above = ((len(ordered) - np.searchsorted(ordered, thresholds, side="left"))
             - (len(own) - np.searchsorted(own, thresholds, side="left")))
    q = np.maximum(above / size, 1.0 / size)
    return tests * float(np.mean(q ** len(later)))


def _binomial_tail(count: int, n: int, q: np.ndarray) -> np.ndarray:
    """P(Binomial(n, q) >= count), elementwise over q (a sum of at most n terms, in logs)."""
    q = np.clip(np.asarray(q, dtype=np.float64), 1e-300, 1.0 - 1e-16)
    if max(count, 0) > n:
        return np.zeros_like(q)
    # Every term at once (rank 0 calls this once per rank): a row per count i, added in order.
    i = np.arange(max(count, 0), n + 1)
    coefficient = np.array([lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1) for k in i.tolist()])
    flat = q.reshape(-1)
    terms = np.exp(coefficient[:, None] + i[:, None] * np.log(flat) + (n - i)[:, None] * np.log1p(-flat))
    total = terms[0].copy()
    for row in terms[1:]:  # in order, as a running sum (a reduction may add pairwise)
        total += row
    return np.minimum(total, 1.0).reshape(q.shape)


# Grid of a rank's persistent level (in its standard deviations) the chance of a median averages
# over, with normal weights.
_LEVELS = np.linspace(-5.0, 5.0, 81)
_LEVEL_WEIGHTS = np.exp(-0.5 * _LEVELS ** 2) / np.exp(-0.5 * _LEVELS ** 2).sum()


class MedianNull:
    """How high a healthy rank's median per-iteration ratio stands by chance, among many ranks.

    A rank's ratio in an iteration is its persistent level (healthy devices differ by a few per
    cent) plus that iteration's noise, whose tail is heavy: the recorded H100 run had 7% of its
    steps 1.15x or slower, and a rank that draws several such steps has its median lifted with
    them. The iterations' noise is `pool` (every rank's values less its own median); the median
    of n iterations is high when at least half of them are (a binomial count of the pool's
    share above it); the persistent level is normal, with the part of the ranks' spread of
    medians (`spread`: between_rank_spread) that the iterations' noise does not explain. The
    normal model of the spread alone took tail-lifted medians for slow devices: healthy ranks
    1.06-1.07x with 3-6 tail iterations of 20 were named at 4.8-5.3 spreads in 4,096-rank jobs."""

    def __init__(self, pool: np.ndarray, spread: float, iterations: int) -> None:
        self.pool = np.sort(np.asarray(pool, dtype=np.float64))
        noise = self._median_spread(iterations)
        self.persistent = float(np.sqrt(max(spread * spread - noise * noise, 0.0)))

    def _share_above(self, x: np.ndarray) -> np.ndarray:
        """Share of the pool at or above each x."""
        return (len(self.pool) - np.searchsorted(self.pool, x, side="left")) / max(len(self.pool), 1)

    def _median_spread(self, n: int) -> float:
        """Robust spread (quartiles / 1.349) of the median of n draws from the pool."""
        if not len(self.pool) or n < 1:
            return 0.0
        grid = np.quantile(self.pool, np.linspace(0.0005, 0.9995, 801))
        above = _binomial_tail((n + 1) // 2, n, self._share_above(grid))  # P(median >= x), falling
        lower, upper = np.interp(0.75, above[::-1], grid[::-1]), np.interp(0.25, above[::-1], grid[::-1])
        return float(upper - lower) / 1.349

    def chance(self, median: float, n: int, tests: int, own: np.ndarray | None = None) -> float:
        """Chance, in a job of `tests` comparisons, that some healthy rank's median of n
        iterations stands at least `median` (upper middle value counted: conservative for even
        n). `own`: the judged rank's values in the pool, left out (a burst is no evidence of how
        common bursts are)."""
        owns = np.zeros((1, 0)) if own is None else np.asarray(own, dtype=np.float64)[None, :]
        return float(self.chances(np.array([median], dtype=np.float64), owns, tests, n)[0])

    def chances(self, medians: np.ndarray, owns: np.ndarray, tests: int, n: int | None = None) -> np.ndarray:
        """chance() of many ranks at once: `medians` [ranks] of n iterations each (default: the
        width of `owns`), `owns` [ranks, k] each rank's values left out of the pool."""
        owns = np.asarray(owns, dtype=np.float64)
        count, k = owns.shape
        n = k if n is None else n
        if not len(self.pool) or n < 1:
            return np.ones(count)
        x = np.asarray(medians, dtype=np.float64)[:, None] - _LEVELS[None, :] * self.persistent  # [ranks, levels]
        above = len(self.pool) - np.searchsorted(self.pool, x, side="left")
        # a rank's own values at or above x: all but those below (an unordered count, as a sort's)
        above = above - (k - (owns[:, None, :] < x[:, :, None]).sum(axis=2))
        tails = _binomial_tail((n + 1) // 2, n, above / max(len(self.pool) - k, 1))
        return np.array([tests * float(np.sum(_LEVEL_WEIGHTS * row)) for row in tails])
