"""Every DPP policy computes the same loss and per-parameter gradients as static 1F1B / interleaved
1F1B, on real 4-rank gloo jobs: PP=4, PP=4 with 2 virtual chunks, TP=2 x PP=2 (shm_tensor_rdma),
TP=2 x PP=2 with virtual chunks over torch.distributed; 20-iteration loss curves equal. The same
with backwards split into I and W (adaptive+W: --dpp-split-backward), whose W's wait for idle time."""
from __future__ import annotations

import json

import pytest

from launch import ROOT, torchrun

from megatron.app.actions import Action, Op
from megatron.app.schedule import PipelineLayout, Task
from megatron.app.simulator_actions import simulate_actions

WORKER = ROOT / "tests" / "dpp" / "workers" / "dpp_equivalence.py"
LAYOUTS = ["pp4", "pp4-vpp2", "tp2-pp2", "tp2-pp2-vpp2-torch"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("dpp_equivalence")
    proc = torchrun(WORKER, ["--out", str(out)], nproc=4, timeout=300)
    # The worker asserts equality itself (torch.testing.assert_close) and fails the job otherwise.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_every_policy_and_layout_compared_on_every_rank(compared):
    for rank_cases in compared:
        assert {(c["layout"], c["policy"]) for c in rank_cases} == {
            (layout, policy) for layout in LAYOUTS for policy in ("adaptive", "dfc", "bfc", "adaptive+W")}
        assert all(c["parameters"] > 0 for c in rank_cases)


def test_policies_really_run_different_orders(compared):
    orders = {(c["layout"], c["policy"]): c["order"] for c in compared[0]}
    for layout in LAYOUTS:
        assert orders[(layout, "adaptive")] != orders[(layout, "bfc")], layout
        assert len(orders[(layout, "dfc")]) == len(set(orders[(layout, "dfc")]))


def test_adaptive_stays_within_its_budget(compared):
    for rank_cases in compared:
        for case in rank_cases:
            if case["policy"].startswith("adaptive"):
                assert case["peak"] <= case["budget"], case


def test_split_backward_runs_every_w_and_lets_some_wait(compared):
    """With --dpp-split-backward every backward runs as I then W, each W before the iteration ends,
    and on some rank a W waits while other work runs (what it is for)."""
    waited = 0
    for rank_cases in compared:
        for case in rank_cases:
            order = case["order"]
            if case["policy"] != "adaptive+W":
                assert not any(t[0] in "IW" for t in order)
                continue
            assert not any(t.startswith("B") for t in order)
            assert sorted(t for t in order if t.startswith("W")) == sorted("W" + t[1:] for t in order if t[0] == "I")
            waited += any(t.startswith("I") and order[i + 1] != "W" + t[1:] for i, t in enumerate(order))
    assert waited > 0


def test_twenty_iteration_loss_curve(compared):
    last_stage = compared[3]  # PP=4: rank 3 computes the loss; the worker checked it equals static
    curves = {c["policy"]: c["losses"] for c in last_stage if c["layout"] == "pp4"}
    for policy, curve in curves.items():
        assert len(curve) == 20, policy
        assert curve[-1] < curve[0] - 0.05, f"{policy}: loss did not go down: {curve}"
    assert curves["adaptive"] == pytest.approx(curves["bfc"], rel=1e-5)


def test_the_simulator_runs_the_action_lists_the_runtime_executed(compared):
    """Each pipeline's recorded action lists (dynamic orders, eager receives, TP decisions aside)
    match send for receive and run to the end in the action simulator, every task once."""
    cases = [dict(case, rank=rank) for rank, rank_cases in enumerate(compared) for case in rank_cases]
    for layout_name in LAYOUTS:
        for policy in ("adaptive", "dfc", "bfc", "adaptive+W"):
            for tp_rank in (0, 1):
                pipeline = sorted((c for c in cases if c["layout"] == layout_name and c["policy"] == policy
                                   and c["tp_rank"] == tp_rank), key=lambda c: c["pp_rank"])
                if not pipeline:
                    continue
                layout = PipelineLayout(pipeline[0]["pp"], pipeline[0]["chunks"], 8, pipeline[0]["split"])
                assert [c["pp_rank"] for c in pipeline] == list(range(layout.pp_size))
                programs = [[Action(Op(op), Task.parse(task) if task else None, peer, tag, payload)
                             for op, task, peer, tag, payload in case["actions"]] for case in pipeline]
                assert all(any(a.op is Op.SEND for a in program) for program in programs)
                result = simulate_actions(layout, programs, ranks=[c["rank"] for c in pipeline])
                for rank, case in enumerate(pipeline):
                    assert [str(t) for t in result.order(rank)] == case["order"]
                    assert sorted(result.order(rank)) == sorted(layout.tasks())
