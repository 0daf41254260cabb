"""Detection as jobs grow: false alarms controlled per job, a slow node named as the node, and
per-node summaries that name what the full analysis names (in one process and over
torch.distributed). benchmarks/detection_scale.py measures the same at 64-16,384 ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from megatron.scan.detect import detect
from megatron.scan.detect.collective import resolve_arrivals
from megatron.scan.detect.model import busy_compute, unique_rows
from megatron.scan.detect.multiplicity import (
    COMPUTE_MEASURES,
    JOB_FALSE_ALARM,
    MedianNull,
    chance_of_late_run,
    compute_floor,
    job_threshold,
)
from megatron.scan.detect.report import suspect_ranks, text_report
from megatron.scan.detect import reference
from megatron.scan.detect.summary import merge, restrict, split_by_node, summarize_in_process
from megatron.scan.detect.typical import group_median
from megatron.scan.speed import peer_median
from megatron.scan.synthetic_job import Fault, JobSpec, synthesize

ROOT = Path(__file__).resolve().parents[2]


def names(detection) -> list[tuple[str, list[int]]]:
    return [(s.kind, s.ranks) for s in detection.suspects]


def test_the_bar_rises_with_the_ranks_compared_and_small_jobs_keep_theirs():
    assert job_threshold(3.5, 4) == 3.5  # tuned on 4-16 ranks: unchanged there
    assert job_threshold(3.5, 16) == 3.5
    bars = [job_threshold(3.5, n) for n in (256, 1024, 4096, 16384)]
    assert bars == sorted(bars) and bars[0] > 3.5 and 4.5 < bars[2] < 4.8


def test_the_compute_floor_is_lower_only_where_an_iteration_is_measured_precisely():
    assert compute_floor(0.02) == pytest.approx(1.05)  # GPU-like: a 1.1x device can be named
    assert compute_floor(0.2) == pytest.approx(1.2)  # a shared CPU host: as tuned there
    assert compute_floor(float("nan")) == pytest.approx(1.2)
    assert compute_floor(0.05) < compute_floor(0.055) < compute_floor(0.06) == pytest.approx(1.2)


def test_a_run_of_slow_iterations_is_judged_against_how_often_any_rank_has_one():
    rng = np.random.default_rng(0)
    pool = rng.normal(0, 0.03, 64 * 20)
    pool[rng.random(len(pool)) < 0.07] += 0.2  # heavy tail: 7% of iterations 1.2x
    # Two tail iterations at the end: common among 64 ranks x 16 splits.
    assert chance_of_late_run(pool, np.array([0.2, 0.25]), 64 * 16) > JOB_FALSE_ALARM
    # Ten such iterations in a row: a fault that began.
    assert chance_of_late_run(pool, np.full(10, 0.2), 64 * 16) < JOB_FALSE_ALARM


def test_a_run_after_a_baseline_that_fell_low_by_chance_is_not_rare():
    rng = np.random.default_rng(1)
    series = rng.normal(0, 0.03, (4096, 20))
    series[rng.random(series.shape) < 0.07] += 0.3  # heavy tail: 7% of iterations 1.35x
    medians = np.median(series, axis=1)
    pool = (series - medians[:, None]).ravel()
    split, tests = 13, 4096 * 16
    errors = np.median(series[:, :split], axis=1) - medians
    # Seven iterations ending a series, all at least 0.06 above a baseline of 13 iterations: as
    # independent values, rare enough to name; but they share that baseline, and where it fell
    # low by chance all of them stand higher: a run like this is within the budget's chance.
    later = np.array([0.33, 0.72, 0.33, 0.08, 0.45, 0.06, 0.37])
    independent = chance_of_late_run(pool, later, tests)
    shared = chance_of_late_run(pool, later, tests, errors)
    assert independent < JOB_FALSE_ALARM / COMPUTE_MEASURES < shared
    # A baseline measured without error: the values are independent, q^k as before.
    assert chance_of_late_run(pool, later, tests, np.zeros(100)) == pytest.approx(independent)
    # A fault that began: ten iterations 1.35x, each past nearly every healthy value.
    assert chance_of_late_run(pool, np.full(10, 0.25), tests, errors) < JOB_FALSE_ALARM / COMPUTE_MEASURES


def test_a_median_lifted_by_tail_iterations_is_chance_and_a_burst_in_half_of_them_is_not():
    rng = np.random.default_rng(2)
    ranks, n = 4096, 20
    series = rng.normal(0, 0.034, (ranks, n)) + rng.normal(0, 0.01, (ranks, 1))  # noise + device spread
    tails = rng.random(series.shape) < 0.07  # 7% of iterations 1.15x-2x
    series[tails] += rng.uniform(np.log(1.15), np.log(2.0), tails.sum())
    medians = np.median(series, axis=1)
    spread = 1.4826 * np.median(np.abs(medians - np.median(medians)))
    null = MedianNull((series - medians[:, None]).ravel(), spread, n)
    budget, tests = JOB_FALSE_ALARM / COMPUTE_MEASURES, ranks * COMPUTE_MEASURES
    # A healthy rank of a synthetic 4,096-rank job: a few tail iterations of twenty lift its median
    # to 1.07x, 4.8 spreads in its job, past the normal bar on the spread, which named it.
    lifted = np.log([1.002, 1.08, 1.04, 1.06, 1.088, 1.108, 0.99, 1.577, 0.985, 1.542, 1.356, 0.995, 1.141,
                     0.995, 1.08, 0.987, 1.009, 1.868, 1.082, 1.007])
    assert np.median(lifted) / spread > 4.5  # about the bar of 4,096 ranks (4.79)
    assert null.chance(float(np.median(lifted)), n, tests, own=lifted - np.median(lifted)) > budget
    # A rank 1.5x slow in half its iterations (a burst): ten such values are not chance.
    burst = np.r_[np.zeros(10), np.full(10, np.log(1.5))]
    assert null.chance(float(np.median(burst)), n, tests, own=burst - np.median(burst)) < budget
    # Nor is a device 1.15x slower in every iteration.
    slow = np.full(n, np.log(1.15)) + rng.normal(0, 0.034, n)
    assert null.chance(float(np.median(slow)), n, tests, own=slow - np.median(slow)) < budget


@pytest.mark.parametrize("seed", [2070714045, 1169389137])
def test_healthy_4096_rank_jobs_that_named_a_rank_name_nobody(seed):
    """Two of the five healthy 4,096-rank synthetic jobs (benchmarks/detection_scale.py, seed 1)
    that named a rank before the compute tests shared the job's budget: a rank whose last seven
    iterations, five of them tail iterations, followed a low baseline (read as an onset 1.40x),
    and one whose tail iterations lifted its busy total's median to 1.07x."""
    data, truth = synthesize(JobSpec(tp=8, pp=8, dp=64, ranks_per_node=8, seed=seed))
    assert truth.healthy
    assert names(detect(data)) == []


