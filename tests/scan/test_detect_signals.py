"""Detector pieces on hand-made tables: CPU starvation from the host counters, the job-level
slowdown that turns 'no suspect' into `partial`, and per-iteration totals that see bursty
slowness the median task does not."""
from __future__ import annotations

import functools

import numpy as np

from megatron.scan.detect.combine import detect, job_slowdown_onset
from megatron.scan.detect.compute import peer_comparison
from megatron.scan.detect.host import host_starvation
from megatron.scan.detect.model import DetectionInput, RankRole
from megatron.scan.detect.multiplicity import FLOOR_MAX

RNG = np.random.default_rng(7)


def table(rows: list[tuple], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    array = np.array(rows, dtype=np.float64) if rows else np.zeros((0, len(names)))
    return {n: array[:, i] for i, n in enumerate(names)}


def data(*, world: int = 4, dp: int = 4, pp: int = 1, compute=None, host=None, iterations=None) -> DetectionInput:
    roles = {r: RankRole(rank=r, dp=r % dp, pp=r // dp, tp=0, host="node0") for r in range(world)}
    empty = lambda names: {n: np.zeros(0, dtype=np.int64) for n in names}  # noqa: E731
    return DetectionInput(
        roles=roles, sizes={"dp": dp, "pp": pp, "tp": 1},
        compute=compute or empty(("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy")),
        collectives=empty(("instance", "rank", "arrive", "end", "group_size", "kind")), group_kinds=[],
        p2p=empty(("src", "dst", "iteration", "backward", "send_start", "send_end", "recv_start", "recv_end", "bytes")),
        iteration_time=iterations or empty(("rank", "iteration", "start", "end")),
        host=host or table([], ("rank", "iteration", "cpu_ms", "cpu_wait_ms")))


def host_rows(starved: dict[int, float], iterations: int = 12) -> dict[str, np.ndarray]:
    rows = []
    for it in range(iterations):
        for rank in range(4):
            cpu = 100 * RNG.uniform(0.8, 1.2)
            wait = 150 * RNG.lognormal(0, 0.5) * starved.get(rank, 1.0)
            rows.append((rank, it, cpu, wait))
    return table(rows, ("rank", "iteration", "cpu_ms", "cpu_wait_ms"))


def test_a_starved_rank_is_found_and_healthy_contention_is_not():
    stage = host_starvation(data(host=host_rows({2: 6.0})))
    assert [r for r, f in stage.findings.items() if f.flagged] == [2]
    assert stage.findings[2].ratio > 3 and stage.findings[2].starved_iterations >= 11
    assert not any(f.flagged for f in host_starvation(data(host=host_rows({}))).findings.values())
    # Without counters (older traces, not Linux) the stage says so instead of guessing.
    assert "no host counters" in host_starvation(data()).notes[0]


def test_on_a_host_with_cores_to_spare_a_few_ms_of_wait_is_nobody_starved():
    """16 cores, 4 ranks: nobody waits for a CPU more than a few ms per iteration, and one rank's
    2 ms beside its peers' 0.3 ms is 2.3x on the all-thread measure (online detection named such
    ranks in healthy runs on an H100 machine's 16 cores). A quota there still shows: its rank's
    threads wait most of their runnable time."""
    rng, rows = np.random.default_rng(11), []  # its own draws: the module's feed other tests
    for it in range(12):
        for rank in range(4):
            cpu = 100 * rng.uniform(0.9, 1.1)
            wait = (2.0 if rank == 2 else 0.3) * rng.lognormal(0, 0.2)
            rows.append((rank, it, cpu, wait + (250 * rng.uniform(0.8, 1.2) if rank == 1 and it >= 6 else 0.0)))
    stage = host_starvation(data(host=table(rows, ("rank", "iteration", "cpu_ms", "cpu_wait_ms"))))
    assert [r for r, f in stage.findings.items() if f.flagged] == [1]
    assert stage.findings[1].wait_share > 0.5
    assert stage.findings[2].ratio > 2 and stage.findings[2].wait_share < 0.05


def real_host_counters(name: str) -> dict[str, np.ndarray]:
    """Host counters kept from a real traced run (tests/scan/data/NAME; its "about" says which)."""
    import json
    from pathlib import Path

    fixture = json.loads((Path(__file__).parent / "data" / name).read_text())
    return table([tuple(r) for r in fixture["rows"]], tuple(fixture["columns"]))


def starved_through(host: dict[str, np.ndarray], last: int, **layout) -> list[int]:
    keep = host["iteration"] <= last
    stage = host_starvation(data(world=4, host={name: column[keep] for name, column in host.items()}, **layout))
    return [rank for rank, f in stage.findings.items() if f.flagged]


def test_a_quarter_core_quota_on_a_pipeline_only_rank_is_named_from_its_host_counters():
    """Real host counters: PP=4 on a 2-core host, rank 1 under a 0.25-core quota from the start.
    With no same-stage peer, the host counters are what names it; its training thread's stretch was
    1.9x the other ranks' (the lowest of 7 such runs), which the floor used for the all-thread sums
    (2x) missed, leaving the run `partial`."""
    host = real_host_counters("host_counters_pp4_rank1_quarter_core.json")
    assert starved_through(host, 9, dp=1, pp=4) == [1]
    finding = host_starvation(data(world=4, dp=1, pp=4, host=host)).findings[1]
    assert 1.6 < finding.ratio < 2.0 and finding.training_thread and finding.onset_iteration is None


def test_the_most_contended_healthy_rank_seen_is_not_called_starved_at_any_point_of_its_run():
    """Real host counters of a healthy PP=2 x DP=2 run in which one rank waited for a CPU 1.3x as
    much as its peers (the most of 9 healthy runs): nobody is starved, after any iteration, as
    online detection would look."""
    host = real_host_counters("host_counters_pp2dp2_healthy.json")
    for last in range(3, int(host["iteration"].max()) + 1):
        assert starved_through(host, last, dp=2, pp=2) == [], last


def test_a_healthy_rank_stepping_from_less_starved_to_level_with_its_host_is_not_starved():
    """Real host counters of a healthy PP=2 x DP=2 run: rank 0 waited for a CPU about 0.7x as much
    as the other ranks for 8 iterations, then about 1.6x for 3. As a step from its own earlier
    standing that is 2.3x (it was named so); starved means starved against the other ranks on
    its host, which it never was by the floor, at any point of the run."""
    host = real_host_counters("host_counters_pp2dp2_healthy_rank0_step.json")
    for last in range(3, int(host["iteration"].max()) + 1):
        assert starved_through(host, last, dp=2, pp=2) == [], last
    # A quota-sized step on the same rank from iteration 9 on is still named from its onset (or
    # from iteration 8, which already stood above the rank's earlier level).
    throttled = {name: column.copy() for name, column in host.items()}
    late = (throttled["rank"] == 0) & (throttled["iteration"] >= 9)
    throttled["main_wait_ms"][late] += 3 * throttled["main_cpu_ms"][late]
    finding = host_starvation(data(world=4, dp=2, pp=2, host=throttled)).findings[0]
    assert finding.flagged and finding.onset_iteration in (8, 9) and finding.ratio > 2, finding


def test_a_quota_from_outside_shows_in_the_training_threads_wait_two_iterations_after_it_began():
    """Real host counters (tests/scan/data): PP=2 x DP=2 on a 2-core host, rank 1 under a 0.15-core
    cgroup quota from iteration 13. As online detection sees the run window by window, the training
    thread's stretch names rank 1 from its first two slowed iterations (analysing through 14, onset
    13) and never before; the all-thread sum, which the communication threads' wake-ups make about
    three times as noisy, needed two more iterations on the same run."""
    full = real_host_counters("host_counters_pp2dp2_rank1_quota_from_13.json")

    def through(last: int, *, training_thread: bool = True) -> dict:
        keep = full["iteration"] <= last
        host = {name: column[keep] for name, column in full.items()}
        if not training_thread:  # a trace of an older version: no training-thread counters
            host = {name: host[name] for name in ("rank", "iteration", "cpu_ms", "cpu_wait_ms")}
        stage = host_starvation(data(world=4, dp=2, pp=2, host=host))
        return {rank: f for rank, f in stage.findings.items() if f.flagged}

    for last in range(6, 14):
        assert not through(last), last
    first = through(14)
    assert list(first) == [1] and first[1].onset_iteration == 13 and first[1].training_thread
    assert list(through(23)) == [1]
    assert not through(14, training_thread=False)  # the same iterations through all threads' sums
    assert list(through(16, training_thread=False)) == [1]


def compute_rows(stalls: dict[int, float], iterations: int = 12, tasks: int = 16) -> dict[str, np.ndarray]:
    """Every task 10 ms with 10% jitter; a stalled rank loses `stall` ms in a quarter of its tasks."""
    rows = []
    for it in range(iterations):
        for rank in range(4):
            for task in range(tasks):
                busy = 10e6 * RNG.lognormal(0, 0.1)
                if rank in stalls and task % 4 == 0:
                    busy += stalls[rank] * 1e6
                rows.append((rank, it, task % 2, 0, task // 2, it * 1e9 + task * 1e7, busy))
    return table(rows, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy"))


def test_bursty_slowness_is_seen_in_iteration_totals_not_in_the_median_task():
    stage = peer_comparison(data(compute=compute_rows({1: 25.0})))
    finding = stage.findings[1]
    assert finding.task_slowdown < 1.1  # three tasks in four run at full speed
    assert finding.flagged and 1.4 < finding.slowdown < 1.9
    assert [r for r, f in stage.findings.items() if f.flagged] == [1]


def test_a_job_that_slows_with_no_named_source_is_inconclusive_not_healthy():
    rows = [(rank, it, it * 1e9, it * 1e9 + (500e6 if it < 6 else 800e6) * RNG.uniform(0.97, 1.03))
            for it in range(12) for rank in range(4)]
    iterations = table(rows, ("rank", "iteration", "start", "end"))
    onset = job_slowdown_onset(data(iterations=iterations))
    assert onset is not None and onset[0] == 6 and 1.5 < onset[1] < 1.7
    detection = detect(data(iterations=iterations, compute=compute_rows({})))
    assert detection.verdict == "inconclusive" and not detection.suspects
    assert any("slowed" in note and "no rank or link could be named" in note for note in detection.notes)
    steady = table([(r, it, it * 1e9, it * 1e9 + 500e6 * RNG.uniform(0.97, 1.03)) for it in range(12) for r in range(4)],
                   ("rank", "iteration", "start", "end"))
    assert job_slowdown_onset(data(iterations=steady)) is None
    assert detect(data(iterations=steady, compute=compute_rows({}))).verdict == "healthy"


def test_pp_only_ranks_compare_layer_by_layer():
    """DP = TP = 1: no rank has a same-stage peer, but with per-layer spans every transformer layer
    runs the same kernels on every stage; the slowed stage is named, healthy stages are not."""
    rows = []
    for it in range(10):
        for rank in range(4):
            for layer in range(2):
                for kind in (0, 1):
                    busy = 4e6 * (2 if kind else 1) * RNG.lognormal(0, 0.08) * (1.5 if rank == 2 else 1.0)
                    rows.append((rank, it, kind, rank * 2 + layer + 1, busy))
    layers = table(rows, ("rank", "iteration", "kind", "layer", "busy"))
    layers = {k: v.astype(np.int64) for k, v in layers.items()}
    pipeline = data(dp=1, pp=4, compute=compute_rows({}))
    pipeline.layers = layers
    for rank in range(4):  # stages: every rank alone in its stage
        pipeline.roles[rank] = RankRole(rank=rank, dp=0, pp=rank, tp=0, host="node0")
    stage = peer_comparison(pipeline)
    assert {f.method for f in stage.findings.values()} == {"layers"}
    assert [r for r, f in stage.findings.items() if f.flagged] == [2] and 1.4 < stage.findings[2].slowdown < 1.6
    detection = detect(pipeline)
    assert [s.ranks for s in detection.suspects] == [[2]] and "per-layer compute" in detection.suspects[0].evidence[0]


def two_rank_rows(factor) -> dict[str, np.ndarray]:
    """DP=2 (one stage of two ranks), 12 iterations of 8 tasks; factor(rank, iteration) scales a task."""
    rows = []
    for it in range(12):
        for rank in range(2):
            for task in range(8):
                busy = 10e6 * RNG.lognormal(0, 0.05) * factor(rank, it)
                rows.append((rank, it, task % 2, 0, task // 2, it * 1e9 + task * 1e7, busy))
    return table(rows, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy"))


def test_an_onset_must_be_the_ranks_own_not_its_peers_warm_up():
    """In a stage of two, a peer slow in the first iterations mirrors as a step up of the other's
    ratio; the other's own busy time did not move, so it is not an onset. A rank that does slow
    from mid-run is still found, with the iteration it began."""
    warm_peer = peer_comparison(data(world=2, dp=2, compute=two_rank_rows(lambda r, it: 2.2 if r == 1 and it < 4 else 1.0)))
    assert not any(f.flagged for f in warm_peer.findings.values())
    slowed = peer_comparison(data(world=2, dp=2, compute=two_rank_rows(lambda r, it: 1.8 if r == 0 and it >= 8 else 1.0)))
    assert slowed.findings[0].flagged and slowed.findings[0].onset_iteration == 8
    assert not slowed.findings[1].flagged


def test_a_host_wide_slowdown_is_no_onset_of_the_rank_whose_peer_is_stalled():
    """PP=2 x DP=2 on one host; rank 1 stalls 25 ms in every task, and from iteration 6 the whole
    host is busier (every rank's compute 1.3x). Rank 0's only peer is rank 1, whose busy time is
    mostly stall, so rank 0's ratio steps up; but ranks 2 and 3 slowed alike, so rank 0 is no
    onset. Rank 1 is named; rank 0 slowing alone from iteration 6 still is."""
    def rows(extra_slow_rank_0: float) -> dict[str, np.ndarray]:
        out = []
        for it in range(12):
            load = 1.3 if it >= 6 else 1.0
            for rank in range(4):
                for task in range(8):
                    busy = 10e6 * RNG.lognormal(0, 0.05) * load
                    busy *= extra_slow_rank_0 if rank == 0 and it >= 6 else 1.0
                    busy += 25e6 if rank == 1 else 0.0
                    out.append((rank, it, task % 2, 0, task // 2, it * 1e9 + task * 1e7, busy))
        return table(out, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy"))

    host_busy = peer_comparison(data(world=4, dp=2, pp=2, compute=rows(1.0)))
    assert host_busy.findings[1].flagged and not host_busy.findings[0].flagged
    rank_0_too = peer_comparison(data(world=4, dp=2, pp=2, compute=rows(1.8)))
    assert rank_0_too.findings[0].flagged and rank_0_too.findings[0].onset_iteration == 6


def pipeline_rows(factors: dict[int, float], iterations: int = 12) -> tuple[dict, dict]:
    """PP=2 x DP=2 (rank 1 and 3 form replica 1): compute tasks scaled by `factors`, and the
    replica's messages, with rank 3 waiting 20 ms for each of rank 1's activations."""
    compute, messages = [], []
    for it in range(iterations):
        for rank in range(4):
            for task in range(8):
                busy = 10e6 * RNG.lognormal(0, 0.05) * factors.get(rank, 1.0)
                compute.append((rank, it, task % 2, 0, task // 2, it * 1e9 + task * 1e7, busy))
        for microbatch in range(4):
            at = it * 1e9 + microbatch * 1e8
            for src, dst, late in ((0, 2, 0.5e6), (1, 3, 20e6)):  # forward: the receiver posts first
                messages.append((src, dst, it, 0, at + late, at + late + 1e5, at, at + late + 2e5, 4096))
            for src, dst in ((2, 0), (3, 1)):  # backward: the gradient is ready before it is wanted
                messages.append((src, dst, it, 1, at, at + 1e5, at + 5e5, at + 6e5, 4096))
    return (table(compute, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy")),
            table(messages, ("src", "dst", "iteration", "backward", "send_start", "send_end", "recv_start", "recv_end",
                             "bytes")))


def test_a_pipeline_neighbour_of_a_much_slower_rank_is_explained_unless_it_has_evidence_of_its_own():
    """On a shared host the stage after a stalled rank runs in the stalled rank's bursts and can
    compute 1.3x its peer: it is explained, not named. Starved of CPU as well, it is named."""
    compute, messages = pipeline_rows({1: 3.0, 3: 1.3})
    job = data(dp=2, pp=2, compute=compute)
    job.p2p = messages
    detection = detect(job)
    assert detection.compute.findings[3].flagged  # compute alone would name it
    assert [s.ranks for s in detection.suspects] == [[1]]
    assert any("rank 3" in note and "pipeline with rank 1" in note for note in detection.notes), detection.notes
    # Last at its collectives somewhat more often than an even share (30 of 50 with one peer,
    # 1.4 standard errors), as computing 1.3x its peer makes it, is no evidence of its own.
    rows = []
    for i in range(50):
        late = 3 if i < 30 else 2
        for rank in (2, 3):
            arrive = i * 1e7 + (1e6 if rank == late else 0)
            rows.append((i, rank, arrive, i * 1e7 + 2e6, 2, 0))
    job.collectives = {name: np.array(column, dtype=np.int64) for name, column in
                       zip(("instance", "rank", "arrive", "end", "group_size", "kind"), zip(*rows))}
    job.group_kinds = ["DATA_PARALLEL_GROUP"]
    detection = detect(job)
    assert 1.0 < detection.arrival.findings[3].z and not detection.arrival.findings[3].flagged
    assert [s.ranks for s in detection.suspects] == [[1]]
    job.host = host_rows({3: 6.0})
    assert sorted(s.ranks[0] for s in detect(job).suspects) == [1, 3]
    # Two ranks slowed alike in one pipeline: neither is the other's shadow.
    compute, messages = pipeline_rows({1: 1.6, 3: 1.6})
    alike = data(dp=2, pp=2, compute=compute)
    alike.p2p = messages
    assert sorted(s.ranks[0] for s in detect(alike).suspects) == [1, 3]


# Busy ms per iteration of a one-GPU job traced on an H100 (bf16, 8 layers, hidden 1024, seq 1024)
# while another process ran bf16 matrix products on the same GPU, starting during iteration 71.
H100_TIME_SHARED_MS = [
    488.9, 132.4, 132.1, 135.7, 141.4, 345.8, 137.6, 131.5, 138.8, 131.9, 131.9, 135.1, 135.1, 151.8, 140.9,
    139.2, 135.5, 150.5, 132.5, 131.9, 132.6, 132.5, 135.2, 133.2, 133.1, 134.9, 138.3, 138.2, 134.0, 131.7,
    136.0, 135.6, 133.0, 132.5, 186.5, 181.0, 137.6, 136.6, 138.2, 135.6, 134.6, 134.2, 134.6, 137.1, 208.4,
    137.0, 132.3, 140.1, 134.6, 140.7, 152.5, 137.2, 132.2, 133.1, 183.0, 132.2, 132.2, 131.8, 133.9, 136.0,
    147.2, 147.2, 132.6, 136.4, 148.9, 139.8, 143.9, 134.4, 133.2, 140.7, 142.1, 165.0, 191.4, 294.3, 289.2,
    297.3, 294.8, 291.9, 291.8, 299.6, 291.8, 295.2, 325.5, 298.4, 292.5, 294.9, 298.1, 296.5, 290.1, 294.9,
    274.3, 136.9, 135.2, 195.5, 186.4, 143.7, 136.7, 131.1, 136.3, 134.5]


def test_a_gpu_time_shared_mid_run_is_named_from_its_first_slow_iteration():
    """A rank with no peer is compared with its own history; the onset is where the slow part
    begins, not a few normal iterations earlier (medians alone drifted it 4 iterations early)."""
    rows = [(0, i, 0, 0, 0, i * 1e9, ms * 1e6) for i, ms in enumerate(H100_TIME_SHARED_MS)]
    compute = table(rows, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy"))
    finding = peer_comparison(data(world=1, dp=1, compute=compute)).findings[0]
    assert finding.method == "history" and finding.flagged
    assert finding.onset_iteration in (71, 72), finding
    assert 2.0 < finding.slowdown < 2.3


def test_two_starved_ranks_of_one_stage_are_both_named_though_each_keeps_pace_with_the_other():
    """PP=2 x DP=2: ranks 2 and 3 (the second stage's only two ranks) both starved of CPU. Each
    computes as fast as its one same-stage peer, which clears a starved rank only when that peer is
    not starved itself; a starved rank keeping pace with a healthy peer is still not named."""
    both = detect(data(dp=2, pp=2, compute=compute_rows({}), host=host_rows({2: 6.0, 3: 6.0})))
    assert sorted(s.ranks[0] for s in both.suspects) == [2, 3]
    # Named by starvation alone: that is the first line of the evidence (what an online warning
    # prints), not the compute comparison that cleared nobody.
    assert all(s.evidence[0].startswith("starved of CPU") and s.named_by == ["host"] for s in both.suspects)
    one = detect(data(dp=2, pp=2, compute=compute_rows({3: 25.0}), host=host_rows({2: 6.0})))
    assert one.host.findings[2].flagged and one.compute.findings[2].slowdown < 1.0
    assert [s.ranks[0] for s in one.suspects] == [3]


def test_a_host_wide_step_is_no_onset_of_a_rank_without_peers():
    """PP=2 on one host (no same-stage peers: each rank against its own history). Both stages
    stepping up 1.25x at iteration 10 is the host (a healthy run's online detection named one of
    them so); one stage stepping up 1.5x alone is that rank, from the iteration it began."""
    rng = np.random.default_rng(5)

    def rows(factor: dict[int, float]) -> dict[str, np.ndarray]:
        out = []
        for it in range(14):
            for rank in range(2):
                for task in range(8):
                    busy = 10e6 * rng.lognormal(0, 0.04) * (factor.get(rank, 1.0) if it >= 10 else 1.0)
                    out.append((rank, it, task % 2, 0, task // 2, it * 1e9 + task * 1e7, busy))
        return table(out, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy"))

    both = peer_comparison(data(world=2, dp=1, pp=2, compute=rows({0: 1.25, 1: 1.25})))
    assert {f.method for f in both.findings.values()} == {"history"}
    assert not any(f.flagged for f in both.findings.values()), both.findings
    alone = peer_comparison(data(world=2, dp=1, pp=2, compute=rows({1: 1.5})))
    assert alone.findings[1].flagged and alone.findings[1].onset_iteration == 10
    assert not alone.findings[0].flagged


def test_online_a_rank_starved_only_before_the_newest_iterations_is_not_reported():
    """Real counters of a PP=2 run on 2 ranks over 2 cores (iterations 0-6): rank 0's threads
    waited 3-14x as long as rank 1's per CPU second while a process started beside it, then rank
    1 was throttled from outside (iteration 5). Over those iterations the whole-series test calls
    rank 0 starved; online detection (`recent`) asks whether it still is, and it is not. A rank
    starved to the end is still named."""
    rows = [  # rank, iteration, cpu_ms, cpu_wait_ms, main_cpu_ms, main_wait_ms
        (0, 0, 58.4, 135.9, 54.2, 6.8), (0, 1, 48.2, 54.1, 45.4, 3.3), (0, 2, 49.3, 140.9, 45.6, 12.3),
        (0, 3, 48.9, 373.8, 44.7, 19.6), (0, 4, 50.1, 166.6, 44.7, 50.6), (0, 5, 60.5, 48.8, 51.9, 2.8),
        (0, 6, 74.5, 72.8, 58.4, 6.5),
        (1, 0, 64.5, 46.1, 60.7, 9.4), (1, 1, 56.9, 11.8, 52.3, 3.2), (1, 2, 55.0, 8.3, 51.1, 1.2),
        (1, 3, 53.7, 27.1, 49.7, 1.2), (1, 4, 57.4, 40.0, 52.3, 9.5), (1, 5, 64.5, 3539.5, 59.5, 261.4),
        (1, 6, 71.9, 7339.9, 66.6, 419.4)]
    host = table(rows, ("rank", "iteration", "cpu_ms", "cpu_wait_ms", "main_cpu_ms", "main_wait_ms"))
    pp2 = data(world=2, dp=1, pp=2, host=host)
    assert host_starvation(pp2).findings[0].flagged  # what the first online analysis reported
    assert not host_starvation(pp2, recent=3).findings[0].flagged
    assert [r for r, f in host_starvation(data(host=host_rows({2: 6.0})), recent=3).findings.items()
            if f.flagged] == [2]


def test_a_rank_starved_from_mid_run_is_named_only_if_it_falls_behind_its_peer_from_then_on():
    """PP=2 x DP=2 on one host, 14 iterations, rank 1 starved of CPU from iteration 7 on (the host
    counters of a healthy CI run on a loaded host had this). Computing as fast as its peer over
    those iterations it costs the job nothing and is not named; 15% slower than its peer from then
    on (too little for the compute comparison alone), it is named by its starvation."""
    rng = np.random.default_rng(3)

    def tables(slower: float) -> tuple[dict, dict]:
        host, compute = [], []
        for it in range(14):
            for rank in range(4):
                late = rank == 1 and it >= 7
                level = (6.0 if late else 0.5) if rank == 1 else 1.0  # less starved than the others before
                host.append((rank, it, 100 * rng.uniform(0.9, 1.1), 150 * rng.lognormal(0, 0.3) * level))
                for task in range(8):
                    busy = 10e6 * rng.lognormal(0, 0.05) * (slower if late else 1.0)
                    compute.append((rank, it, task % 2, 0, task // 2, it * 1e9 + task * 1e7, busy))
        return (table(compute, ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy")),
                table(host, ("rank", "iteration", "cpu_ms", "cpu_wait_ms")))

    compute, host = tables(1.0)
    keeps_pace = detect(data(dp=2, pp=2, compute=compute, host=host))
    assert keeps_pace.host.findings[1].flagged and keeps_pace.host.findings[1].onset_iteration == 7
    assert keeps_pace.suspects == []
    compute, host = tables(1.15)
    # The compute floor of a loaded CPU host (1.2): these tables' 5% task noise would otherwise
    # lower it (multiplicity.compute_floor) and let the compute comparison name 1.15x by itself.
    cpu_floor = functools.partial(peer_comparison, min_slowdown=FLOOR_MAX)
    behind = detect(data(dp=2, pp=2, compute=compute, host=host), compute=cpu_floor)
    assert not behind.compute.findings[1].flagged
    assert [(s.ranks, s.named_by) for s in behind.suspects] == [([1], ["host"])]
    assert behind.suspects[0].evidence[0].startswith("starved of CPU from iteration 7 on")
