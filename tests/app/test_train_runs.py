"""4-rank CPU training runs (real torchrun + gloo) learn on the demo corpus and on mock data."""
from __future__ import annotations

import json

import pytest

from conftest import SMALL_MODEL
from launch import torchrun
from logparse import losses, validation_losses

LAYOUTS = {
    "tp2-pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "pp4-vpp2": ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                 "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8", "--micro-batch-size", "1"],
    "pp2-dp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.mark.parametrize("data", ["corpus", "mock"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_four_rank_training_learns(demo_corpus, layout, data):
    data_args = demo_corpus["args"] if data == "corpus" else ["--mock-data", "--vocab-size", "512"]
    extra = ["--eval-interval", "30", "--eval-iters", "1"] if data == "corpus" else []
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, *LAYOUTS[layout], *data_args, "--train-iters", "30", *extra],
                    nproc=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curve = {k: float(v) for k, v in losses(proc.stdout).items()}
    assert sorted(curve) == list(range(1, 31)), proc.stdout[-2000:]
    assert curve[30] < curve[1] - 0.3, f"loss did not fall: {curve[1]} -> {curve[30]}"
    if data == "corpus":
        assert 30 in validation_losses(proc.stdout)
    assert "consumed samples:" in proc.stdout and "elapsed time per iteration (ms):" in proc.stdout


def test_plugin_contract(tmp_path):
    """A plugin defined outside the package adds a flag, receives every hook in order and its
    transport carries all pipeline messages."""
    args = [*SMALL_MODEL, "--pipeline-model-parallel-size", "2", "--mock-data", "--vocab-size", "256",
            "--train-iters", "3", "--global-batch-size", "4", "--record-hooks", str(tmp_path)]
    proc = torchrun("pretrain_gpt.py", args, nproc=2,
                    extra_env={"MEGATRON_APP_PLUGINS": "tests.app.plugins_for_tests"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hook_recorder" in proc.stdout  # the start-up line lists enabled plugins
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        calls = record["calls"]
        assert calls[:3] == ["configure", "setup", "executor_transport=counting"]
        assert calls[3:7] == ["before_iteration:0", "before_optimizer_step:0", "after_optimizer_step:0",
                              "after_iteration:1"]
        assert calls[-1] == "shutdown" and calls.count("after_optimizer_step:2") == 1
        # 2 microbatches x 3 iterations: each stage sends one activation or one gradient per microbatch
        assert record["sent"] == 6 and record["received"] == 6


def test_plugin_flag_absent_without_module():
    proc = torchrun("pretrain_gpt.py", ["--help"], nproc=1)
    assert "--tensor-model-parallel-size" in proc.stdout and "--record-hooks" not in proc.stdout


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, "--mock-data", "--vocab-size", "256", "--train-iters", "3",
                                        "--global-batch-size", "4", "--tensorboard-dir", str(tmp_path)], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3]
    assert "learning-rate" in events.Tags()["scalars"]