def test_a_rank_1_1x_slower_among_4096_is_named():
    data, truth = synthesize(JobSpec(tp=8, pp=8, dp=64, ranks_per_node=8, seed=11,
                                     faults=(Fault("slow_rank", ranks=(1809,), factor=1.1),)))
    assert ("rank", [1809]) in names(detect(data))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_healthy_jobs_with_heavy_tailed_iterations_name_nobody(seed):
    """The default calibration has the recorded H100 run's occasional slow iterations (7% of them
    1.15x or more): a rank whose last two iterations were such used to read as an onset."""
    data, truth = synthesize(JobSpec(tp=2, pp=4, dp=8, seed=seed))
    assert truth.healthy
    assert names(detect(data)) == []


def test_a_rank_1_1x_slower_is_named_on_quiet_ranks():
    data, truth = synthesize(JobSpec(tp=2, pp=4, dp=8, seed=4, faults=(Fault("slow_rank", ranks=(21,), factor=1.1),)))
    detection = detect(data)
    assert names(detection)[:1] == [("rank", [21])]


def test_a_slow_node_is_named_as_the_node_and_reported_with_its_ranks():
    data, truth = synthesize(JobSpec(tp=2, pp=4, dp=8, seed=3, faults=(Fault("slow_node", node=2, factor=1.2),)))
    detection = detect(data)
    assert names(detection) == [("node", list(range(16, 24)))]
    node = detection.suspects[0]
    assert node.details["host"] == "node2" and node.evidence[0].startswith("8 of the 8 ranks of host node2")
    assert node.describe(data) == "node node2 (8 ranks: 16-23)"
    assert suspect_ranks(detection) == list(range(16, 24))
    assert "1. node node2 (8 ranks: 16-23)" in text_report(detection)


