"""One notion of a rank's speed (megatron.scan.speed): what the compute clock adds up, how a rank
compares with its peers, and that detection, the suspect score and straggler mitigation's figures
computed through it give exactly what their own formulas gave."""
from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch

from megatron.scan.metrics import suspect_scores
from megatron.scan.speed import (
    COMPUTE_SPANS,
    ComputeClock,
    log_ratio_to_peers,
    peer_median,
    relative_speed,
    slowness,
    reference_seconds,
)


def test_the_clock_adds_up_forward_and_backward_spans_only_and_starts_again_when_read():
    clock = ComputeClock(torch.device("cpu"))
    assert COMPUTE_SPANS == ("forward", "backward")
    for kind in ("forward", "backward", "optimizer", "recv"):
        with clock.span(kind, microbatch=0):
            time.sleep(0.02)
    seconds = clock.take()
    assert 0.04 <= seconds < 0.06, seconds  # the optimizer and recv spans are not compute
    assert clock.take() == 0.0
    with clock.span("forward"):
        time.sleep(0.02)
    assert 0.005 <= clock.take_per_microbatch(4) < 0.015  # a rank's speed: seconds per microbatch
    assert clock.take_per_microbatch(0) == 0.0  # no microbatch counts as one


def test_mitigation_measures_with_the_shared_clock():
    from megatron.mitigation import plugin

    assert plugin.ComputeClock is ComputeClock


def test_a_rank_compared_with_its_peers():
    seconds = [1.0, 1.0, 2.0, 1.0]
    assert slowness(seconds) == [1.0, 1.0, 2.0, 1.0]
    assert relative_speed(seconds) == [1.0, 1.0, 0.5, 1.0]
    assert relative_speed(seconds, reference="fastest") == [1.0, 1.0, 0.5, 1.0]
    assert slowness([2.0, 4.0, 0.0], reference="fastest") == [1.0, 2.0, 1.0]  # 0: not measured, typical
    assert reference_seconds([0.0, -1.0]) is None and slowness([0.0, 0.0]) == [1.0, 1.0]
    # [observation, rank]: the other ranks' median, in log time (with two peers, their geometric mean)
    log = np.log([[1.0, 1.0, 2.0, 1.0], [1.0, np.nan, 3.0, np.nan], [np.nan, np.nan, 1.0, np.nan],
                  [1.0, 4.0, 2.0, 8.0]])
    ratio = np.exp(log_ratio_to_peers(log))
    assert np.allclose(ratio[0], [1.0, 1.0, 2.0, 1.0]) and np.allclose(ratio[1, [0, 2]], [1 / 3, 3.0])
    assert np.isnan(ratio[1, [1, 3]]).all() and np.isnan(ratio[2]).all()  # no value, or no peer with one
    assert np.allclose(ratio[3], [1 / 4, 2.0, 1 / 2, 4.0])
    assert np.array_equal(peer_median(np.array([[1.0, 2.0, 6.0]]), include_self=True), [[2.0, 2.0, 2.0]])


# --- the formulas each consumer had before the shared module, for the equivalence tests ---------


def _suspect_scores_before(compute_seconds: list[float]) -> list[float]:
    positive = [c for c in compute_seconds if c > 0]
    if not positive:
        return [1.0] * len(compute_seconds)
    median = statistics.median(positive)
    return [c / median if c > 0 else 1.0 for c in compute_seconds]


def _ratios_before(matrix: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """detect/compute.py, typical.py and host.py: (comparable rows, log ratio) per rank."""
    out = []
    for j in range(matrix.shape[1]):
        others = np.delete(matrix, j, axis=1)
        valid = ~np.isnan(matrix[:, j]) & (np.sum(~np.isnan(others), axis=1) > 0)
        out.append((valid, matrix[valid, j] - np.nanmedian(others[valid], axis=1) if valid.any() else np.zeros(0)))
    return out


def _lists(seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        values = list(rng.lognormal(0, 0.5, int(rng.integers(1, 10))))
        if rng.random() < 0.3:
            values[int(rng.integers(len(values)))] = 0.0
        if rng.random() < 0.2:
            values = values + values[:2]  # ties
        yield [float(v) for v in values]


@pytest.mark.parametrize("seed", range(3))
def test_suspect_scores_are_the_same_numbers_as_before(seed):
    for values in _lists(seed):
        assert suspect_scores(values) == _suspect_scores_before(values), values


@pytest.mark.parametrize("seed", range(3))
def test_mitigations_speed_figures_are_the_same_numbers_as_before(seed):
    for values in _lists(seed):
        if min(values) <= 0:
            continue  # measured seconds per microbatch: every rank ran at least one
        typical, fastest = statistics.median(values), min(values)
        assert reference_seconds(values) == typical
        assert relative_speed(values) == [typical / t for t in values]  # the [mitigation] log line
        assert relative_speed(values, reference="fastest") == [fastest / t for t in values]  # the speed gauge


@pytest.mark.parametrize("seed", range(2))
def test_detections_ratio_to_its_peers_is_the_same_as_before(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        matrix = np.log(rng.lognormal(13, 0.3, (int(rng.integers(1, 30)), int(rng.integers(2, 8)))))
        dense = log_ratio_to_peers(matrix)
        # The iteration totals (no gaps) were compared with np.median of the other columns.
        for j in range(matrix.shape[1]):
            assert np.array_equal(dense[:, j], matrix[:, j] - np.median(np.delete(matrix, j, axis=1), axis=1))
        matrix[rng.random(matrix.shape) < rng.uniform(0, 0.6)] = np.nan
        ratios = log_ratio_to_peers(matrix)
        for j, (valid, before) in enumerate(_ratios_before(matrix)):
            assert np.array_equal(~np.isnan(ratios[:, j]), valid)
            assert np.array_equal(ratios[valid, j], before)
