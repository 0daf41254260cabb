"""Statistics of the per-iteration ratio series the compute analyzer judges, over all ranks
compared: how noisy one value is (series_noise), how far healthy ranks' medians spread
(between_rank_spread), and how far an onset's baseline falls by chance (BaselineErrors)."""
from __future__ import annotations

import numpy as np

from megatron.scan.detect.typical import row_medians

_MAD = 1.4826  # MAD -> standard deviation for normal noise


class BaselineErrors:
    """Per split, how far each compared rank's median before the split falls from its whole
    series' median: the error of an onset's baseline as chance spreads it over ranks (see
    multiplicity.chance_of_late_run). Computed for a split only when an onset there is judged."""

    def __init__(self, ranks: list[int], series: list[np.ndarray], medians: list[float]) -> None:
        self.ranks, self.series, self.medians = ranks, series, np.asarray(medians, dtype=np.float64)
        self.cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def at(self, split: int, rank: int) -> np.ndarray:
        """The errors at `split` of every rank but `rank` (the judged one)."""
        if split not in self.cache:
            longer = [i for i, r in enumerate(self.series) if len(r) > split]
            before = row_medians([self.series[i][:split] for i in longer])
            self.cache[split] = (np.asarray([self.ranks[i] for i in longer]), before - self.medians[longer])
        ranks, errors = self.cache[split]
        return errors[ranks != rank]


# Ranks compared before the spread of their medians is a measure of what healthy ranks differ by.
BETWEEN_MIN_RANKS = 32


def between_rank_spread(series: list[np.ndarray], typical: list[np.ndarray]) -> tuple[float, float] | None:
    """(robust spread over ranks of each rank's median per-iteration ratio, the same of the typical
    call's), or None with fewer than BETWEEN_MIN_RANKS ranks. It holds both the iterations' noise
    left in a median and the persistent differences of healthy devices (a few per cent), which
    many iterations make 'significant' against the noise alone: at 1,024 ranks and 20 iterations,
    17 of 50 healthy synthetic jobs had a rank 1.05-1.06x its peers at 4.3-5.6 standard errors.
    The median and MAD over ranks barely move for a few slow ones (Efron's empirical null)."""
    medians = row_medians([r for r in series if len(r)])
    if len(medians) < BETWEEN_MIN_RANKS:
        return None
    spread = max(_MAD * float(np.median(np.abs(medians - np.median(medians)))), 1e-3)
    typical_medians = row_medians([r for r in typical if len(r)])
    typical_spread = (max(_MAD * float(np.median(np.abs(typical_medians - np.median(typical_medians)))), 1e-3)
                      if len(typical_medians) >= BETWEEN_MIN_RANKS else spread)
    return spread, typical_spread


def series_noise(series: list[np.ndarray], *, default: float, floor: float = 0.02) -> float:
    """Noise of one value of per-iteration ratio series: the median over series of each one's
    robust spread of successive differences (/ sqrt 2). Differences, so that a step (a fault that
    began mid-run) does not inflate it; the median over ranks, so that neither a slow rank's
    bursts nor its mirror image in a two-rank stage set the scale."""
    spreads = _MAD * row_medians([np.abs(np.diff(r)) for r in series if len(r) >= 3]) / np.sqrt(2.0)
    return max(float(np.median(spreads)) if len(spreads) else default, floor)