def test_two_slow_ranks_on_one_node_stay_ranks():
    data, _ = synthesize(JobSpec(tp=2, pp=4, dp=8, seed=5, faults=(Fault("slow_rank", ranks=(17, 20), factor=1.4),)))
    assert sorted(names(detect(data))) == [("rank", [17]), ("rank", [20])]


@pytest.mark.parametrize("peers", [None, 8])
@pytest.mark.parametrize("faults", [(), (Fault("slow_rank", ranks=(37,), factor=1.3),),
                                    (Fault("slow_node", node=1, factor=1.25),),
                                    (Fault("slow_link", ranks=(33, 65), factor=30.0),)])
def test_per_node_summaries_name_what_the_full_analysis_names(faults, peers, monkeypatch):
    """peers=8: stages of 32 ranks compared with 8 reference ranks each (what a stage of more than
    REFERENCE_PEERS ranks gets): the nodes compare the other ranks, rank 0 holds 8 ranks' rows."""
    if peers is not None:
        monkeypatch.setattr(reference, "REFERENCE_PEERS", peers)
    data, _ = synthesize(JobSpec(tp=2, pp=4, dp=16, seed=7, faults=faults))
    full = detect(data)
    parts = split_by_node(data, 8)
    combined, cost = summarize_in_process(parts)
    # Rank 0 gets the cross-node collective rows only: the TP instances were resolved on the nodes.
    assert len(combined.collectives["instance"]) < len(data.collectives["instance"]) / 2
    held = np.unique(combined.compute["rank"])
    assert len(held) == (4 * peers if peers else 128) and np.array_equal(np.unique(combined.p2p["dst"]),
                                                                           np.intersect1d(held, data.p2p["dst"]))
    per_node = detect(combined)
    assert names(per_node) == names(full)
    assert per_node.verdict == full.verdict
    for rank, finding in full.compute.findings.items():
        other = per_node.compute.findings[rank]
        for field in ("flagged", "slowdown", "z", "typical_slowdown", "typical_z", "instances", "slow_instances",
                      "task_slowdown", "worst_ops", "onset_iteration", "chance"):
            assert getattr(other, field) == getattr(finding, field) or (
                getattr(other, field) != getattr(other, field) and getattr(finding, field) != getattr(finding, field)
            ), (rank, field)
    assert {k: (v.z, v.flagged) for k, v in per_node.pipeline.links.items()} == {
        k: (v.z, v.flagged) for k, v in full.pipeline.links.items()}
    assert per_node.pipeline.producer_wait_ms == pytest.approx(full.pipeline.producer_wait_ms)
    assert per_node.arrival.instances == full.arrival.instances
    for rank, finding in full.arrival.findings.items():
        other = per_node.arrival.findings[rank]
        assert (other.last, other.instances) == (finding.last, finding.instances)
        assert other.z == pytest.approx(finding.z) and other.cost_share == pytest.approx(finding.cost_share)
    # restrict then merge (what each node would hold, put back together) gives back every row of the job.
    again = merge([restrict(data, range(8 * i, 8 * i + 8)) for i in range(len(parts))])
    for name in ("compute", "collectives", "p2p", "iteration_time"):
        for column, values in getattr(data, name).items():
            assert np.array_equal(np.sort(getattr(again, name)[column]), np.sort(values)), (name, column)


