"""Faults that began mid-run: the best split of a rank's per-iteration ratio series into an earlier
and a later part, its size in standard errors, and how much of the step the rank's own busy time
shows (used by the compute peer comparison and by CPU starvation)."""
from __future__ import annotations

import numpy as np


# Extra standard errors asked of an onset: the best of many before/after splits is taken.
ONSET_PENALTY = 1.0


def significant_onset(series: np.ndarray, noise: float, z_rank: float, min_ratio: float, *,
                      min_level: float | None = None,
                      best: tuple[float, float, int] | None | bool = False) -> tuple[float, float, int] | None:
    """onset_shift's best split when it clears z_rank + ONSET_PENALTY and min_ratio, else None.
    With `min_level` (a ratio), the later part must also stand that far above the peers, not
    merely above the rank's own earlier standing (see host_starvation). `best`: onset_shift's
    answer, already computed (onset_shifts), when not False."""
    if best is not False and min_level is None:
        change = best
    else:
        change = onset_shift(series, noise, min_level=-np.inf if min_level is None else float(np.log(min_level)))
    if change is not None and change[1] > z_rank + ONSET_PENALTY and np.exp(change[0]) >= min_ratio:
        return change
    return None


# Share of an onset (a step up of a rank's ratio to its peers) that its own busy time must show.
MIN_OWN_SHARE = 0.5


def own_share_of_onset(own: np.ndarray, change: tuple[float, float, int], host: float = 0.0) -> float:
    """How much of a ratio's step up at change[2] the rank's own log busy series shows (its own
    later median over its earlier one, less the `host` shift its host's other ranks show at the
    same iteration, as a share of the ratio's shift). A ratio steps up when the rank slows or when
    its peers speed up; in a stage of two, a peer that was slow in the first iterations (warm-up,
    a burst of host contention) mirrors as an onset of the other one, whose own busy time has not
    moved. And when the whole host slows, a rank whose only peer is stalled (its busy time made of
    the stalls, which host load barely moves) steps up against it like every other rank does."""
    shift, _, split = change
    own_shift = float(np.median(own[split:]) - np.median(own[:split])) - max(host, 0.0)
    return own_shift / shift if shift > 0 else 0.0


def host_shift(neighbours: list[tuple[np.ndarray, np.ndarray]], iteration: int) -> float:
    """Median over the other ranks of a host of their own log busy shift from before `iteration`
    to from it on: how much the host as a whole slowed then (0 with no such rank)."""
    shifts = [float(np.median(own[its >= iteration]) - np.median(own[its < iteration]))
              for its, own in neighbours if (its >= iteration).any() and (its < iteration).any()]
    return float(np.median(shifts)) if shifts else 0.0


def onset_shifts(matrix: np.ndarray, noise: float, *, min_before: int = 3,
                 min_after: int = 2) -> list[tuple[float, float, int] | None]:
    """onset_shift of every row of `matrix` (series of one length), at once: the medians of each
    split's two parts for all rows together (one Python loop over splits, not over ranks x splits:
    thousands of ranks made that most of the compute analyzer's time)."""
    rows, length = matrix.shape
    best_z = np.full(rows, -np.inf)
    best = np.full((rows, 3), np.nan)
    for split in range(min_before, length - min_after + 1):
        baseline = np.median(matrix[:, :split], axis=1)
        later = matrix[:, split:]
        valid = np.all(later > baseline[:, None], axis=1)
        shift = np.median(later, axis=1) - baseline
        z = shift / (1.2533 * noise * np.sqrt(1 / (length - split) + 1 / split))
        better = valid & (z > best_z)
        best_z[better] = z[better]
        best[better] = np.column_stack([shift, z, np.full(rows, split)])[better]
    return [None if np.isnan(b[0]) else (float(b[0]), float(b[1]), int(b[2])) for b in best]


def onset_shift(series: np.ndarray, noise: float, *, min_before: int = 3, min_after: int = 2,
                min_level: float = -np.inf) -> tuple[float, float, int] | None:
    """(log shift, z, first index after) of the best split of a per-iteration ratio series into
    an earlier part and a later part that is higher in every value and whose median is at least
    `min_level`: a fault that began mid-run (or, online, in the last windows). None when the
    series is too short for both parts or no split qualifies."""
    best = None
    for split in range(min_before, len(series) - min_after + 1):
        before, after = series[:split], series[split:]
        baseline = float(np.median(before))
        if not np.all(after > baseline) or float(np.median(after)) < min_level:
            continue
        shift = float(np.median(after)) - baseline
        z = shift / (1.2533 * noise * np.sqrt(1 / len(after) + 1 / len(before)))
        if best is None or z > best[1]:
            best = (shift, z, split)
    return best
