"""Shared MegaScan fixtures: one real traced 4-rank CPU run (TP=2 PP=2, one rank's clock skewed),
aggregated once, reused by every end-to-end test of the module that asks for it."""
from __future__ import annotations

from pathlib import Path

import pytest

from launch import torchrun

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "512",
         "--device", "cpu"]
SKEWED_RANK, SKEW_MS = 3, 40.0


def train(trace_dir: Path, layout: list[str], extra: list[str], iters: int = 10, extra_env: dict | None = None):
    args = [*MODEL, *layout, "--train-iters", str(iters), "--trace", "--trace-dir", str(trace_dir), *extra]
    return torchrun("pretrain_gpt.py", args, nproc=4, timeout=240, extra_env=extra_env)


@pytest.fixture(scope="session")
def traced_tp2_pp2(tmp_path_factory):
    """10 iterations, windows of 2 every 5 (iterations 0-1 and 5-6), per-layer scopes, rank 3's
    host clock 40 ms ahead."""
    trace_dir = tmp_path_factory.mktemp("trace_tp2_pp2")
    proc = train(trace_dir, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                 ["--trace-interval", "5", "--continuous-trace-iterations", "2", "--trace-dense-iterations", "0",
                  "--trace-granularity", "full",
                  "--trace-clock-skew", f"{SKEWED_RANK}:{SKEW_MS}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return trace_dir, proc


@pytest.fixture(scope="session")
def aggregated_tp2_pp2(traced_tp2_pp2, tmp_path_factory):
    from megatron.scan.aggregate import aggregate

    trace_dir, _ = traced_tp2_pp2
    output = tmp_path_factory.mktemp("merged") / "merged.json"
    return aggregate(trace_dir, output, jobs=2), output