def test_a_sample_of_reference_ranks_still_names_the_slow_rank_and_nobody_else(monkeypatch):
    """Stages of 32 ranks compared with 4 reference ranks: the slow rank is named whether or not
    it is one of them, and a healthy job names nobody."""
    monkeypatch.setattr(reference, "REFERENCE_PEERS", 4)
    layout = {r: role for r, role in synthesize(JobSpec(tp=2, pp=4, dp=16, seed=3, iterations=2))[0].roles.items()}
    chosen = reference.reference_ranks(layout)
    assert len(chosen) == 16
    others = [r for r in range(128) if r not in chosen and layout[r].pp == layout[int(chosen[1])].pp]
    for slow in (int(chosen[1]), others[5]):
        data, _ = synthesize(JobSpec(tp=2, pp=4, dp=16, seed=3, faults=(Fault("slow_rank", ranks=(slow,), factor=1.25),)))
        assert names(detect(data)) == [("rank", [slow])]
    assert names(detect(synthesize(JobSpec(tp=2, pp=4, dp=16, seed=3))[0])) == []


def test_leave_one_out_medians_equal_the_median_of_the_others():
    rng = np.random.default_rng(2)
    for _ in range(200):
        values = np.round(rng.normal(size=(int(rng.integers(1, 5)), int(rng.integers(1, 8)))), 1)
        values[rng.random(values.shape) < 0.3] = np.nan
        got = peer_median(values)
        for i, row in enumerate(values):
            for j in range(len(row)):
                others = np.delete(row, j)
                others = others[~np.isnan(others)]
                want = np.median(others) if len(others) else np.nan
                assert (np.isnan(want) and np.isnan(got[i, j])) or got[i, j] == want


def test_packed_row_keys_group_as_numpy_unique_does():
    rng = np.random.default_rng(3)
    for _ in range(100):
        matrix = rng.integers(-5, 40, size=(int(rng.integers(1, 200)), int(rng.integers(1, 5))))
        keys, inverse = np.unique(matrix, axis=0, return_inverse=True)
        got_keys, got_inverse = unique_rows(matrix)
        assert np.array_equal(keys, got_keys) and np.array_equal(inverse.reshape(-1), got_inverse)


WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from megatron.scan.detect import detect, reference
    from megatron.scan.detect.summary import node_groups, restrict, summarize_on_job
    from megatron.scan.synthetic_job import Fault, JobSpec, synthesize

    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    reference.REFERENCE_PEERS = 2  # stages of 4 ranks, 2 of them the reference: the nodes compare the others
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    spec = JobSpec(tp=2, pp=2, dp=2, ranks_per_node=4, seed=11,
                   faults=(Fault("slow_rank", ranks=(5,), factor=1.5),))
    data, _ = synthesize(spec)  # every rank makes the same job and keeps what it would have traced
    combined = summarize_on_job(restrict(data, [rank]), 4, groups=node_groups(4))
    if rank == 0:
        full = detect(data)
        mine = detect(combined)
        out = {"full": [(s.kind, s.ranks) for s in full.suspects],
               "summaries": [(s.kind, s.ranks) for s in mine.suspects]}
        with open(sys.argv[4], "w") as f:
            json.dump(out, f)
    else:
        assert combined is None
    dist.barrier()
    dist.destroy_process_group()
""")


def test_summaries_gathered_over_torch_distributed_name_the_slow_rank(tmp_path):
    """Eight gloo ranks as two nodes of four: each node's first rank gathers its ranks' tables,
    then the nodes' first ranks run the three rounds (reports, the reference ranks' rows, their
    ranks' statistics against rank 0's plan) and rank 0 combines them."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store, out = tmp_path / "store", tmp_path / "names.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "8", str(store), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(8)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    result = json.loads(out.read_text())
    assert result["summaries"] == result["full"]
    assert result["full"][0] == ["rank", [5]]


