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
                              "after_iteration:0"]
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


def test_megatron_core_schedule_in_the_trainer(tmp_path):
    """`--pipeline-schedule megatron-core` (interleaved PP=2 x 2 chunks, traced) prints the same loss
    curve as the trainer's own executor, and the trace has a forward and a backward span for every
    (chunk, microbatch) of every traced iteration, and megatron-core's P2P transfers all linked."""
    args = [*SMALL_MODEL, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--mock-data", "--vocab-size", "256", "--train-iters", "4"]
    ours = torchrun("pretrain_gpt.py", args, nproc=2)
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-3000:]
    traced = ["--trace", "--trace-dir", str(tmp_path), "--trace-interval", "2", "--continuous-trace-iterations", "1"]
    theirs = torchrun("pretrain_gpt.py", [*args, "--pipeline-schedule", "megatron-core", *traced], nproc=2)
    assert theirs.returncode == 0, theirs.stdout[-3000:] + theirs.stderr[-3000:]
    assert "schedule megatron-core" in theirs.stdout
    assert losses(theirs.stdout) == losses(ours.stdout) and len(losses(ours.stdout)) == 4

    from megatron.scan.trace_format import read_rank_file

    microbatches = 16 // 2  # global batch / micro batch, dp = 1
    files = sorted(tmp_path.glob("benchmark-*.json"))
    assert len(files) == 2
    for path in files:
        trace = read_rank_file(path)
        c = trace.columns
        spans = {(trace.names[n], int(ch), int(mb), int(it))
                 for n, ch, mb, it in zip(c["name"], c["chunk"], c["microbatch"], c["iteration"])
                 if trace.names[n] in ("forward", "backward")}
        traced_iterations = {it for *_, it in spans}
        assert len(traced_iterations) == 2, (path.name, traced_iterations)
        expected = {(kind, chunk, mb, it) for kind in ("forward", "backward") for chunk in (0, 1)
                    for mb in range(microbatches) for it in traced_iterations}
        assert spans == expected, (path.name, sorted(expected ^ spans)[:5])

    from megatron.scan.aggregate import aggregate

    summary = aggregate(tmp_path, tmp_path / "merged.json", jobs=1).summary()
    # megatron-core's own P2P: per microbatch 3 activations forward (4 virtual stages) and 3 gradients back
    assert summary["p2p_links"] == 2 * microbatches * 6, summary
    assert summary["p2p_unmatched_sends"] == 0 and summary["p2p_unmatched_recvs"] == 0, summary


def test_megatron_core_schedule_refuses_a_plugin_that_replaces_the_pipeline():
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, "--pipeline-model-parallel-size", "2", "--mock-data",
                                        "--vocab-size", "256", "--train-iters", "2",
                                        "--pipeline-schedule", "megatron-core", "--use-dpp"], nproc=2)
    assert proc.returncode != 0
    assert ("--pipeline-schedule megatron-core cannot run with the dpp plugin, which replaces the pipeline's "
            "executor, transport") in proc.stderr
