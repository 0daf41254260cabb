"""Split backwards and zero-bubble orders on real 4-rank gloo jobs with megatron-core's GPTModel:
the split 1F1B (each B as I then W), zb-h1 and zb-h2 give the unsplit schedule's losses and every
parameter gradient bit for bit (the worker asserts it with torch.equal and fails otherwise), over
PP=4, PP=2 x DP=2, TP=2 x PP=2, full and selective recomputation, and virtual stages (PP=2 and
PP=4 with 2 chunks each). What the executor ran is what the IR's pass lowered from the order, and
the action simulator runs those lists to the same order."""
from __future__ import annotations

import json

import pytest

from launch import ROOT, torchrun

from megatron.app.actions import Action, Op, lower
from megatron.app.schedule import PipelineLayout, Task, parse_schedule
from megatron.app.simulator_actions import simulate_actions

WORKER = ROOT / "tests" / "app" / "workers" / "zero_bubble_grads.py"
LAYOUTS = ["pp4", "pp2-dp2", "tp2-pp2", "tp2-pp2-recompute", "pp2-dp2-selective", "pp2-dp2-vpp2", "pp4-vpp2"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero_bubble")
    proc = torchrun(WORKER, ["--out", str(out)], nproc=4, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    cases = []
    for rank in range(4):
        cases += [dict(case, rank=rank) for case in json.loads((out / f"rank{rank}.json").read_text())]
    return cases


def _static(case) -> str:
    return "interleaved" if case["chunks"] > 1 else "1f1b"


def test_every_layout_and_schedule_compared_on_every_rank(compared):
    for rank in range(4):
        seen = {(c["layout"], c["schedule"]) for c in compared if c["rank"] == rank}
        for layout in LAYOUTS:
            static = "interleaved" if "vpp" in layout else "1f1b"
            assert {s for l, s in seen if l == layout} == {static, f"{static}-split", "zb-h1", "zb-h2"}, layout
    assert all(c["parameters"] > 0 for c in compared)


def test_the_zero_bubble_orders_really_defer_weight_gradients(compared):
    """Each zero-bubble run splits every backward, and on some rank of each layout a W waits
    (else it would be the split 1F1B order)."""
    for layout in LAYOUTS:
        for schedule in ("zb-h1", "zb-h2"):
            cases = [c for c in compared if c["layout"] == layout and c["schedule"] == schedule]
            assert all(not any(t.startswith("B") for t in c["order"]) for c in cases)
            deferred = [c["pp_rank"] for c in cases
                        if any(t.startswith("I") and c["order"][i + 1] != "W" + t[1:] for i, t in enumerate(c["order"]))]
            assert deferred, f"{layout} {schedule}: every W ran right after its I"


def test_last_stage_losses_equal_unsplit(compared):
    for layout in LAYOUTS:
        last = [c for c in compared if c["layout"] == layout and c["pp_rank"] == c["pp"] - 1 and c["tp_rank"] == 0]
        by_schedule = {}
        for case in last:
            by_schedule.setdefault(case["schedule"], []).extend(case["losses"])
        values = list(by_schedule.values())
        assert values[0] and all(v == values[0] for v in values), layout


def test_the_executor_ran_what_the_pass_lowered_and_the_simulator_runs_it(compared):
    for layout_name in LAYOUTS:
        for schedule in {c["schedule"] for c in compared if c["layout"] == layout_name}:
            for dp_rank in (0, 1):
                for tp_rank in (0, 1):
                    pipeline = sorted((c for c in compared if c["layout"] == layout_name and c["schedule"] == schedule
                                       and c["dp_rank"] == dp_rank and c["tp_rank"] == tp_rank),
                                      key=lambda c: c["pp_rank"])
                    if not pipeline:
                        continue
                    first = pipeline[0]
                    layout = PipelineLayout(first["pp"], first["chunks"], first["microbatches"], first["split"])
                    programs = [[Action(Op(op), Task.parse(task) if task else None, peer, tag, payload)
                                 for op, task, peer, tag, payload in case["actions"]] for case in pipeline]
                    ranks = [c["rank"] for c in pipeline]
                    for position, (case, program) in enumerate(zip(pipeline, programs)):
                        assert case["order"] == case["static_order"]
                        expected = lower(layout, position, parse_schedule(" ".join(case["static_order"])),
                                         ranks=ranks, step=False)
                        assert program == expected, f"{layout_name} {schedule} pp rank {position}"
                    result = simulate_actions(layout, programs, ranks=ranks)
                    for position, case in enumerate(pipeline):
                        assert [str(t) for t in result.order(position)] == case["order"]


def test_zb_h1_keeps_1f1b_memory_and_reports_bytes(compared):
    """No rank of a zb-h1 pipeline holds more microbatch activations than 1F1B's busiest rank
    (what the executor counted: forwards whose B, or W, had not run)."""
    for layout in LAYOUTS:
        cases = [c for c in compared if c["layout"] == layout]
        unsplit = max(c["peak_stored"] for c in cases if c["schedule"] == _static(c))
        assert max(c["peak_stored"] for c in cases if c["schedule"] == "zb-h1") <= unsplit, layout
        assert all(c["peak_bytes"] > 0 for c in cases)
