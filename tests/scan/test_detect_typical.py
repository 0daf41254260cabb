"""The typical call: a device slower in every call is named even when host preemption makes the
iteration totals too noisy to name it, and a rank merely preempted more often (a few long calls)
is not named by it. DP=4 with per-layer spans, as `--trace` records by default."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from megatron.scan.detect.combine import detect
from megatron.scan.detect.compute import peer_comparison
from megatron.scan.detect.typical import typical_ratios
from megatron.scan.detect.report import suspect_ranks, text_report

from tests.scan.test_detect_signals import data, table

LAYERS, MICROBATCHES = 4, 4


def traced(slower: dict[int, float], *, iterations: int = 20, preempt: float = 0.15, extra_preempt: dict | None = None,
           seed: int = 5):
    """Per rank and iteration, one forward and one backward task per microbatch and its layer
    calls. Every call has 3% noise; with probability `preempt` (per rank, `extra_preempt`
    overriding) a call waits 2-12x its length for a CPU, as ranks outnumbering cores do."""
    rng = np.random.default_rng(seed)
    tasks, layers = [], []
    for it in range(iterations):
        for rank in range(4):
            p = (extra_preempt or {}).get(rank, preempt)
            for mb in range(MICROBATCHES):
                for kind in (0, 1):
                    total = 0.0
                    for layer in range(LAYERS):
                        busy = 1e6 * (1 + kind) * slower.get(rank, 1.0) * rng.lognormal(0, 0.03)
                        if rng.random() < p:
                            busy *= 1 + rng.uniform(2, 12)
                        layers.append((rank, it, kind, layer, busy))
                        total += busy
                    tasks.append((rank, it, kind, 0, mb, it * 1e9 + mb * 1e7 + kind * 5e6, total))
    compute = table(tasks, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy"))
    layer_table = table(layers, ("rank", "iteration", "kind", "layer", "busy"))
    return replace(data(compute=compute), layers={k: v.astype(np.int64) for k, v in layer_table.items()})


def test_a_rank_slower_in_every_call_is_named_by_its_typical_call_when_totals_are_too_noisy():
    detection = detect(traced({1: 1.25}))
    finding = detection.compute.findings[1]
    assert finding.flagged and finding.measure == "typical"
    assert 1.2 < finding.slowdown < 1.32 and finding.z > 3.5
    assert suspect_ranks(detection) == [1]
    # The busy totals alone would not have named it: preemption makes them too noisy.
    assert detection.compute.iteration_noise > 3 * detection.compute.typical_noise
    assert "typical transformer-layer call" in detection.suspects[0].evidence[0]


def test_a_rank_preempted_more_often_is_not_named_by_its_typical_call():
    detection = detect(traced({}, extra_preempt={2: 0.3}))
    finding = detection.compute.findings[2]
    assert finding.typical_slowdown < 1.1 and finding.measure == "total"
    assert all(s.details["compute"] is None or s.details["compute"]["measure"] == "total" for s in detection.suspects)


def test_the_power_line_says_what_a_steady_slowdown_needs_beside_a_bursty_one():
    detection = detect(traced({}))
    assert detection.suspects == []
    power = detection.power
    assert power.steady_measure == "its typical layer call" and power.steady_needed < power.needed
    line = text_report(detection)
    assert "one slower in every call would have been (its typical layer call: noise" in line


def test_typical_ratios_compare_the_median_call_of_each_kind_per_iteration():
    # Rank 0's calls: 1 ms, with one 20 ms preempted call; rank 1's: 1.5 ms. Per iteration and call.
    rows = [(0, 0, 7, 1e6)] * 4 + [(0, 0, 7, 20e6)] + [(1, 0, 7, 1.5e6)] * 5
    t = table(rows, ("rank", "iteration", "call", "busy"))
    ratios = typical_ratios(t["rank"], t["iteration"], t["call"], t["busy"], np.array([0, 1]))
    assert np.allclose(np.exp(ratios[1][1]), [1.5]) and np.allclose(np.exp(ratios[0][1]), [1 / 1.5])
    stage = peer_comparison(traced({}))
    assert stage.layer_typical and stage.typical_noise < stage.iteration_noise
