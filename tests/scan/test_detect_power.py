"""What a verdict may claim: `healthy` only when a rank 1.2x slower would have been named with the
iterations traced, else `inconclusive` with the leading candidate and the iterations it would
take; arrival order judged per iteration and by what it costs the job; one entry per suspect."""
from __future__ import annotations

import numpy as np

from megatron.scan.detect.collective import arrival_order
from megatron.scan.detect.combine import detect
from megatron.scan.detect.power import iterations_needed
from megatron.scan.detect.report import as_dict, suspect_ranks, text_report

from tests.scan.test_detect_signals import data, host_rows, table


def compute_rows(factors: dict[int, float], *, iterations: int, noise: float, tasks: int = 4, seed: int = 3):
    """DP=4: per iteration each rank's tasks; every task of a rank shares one iteration-level noise
    draw (a whole iteration runs slow or fast), so the per-iteration ratio noise is about `noise`."""
    rng = np.random.default_rng(seed)
    rows = []
    for it in range(iterations):
        for rank in range(4):
            level = rng.lognormal(0, noise) * factors.get(rank, 1.0)
            for task in range(tasks):
                rows.append((rank, it, task % 2, 0, task // 2, it * 1e9 + task * 1e7, 10e6 * level))
    return table(rows, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy"))


def test_a_short_noisy_run_is_inconclusive_naming_its_leading_candidate_and_the_iterations_it_needs():
    # 8 iterations at 20% noise: a rank 1.2x slower could not have been told from noise.
    detection = detect(data(compute=compute_rows({2: 1.12}, iterations=8, noise=0.2)))
    assert detection.verdict == "inconclusive" and not detection.suspects
    power = detection.power
    assert power is not None and not power.enough and power.iterations == 8
    assert power.needed == iterations_needed(power.noise) and power.more == power.needed - 8 > 0
    report = text_report(detection)
    assert "could not have been named: 8 iterations" in report and f"about {power.more} more traced iterations" in report
    assert "leading candidate (not named): rank" in report
    result = as_dict(detection)
    assert result["verdict"] == "inconclusive" and result["power"]["enough"] is False
    assert result["leading_candidate"]["by"] == "compute"


def test_a_long_quiet_run_is_healthy_and_says_what_it_would_have_seen():
    detection = detect(data(compute=compute_rows({}, iterations=16, noise=0.03)))
    assert detection.verdict == "healthy" and detection.leading is None
    assert detection.power.enough
    assert "power: a rank 1.2x slower than its peers would have been named: 16 iterations, noise " \
        in text_report(detection)


def test_more_iterations_turn_the_same_noise_from_inconclusive_to_healthy():
    short = detect(data(compute=compute_rows({}, iterations=6, noise=0.08)))
    assert short.verdict == "inconclusive" and short.power.needed > 6
    assert short.power.needed == iterations_needed(short.power.noise)
    longer = detect(data(compute=compute_rows({}, iterations=2 * short.power.needed, noise=0.08)))
    assert longer.verdict == "healthy" and longer.power.enough


def test_a_rank_a_quarter_slower_is_named_in_a_short_run():
    detection = detect(data(compute=compute_rows({1: 1.25}, iterations=8, noise=0.05)))
    assert suspect_ranks(detection) == [1] and detection.verdict == "suspects"


def bucket_collectives(late_iterations: dict[int, list[int]], *, iterations: int, buckets: int = 10,
                       lateness_ms: float = 2.0):
    """DP=4 bucket all-reduces: per iteration the ranks in late_iterations[it] arrive
    `lateness_ms` late at every bucket (a backward that ran late is late at all of them)."""
    rows, instance = [], 0
    for it in range(iterations):
        for bucket in range(buckets):
            base = it * 1e8 + bucket * 1e6
            for rank in range(4):
                late = lateness_ms * 1e6 if rank in late_iterations.get(it, []) else (rank * 7 + bucket) % 4 * 1e3
                rows.append((instance, rank, base + late, base + 3e6, 4, 0, it))
            instance += 1
    return {name: np.array(column, dtype=np.int64) for name, column in
            zip(("instance", "rank", "arrive", "end", "group_size", "kind", "iteration"), zip(*rows))}


def iteration_spans(iterations: int, ms: float = 100.0):
    return table([(r, it, it * 1e8, it * 1e8 + ms * 1e6) for it in range(iterations) for r in range(4)],
                 ("rank", "iteration", "start", "end"))


def test_arrival_counts_iterations_not_buckets():
    """Rank 2 late at every bucket of 3 of 8 iterations: 34 of 64 collectives (16 by chance) is
    5 standard errors as independent draws, but three iterations of eight is no pattern."""
    job = data(iterations=iteration_spans(8, ms=10.0))
    job.collectives = bucket_collectives({1: [2], 4: [2], 6: [2]}, iterations=8, buckets=8)
    job.group_kinds = ["DATA_PARALLEL_GROUP"]
    finding = arrival_order(job).findings[2]
    assert finding.last == 34 and finding.iterations == 8
    binomial_z = (34 - 16) / np.sqrt(64 * 0.25 * 0.75)
    assert binomial_z > 5.0 and finding.z < 3.0 and not finding.flagged
    # Late at every iteration, costing a fifth of each: named.
    job.collectives = bucket_collectives({it: [2] for it in range(8)}, iterations=8)
    assert arrival_order(job).findings[2].flagged


def test_lateness_that_costs_the_job_nothing_names_nobody():
    """Last at every bucket of every iteration, but 1 ms behind in 100 ms iterations: 1% of the job."""
    job = data(iterations=iteration_spans(8, ms=100.0))
    job.collectives = bucket_collectives({it: [3] for it in range(8)}, iterations=8, lateness_ms=1.0)
    job.group_kinds = ["DATA_PARALLEL_GROUP"]
    finding = arrival_order(job).findings[3]
    assert finding.z > 5 and finding.cost_share < 0.05 and not finding.flagged
    job.collectives = bucket_collectives({it: [3] for it in range(8)}, iterations=8, lateness_ms=10.0)
    assert arrival_order(job).findings[3].flagged


def test_a_rank_named_by_two_routes_is_one_suspect():
    """No compute spans (a job traced without them): rank 1 starved of CPU and last at its
    collectives is named once, with both lines of evidence."""
    job = data(host=host_rows({1: 6.0}), iterations=iteration_spans(12, ms=10.0))
    job.collectives = bucket_collectives({it: [1] for it in range(12)}, iterations=12)
    job.group_kinds = ["DATA_PARALLEL_GROUP"]
    detection = detect(job)
    assert [s.ranks for s in detection.suspects] == [[1]]
    suspect = detection.suspects[0]
    assert any(line.startswith("starved of CPU") for line in suspect.evidence)
    assert any("arrived last" in line for line in suspect.evidence)
    assert set(suspect.named_by) >= {"host", "arrival"}
