"""Slow-rank detection on real 4-rank CPU training runs with an injected slowdown: a healthy run
names nobody; a rank slowed 2x is named (DP=1, so only its TP peer and the arrivals tell)."""
from __future__ import annotations

import json

import pytest

from launch import python, torchrun

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
         "--device", "cpu", "--train-iters", "8", "--trace", "--trace-interval", "1",
         "--continuous-trace-iterations", "1"]

RUNS = {
    "healthy_pp2_dp2": (["--pipeline-model-parallel-size", "2"], []),
    "slow2_tp2_pp2": (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
                      ["--inject-slowdown", "2:2.0"]),
}
EXPECTED = {"healthy_pp2_dp2": [], "slow2_tp2_pp2": [2]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    result = {}
    for name, (layout, inject) in RUNS.items():
        trace_dir = tmp_path_factory.mktemp(name)
        proc = torchrun("pretrain_gpt.py", [*MODEL, *layout, *inject, "--trace-dir", str(trace_dir)], nproc=4,
                        timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        result[name] = trace_dir
    return result


@pytest.mark.parametrize("name", sorted(RUNS))
def test_real_run_suspects(runs, name):
    trace_dir = runs[name]
    proc = python(["scripts/aggregate.py", "-b", str(trace_dir), "-d", "-j", "1"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((trace_dir / "abnormal.json").read_text())
    named = [s["ranks"][0] for s in result["suspects"] if s["kind"] == "rank"]
    assert named == EXPECTED[name], proc.stdout
    lines = (trace_dir / "abnormal.txt").read_text().splitlines()
    assert lines == [f"{r} {c}" for r, c in zip(named, ["0-1-0"] * len(named))]
    assert (trace_dir / "report.html").exists()
