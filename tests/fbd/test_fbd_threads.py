"""Several forward instances in one process (`--forward-instances-per-process 2`, PP=2: two
backward ranks + one forward host whose two threads are the stages): the weight hand-off runs
through the communication coordinator, and the run equals the one-instance-per-process FBD run."""
from __future__ import annotations

import pytest
import torch

from fbd_runs import assert_same_training, launch, weights
from test_fbd_equivalence import EVAL, fbd_run, launch_dir, read_losses

THREADED = ("--pipeline-model-parallel-size", "2", "--forward-backward-disaggregating",
            "--forward-instances-per-process", "2")


def test_threaded_forward_host_equals_one_instance_per_process():
    reference = fbd_run("pp2")  # 4 ranks: one forward instance per process
    run = launch("pp2-threaded-fbd", 3, (*THREADED, *EVAL))
    assert "rank   2: fwd instance of replica 0 stage 1 tp 0/1 (thread 1)" in run["stdout"]
    assert sorted(run["losses"]) == list(range(1, 21)), run["stdout"][-2000:]
    assert run["losses"] == reference["losses"]
    assert run["validation"] == reference["validation"] and sorted(run["validation"]) == [10, 20]
    expected, got = weights(reference["ckpt"]), weights(run["ckpt"])
    assert expected and set(got) == set(expected)
    for key in expected:  # the backward instances compute the same thing from the same inputs
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


TP2_PP2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")


@pytest.mark.parametrize("name,nproc,threaded,baseline_nproc,baseline_layout", [
    # One host runs the forward instances of two replicas (PP=1): 2 backward ranks + 1 host.
    ("two-replicas-per-host", 3, ("--forward-instances-per-process", "2"), 2, ()),
    # TP=2 backward instances, merged forward stages as two threads of one host: 4 + 1 ranks.
    ("tp2-pp2-merged", 5, (*TP2_PP2, "--ignore-forward-tensor-parallel", "--forward-instances-per-process", "2"),
     4, TP2_PP2),
])
@pytest.mark.slow  # 25-56 s on 2 cores
def test_threaded_layouts_equal_the_baseline(name, nproc, threaded, baseline_nproc, baseline_layout):
    run = launch(f"{name}-threaded-fbd", nproc, ("--forward-backward-disaggregating", *threaded), iters=10)
    baseline = launch(f"{name}-baseline", baseline_nproc, baseline_layout, iters=10)
    assert run["stdout"].count("(thread 1)") == 1, run["stdout"][-2000:]
    assert_same_training(run, baseline, 10)


def test_threaded_dropout_recomputation_equals_the_forward_threads():
    """The two forward threads draw dropout from one process-wide generator, interleaved, so the
    backward instances' own streams differ from what the forward used: only the RNG state sent with
    each stage input makes the recomputation equal (this fails without rng_restore)."""
    log = launch_dir("threaded-dropout") / "losses"
    launch("threaded-dropout-fbd", 3, (*THREADED, "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                                       "--fbd-loss-log", str(log)), iters=4)
    forward, backward = read_losses(log / "fwd-replica0.jsonl"), read_losses(log / "bwd-replica0.jsonl")
    assert sorted(forward) == [(i, mb) for i in range(4) for mb in range(4)]
    assert forward == backward
