"""Resuming an FBD run from --load continues its loss curve exactly: backward instances load
model, optimizer and RNG; forward instances (also merged ones, which have no file of their own
shape) load only the iteration and the RNG state, and get their weights from the hand-off."""
from __future__ import annotations

import pytest

from fbd_runs import MODEL, LOSS
from launch import torchrun

DROPOUT = ("--hidden-dropout", "0.1")  # the forward instance's RNG stream must continue too


def _run(nproc: int, args: list[str]) -> dict[int, str]:
    proc = torchrun("pretrain_gpt.py", [*MODEL[:-1], "8", *args], nproc=nproc, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(proc.stdout)}


@pytest.mark.parametrize("nproc,layout", [
    (4, ["--pipeline-model-parallel-size", "2"]),
    (3, ["--tensor-model-parallel-size", "2", "--ignore-forward-tensor-parallel"]),
], ids=["pp2", "tp2-merged-forward"])
def test_resume_continues_the_uninterrupted_curve(tmp_path, nproc, layout):
    args = [*layout, "--forward-backward-disaggregating", *DROPOUT]
    full = _run(nproc, args)
    first = _run(nproc, [*args, "--save", str(tmp_path / "ckpt"), "--save-interval", "4", "--exit-interval", "4"])
    resumed = _run(nproc, [*args, "--load", str(tmp_path / "ckpt")])
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7, 8]
    assert {i: full[i] for i in first} == first
    assert {i: full[i] for i in resumed} == resumed
