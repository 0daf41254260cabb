"""Bad FBD input: one actionable ConfigError, exit code 2 on every rank, nobody hangs."""
from __future__ import annotations

import time

import pytest

from fbd_runs import MODEL
from launch import torchrun

FBD = ["--forward-backward-disaggregating"]


@pytest.mark.parametrize("world,flags,fragments", [
    (6, [*FBD, "--pipeline-model-parallel-size", "2"], ["dp(3) is odd", "launch 8 ranks"]),
    (3, [*FBD, "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--forward-instances-per-process", "2"],
     ["--num-layers-per-virtual-pipeline-stage with --forward-instances-per-process 2"]),
    (2, [*FBD, "--device", "cuda"], ["--device cuda: the disaggregated step runs on the CPU backend"]),
    (3, [*FBD, "--ignore-forward-tensor-parallel", "--tensor-model-parallel-size", "2", "--attention-dropout", "0.1"],
     ["--attention-dropout 0.1 with --ignore-forward-tensor-parallel"]),
    (2, [*FBD, "--forward-device", "cuda"], ["--forward-device cuda needs CUDA backward instances"]),
    (2, ["--ignore-forward-tensor-parallel"], ["only apply with --forward-backward-disaggregating"]),
    (3, [*FBD, "--forward-instances-per-process", "3", "--pipeline-model-parallel-size", "2"],
     ["--forward-instances-per-process 3 must be a multiple of pp(2)"]),
    (4, [*FBD, "--forward-instances-per-process", "2", "--pipeline-model-parallel-size", "2"],
     ["multiple of 1 replica(s) x pp(2) x tp(1) + 1 = 3"]),
    (6, [*FBD, "--forward-instances-per-process", "2", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2"], ["with tp(2) needs --ignore-forward-tensor-parallel"]),
    (3, [*FBD, "--forward-instances-per-process", "2", "--pipeline-model-parallel-size", "2", "--trace"],
     ["--trace with --forward-instances-per-process 2"]),
    (2, ["--forward-instances-per-process", "2"], ["only apply with --forward-backward-disaggregating"]),
    # The training mesh has dp/2 replicas: 6 samples cannot be split over 2 replicas of 2-sample microbatches.
    (4, [*FBD, "--global-batch-size", "6"], ["global_batch_size(6) is not divisible by micro_batch_size(2) x dp(2) = 4"]),
])
def test_bad_combinations_fail_with_a_message(monkeypatch, capsys, world, flags, fragments):
    from megatron.app.train import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    assert main([*MODEL, *flags]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err


def test_odd_data_parallel_size_stops_every_rank():
    started = time.time()
    proc = torchrun("pretrain_gpt.py", [*MODEL, *FBD], nproc=3, timeout=120)
    assert proc.returncode != 0
    assert "dp(3) is odd" in proc.stderr
    assert time.time() - started < 100
    assert "iteration" not in proc.stdout
