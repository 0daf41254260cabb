"""The synthetic job model (megatron.scan.synthetic_job): detector input made directly, with a
known truth, for measuring detection at thousands of ranks."""
from __future__ import annotations

import numpy as np
import pytest

from megatron.scan.detect import detect
from megatron.scan.detect.model import (
    COLLECTIVE_COLUMNS,
    COMPUTE_COLUMNS,
    ITERATION_COLUMNS,
    P2P_COLUMNS,
    DetectionInput,
)
from megatron.scan.synthetic_fit import compare_statistics, job_statistics, ks_statistic
from megatron.scan.synthetic_job import (
    Fault,
    JobSpec,
    calibration_parameters,
    load_calibrations,
    node_of,
    one_f_one_b,
    synthesize,
)

# Without the whole-iteration outliers fitted to the H100 fixture, where a test reads a fault's
# size off medians (healthy jobs with the outliers: tests/scan/test_detect_scale.py).
NO_TAILS = {"iter_tail_prob": 0.0}


def _tables(data: DetectionInput) -> dict:
    return {name: getattr(data, name) for name in ("compute", "collectives", "p2p", "iteration_time")}


def test_the_same_seed_gives_the_same_job_and_another_seed_another():
    spec = JobSpec(tp=2, pp=2, dp=2, iterations=5, faults=(Fault("slow_rank", ranks=(3,), bursty=0.5),), seed=4)
    a, b, c = synthesize(spec)[0], synthesize(spec)[0], synthesize(JobSpec(tp=2, pp=2, dp=2, iterations=5, seed=5))[0]
    for name, table in _tables(a).items():
        for column, values in table.items():
            assert np.array_equal(values, _tables(b)[name][column]), (name, column)
    assert not np.array_equal(a.compute["busy"], c.compute["busy"])


def test_tables_have_the_columns_and_dtypes_of_the_real_builders():
    data, _ = synthesize(JobSpec(tp=2, pp=2, dp=2, iterations=3))
    expected = {"compute": COMPUTE_COLUMNS, "collectives": (*COLLECTIVE_COLUMNS, "iteration"), "p2p": P2P_COLUMNS,
                "iteration_time": ITERATION_COLUMNS}
    for name, table in _tables(data).items():
        assert tuple(table) == tuple(expected[name]), name
        assert all(v.dtype == np.int64 for v in table.values()), name
        assert len({len(v) for v in table.values()}) == 1 and len(table[next(iter(table))]) > 0, name
    assert data.group_kinds == sorted(data.group_kinds)
    assert set(np.unique(data.collectives["kind"])) == {0, 1, 2}
    assert data.sizes == {"dp": 2, "pp": 2, "tp": 2}
    # megatron-core's order: tp fastest, then dp, then pp; ranks live on nodes of ranks_per_node.
    role = data.roles[5]
    assert (role.tp, role.dp, role.pp, role.host) == (1, 0, 1, "node0")
    assert synthesize(JobSpec(tp=2, pp=2, dp=4, ranks_per_node=4))[0].roles[13].host == f"node{node_of(13, 4)}" == "node3"
    assert len(data.compute["rank"]) == 8 * 3 * 2 * 4  # ranks x iterations x (F, B) x microbatches
    assert np.all(data.iteration_time["end"] > data.iteration_time["start"])
    assert np.all(data.collectives["end"] >= data.collectives["arrive"])


def test_one_f_one_b_puts_every_task_after_what_it_needs():
    order = one_f_one_b(4, 8)
    assert len(order) == len(set(order)) == 2 * 4 * 8
    seen = set()
    for p, kind, m in order:
        if kind == 0 and p > 0:
            assert (p - 1, 0, m) in seen
        if kind == 1:
            assert (p, 0, m) in seen and (p == 3 or (p + 1, 1, m) in seen)
        seen.add((p, kind, m))


def test_the_truth_matches_the_faults():
    spec = JobSpec(tp=2, pp=2, dp=4, ranks_per_node=4, faults=(
        Fault("slow_rank", ranks=(5,)), Fault("slow_node", node=3), Fault("slow_link", ranks=(1, 9), factor=20)))
    truth = synthesize(spec)[1]
    assert truth.slow_ranks == {5, 12, 13, 14, 15} and truth.slow_nodes == {3} and truth.slow_links == {(1, 9)}
    assert truth.hung_rank is None and not truth.healthy
    assert synthesize(JobSpec(tp=2, pp=2, dp=2))[1].healthy
    with pytest.raises(ValueError):
        synthesize(JobSpec(tp=2, pp=2, dp=2, faults=(Fault("slow_link", ranks=(0, 1)),)))


