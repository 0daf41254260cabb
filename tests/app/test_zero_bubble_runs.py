"""The zero-bubble orders and MegaDPP's split backward in the trainer (real torchrun, gloo, one core
per rank): the same loss and grad-norm lines as 1F1B and, after the optimizer steps, the same
weights and optimizer state bit for bit; the activation-memory report; the flags refused together."""
from __future__ import annotations

import re

import pytest
import torch

from conftest import SMALL_MODEL
from launch import torchrun
from logparse import losses

PP2 = ["--pipeline-model-parallel-size", "2", "--mock-data", "--vocab-size", "256", "--train-iters", "3"]
GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*?grad norm: ([0-9.E+-]+)")


def _tensors(value, prefix=""):
    """Every tensor in a checkpoint's nested dicts and lists, by its path."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}/{index}")


def _run(tmp_path, name: str, schedule_args: list[str], nproc: int = 2, extra: list[str] = ()):
    save = tmp_path / name
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, *PP2, *extra, "--save", str(save), *schedule_args], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(save.glob("iter_0000003/*/model_optim_rng.pt"))
    assert files, list(save.rglob("*"))
    saved = {f.parent.name: dict(_tensors(torch.load(f, weights_only=False))) for f in files}
    return proc.stdout, saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("zb_reference"), "1f1b", [])


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_zero_bubble_training_equals_1f1b_bit_for_bit(tmp_path, reference, schedule):
    ref_log, ref_saved = reference
    log, saved = _run(tmp_path, schedule, ["--pipeline-schedule", schedule, "--report-activation-memory"])
    assert f"schedule {schedule}" in log
    assert losses(log) == losses(ref_log) and len(losses(log)) == 3
    assert GRAD_NORM.findall(log) == GRAD_NORM.findall(ref_log) and GRAD_NORM.findall(log)
    assert saved.keys() == ref_saved.keys()
    for shard, tensors in saved.items():
        assert tensors.keys() == ref_saved[shard].keys()
        differing = [key for key, value in tensors.items() if not torch.equal(value, ref_saved[shard][key])]
        assert not differing, f"{shard}: {differing[:5]}"
    peaks = re.findall(r"pp rank (\d): peak activation memory ([0-9.]+) MiB \((\d+) bytes", log)
    assert sorted(int(rank) for rank, _, _ in peaks) == [0, 1] and all(int(b) > 0 for *_, b in peaks)


def test_dpp_with_split_backward_trains_like_1f1b(tmp_path, reference):
    ref_log, _ = reference
    log, _ = _run(tmp_path, "dpp-w", ["--use-dpp", "--dpp-split-backward", "--dpp-transport", "torch"])
    assert "schedule dpp-adaptive+W" in log and "split backward (W fills idle time)" in log
    ours, theirs = losses(log), losses(ref_log)
    assert ours.keys() == theirs.keys() == {1, 2, 3}
    for iteration in ours:  # a dynamic order sums each weight's gradients in another order
        assert float(ours[iteration]) == pytest.approx(float(theirs[iteration]), rel=1e-4)


def test_zero_bubble_refuses_a_plugin_that_replaces_the_executor(tmp_path):
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, *PP2, "--pipeline-schedule", "zb-h1", "--use-dpp"], nproc=2)
    assert proc.returncode != 0
    assert ("--pipeline-schedule zb-h1 is a static order of this trainer's executor, which the dpp plugin "
            "replaces with its own (MegaDPP splits backwards with --dpp-split-backward)") in proc.stderr