def test_persistent_differences_of_healthy_devices_are_measured_among_many_ranks():
    """Healthy devices 2% apart (persistent) with quiet iterations: against the iterations' noise
    alone the slowest of 256 stands many standard errors clear; against the spread of the ranks'
    medians it is one of them. A rank 1.25x slower still stands clear of both."""
    quiet = {"rank_speed_sigma": 0.02, "iter_rank_sigma": 0.005, "iter_node_sigma": 0.005, "iter_tail_prob": 0.0}
    data, _ = synthesize(JobSpec(tp=4, pp=4, dp=16, seed=2, calibration=quiet))
    assert names(detect(data)) == []
    data, _ = synthesize(JobSpec(tp=4, pp=4, dp=16, seed=2, calibration=quiet,
                                 faults=(Fault("slow_rank", ranks=(77,), factor=1.25),)))
    assert names(detect(data)) == [("rank", [77])]


def test_group_medians_equal_numpy_median_for_even_and_uneven_groups():
    rng = np.random.default_rng(5)
    for _ in range(100):
        n = int(rng.integers(1, 300))
        groups = rng.integers(0, int(rng.integers(1, 20)), n)
        if rng.random() < 0.3:  # one group far larger than the rest: the two-key sort
            groups[: n // 2 + 1] = 0
        values = np.round(rng.normal(size=n), 1)
        values[rng.random(n) < 0.2] = np.nan
        ids, medians = group_median(values, groups)
        for g, m in zip(ids, medians):
            mine = values[(groups == g) & ~np.isnan(values)]
            assert m == np.median(mine)
        assert set(ids.tolist()) == set(groups[~np.isnan(values)].tolist())


def test_the_last_arrival_of_each_instance_is_found_as_a_sort_by_arrival_finds_it():
    rng = np.random.default_rng(6)
    for _ in range(200):
        instance = np.repeat(np.arange(int(rng.integers(1, 8))), int(rng.integers(2, 5)))
        rng.shuffle(instance)
        n = len(instance)
        t = {"instance": instance, "rank": rng.integers(0, 6, n), "arrive": rng.integers(0, 4, n) * 1000,
             "kind": rng.integers(0, 2, n), "group_size": np.full(n, 3), "iteration": rng.integers(0, 3, n)}
        order = np.lexsort((t["arrive"], t["instance"]))  # ties: the row recorded last is last
        last = np.flatnonzero(np.append(instance[order][1:] != instance[order][:-1], True))
        _, late, count = resolve_arrivals(t)
        assert count == len(last)
        assert np.array_equal(late["rank"], t["rank"][order][last])
        assert np.array_equal(late["lateness_ms"], (t["arrive"][order][last] - t["arrive"][order][last - 1]) / 1e6)


def _busy_by_loop(rank, start, end, rows, boundary, collective):
    """busy_compute's definition, rank by rank and span by span."""
    busy = []
    for row in rows:
        b = np.sort(start[(rank == rank[row]) & boundary])
        later = b[b >= end[row]]
        stop = later[0] if len(later) else end[row]
        mine = (rank == rank[row]) & collective & (start >= start[row]) & (start < stop)
        waited = np.clip(np.minimum(end[mine], stop) - np.maximum(start[mine], start[row]), 0, None).sum()
        busy.append(max(int(stop - start[row] - waited), 1))
    return busy


def test_busy_times_found_by_one_search_over_every_rank_equal_the_span_by_span_definition():
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(5, 120))
        rank = rng.integers(0, 4, n)
        start = rng.integers(0, 10_000, n).astype(np.int64) + 10**15
        end = start + rng.integers(1, 800, n)
        name = rng.integers(0, 4, n)  # 0: compute, 1: a wait boundary, 2: a collective, 3: other
        group = np.where(name == 2, 1, -1)
        flags = np.zeros(n, dtype=np.int64)
        rows, busy = busy_compute(rank, name, start, end, flags, group, np.array([0]), np.array([1]))
        want = _busy_by_loop(rank, start, end, rows, np.isin(name, [0, 1]), group >= 0)
        assert busy.tolist() == want


def test_evidence_names_many_peers_by_count_and_ranges():
    data, _ = synthesize(JobSpec(tp=2, pp=4, dp=8, seed=4, faults=(Fault("slow_rank", ranks=(21,), factor=1.5),)))
    text = detect(data).suspects[0].evidence[0]
    assert "15 ranks (16-20,22-31)" in text and "[16, 17" not in text