def test_a_slow_node_slows_every_rank_of_it_and_only_those():
    spec = JobSpec(tp=2, pp=2, dp=4, ranks_per_node=4, iterations=6, faults=(Fault("slow_node", node=1, factor=1.5),),
                   calibration=NO_TAILS)
    data = synthesize(spec)[0]
    c = data.compute
    median = {r: float(np.median(c["busy"][(c["rank"] == r) & (c["iteration"] > 0)])) for r in data.world}
    for rank in range(4, 8):  # node 1, stage 0: its peers are ranks 0-3
        assert median[rank] / np.median([median[r] for r in range(4)]) > 1.35
    assert max(median[r] for r in range(4)) / min(median[r] for r in range(4)) < 1.1


def test_a_slow_link_delays_its_messages_and_a_hang_stops_its_rank():
    data = synthesize(JobSpec(tp=2, pp=2, dp=2, faults=(Fault("slow_link", ranks=(1, 5), factor=20),)))[0]
    p = data.p2p
    delivery = p["recv_end"] - np.maximum(p["send_start"], p["recv_start"])
    on_link = (p["src"] == 1) & (p["dst"] == 5)
    assert on_link.any() and np.median(delivery[on_link]) > 5 * np.median(delivery[~on_link])
    data, truth = synthesize(JobSpec(tp=2, pp=2, dp=2, iterations=8, faults=(Fault("hang", ranks=(2,),
                                                                                   start_iteration=5),)))
    assert truth.hung_rank == 2
    assert data.compute["iteration"][data.compute["rank"] == 2].max() == 4
    assert not np.isin(2, data.iteration_time["rank"][data.iteration_time["iteration"] >= 5])
    c = data.collectives
    waiting = c["end"] == c["end"].max()  # the collectives nobody leaves: they end with the window
    assert waiting.sum() >= 2 and not np.isin(2, c["rank"][waiting]) and np.all(c["iteration"][waiting] == 5)


@pytest.mark.parametrize("layout", [(2, 2, 4), (2, 4, 8)], ids=["16 ranks", "64 ranks"])
def test_detection_names_the_slow_rank_and_nobody_in_a_healthy_job(layout):
    tp, pp, dp = layout
    slow = synthesize(JobSpec(tp=tp, pp=pp, dp=dp, faults=(Fault("slow_rank", ranks=(5,), factor=1.5),)))[0]
    assert detect(slow).suspects[0].ranks == [5]
    healthy = detect(synthesize(JobSpec(tp=tp, pp=pp, dp=dp))[0])
    assert healthy.suspects == [], [s.evidence[0] for s in healthy.suspects]


def test_a_synthetic_job_compared_with_another_seed_of_itself_fits():
    a = job_statistics(synthesize(JobSpec(tp=2, pp=2, dp=4, seed=1, calibration="cpu-gloo"))[0])
    b = job_statistics(synthesize(JobSpec(tp=2, pp=2, dp=4, seed=2, calibration="cpu-gloo"))[0])
    rows = compare_statistics(a, b)
    assert {r["statistic"] for r in rows} >= {"task_busy_ratio", "arrival_lateness", "p2p_delivery_ms", "iteration_ms"}
    same = compare_statistics(a, a)
    assert all(r["ks"] == 0.0 for r in same)
    # Task-level samples are many: another seed stays close; per-rank ones are few.
    for row in rows:
        assert row["ks"] < (0.1 if row["real_n"] > 500 else 0.5), row
    assert ks_statistic(np.arange(10), np.arange(10) + 100) == 1.0


def test_calibrations_are_complete_and_documented():
    table = load_calibrations()
    assert {"default", "gpu", "cpu-gloo"} <= set(table)
    keys = set(calibration_parameters("gpu"))
    for name in ("cpu-gloo", "default"):
        assert set(calibration_parameters(name)) == keys
    for name in ("gpu", "cpu-gloo"):
        assert set(table[name]["obtained"]) >= set(table[name]["parameters"]), name
    assert calibration_parameters({"task_sigma": 0.5})["task_sigma"] == 0.5
    assert table["default"]["base"] == "gpu" and calibration_parameters("default")["iter_node_sigma"] > 0
