"""Resuming an FBD run from --load continues its loss curve exactly: backward instances load
model, optimizer and RNG; forward instances (also merged ones, which have no file of their own
shape) load only the iteration and the RNG state, and get their weights from the hand-off."""
from __future__ import annotations

import pytest

from fbd_runs import launch

DROPOUT = ("--hidden-dropout", "0.1")  # the forward instance's RNG stream must continue too


@pytest.mark.parametrize("nproc,layout", [
    (4, ("--pipeline-model-parallel-size", "2")),
    (3, ("--tensor-model-parallel-size", "2", "--ignore-forward-tensor-parallel")),
], ids=["pp2", "tp2-merged-forward"])
@pytest.mark.slow  # 25-56 s on 2 cores
def test_resume_continues_the_uninterrupted_curve(request, nproc, layout):
    name = f"resume-{request.node.callspec.id}"
    args = (*layout, "--forward-backward-disaggregating", *DROPOUT)
    full = launch(f"{name}-full", nproc, args, iters=8)["losses"]
    first = launch(f"{name}-first", nproc, (*args, "--save-interval", "4", "--exit-interval", "4"), iters=8)
    resumed = launch(f"{name}-resumed", nproc, (*args, "--load", str(first["dir"] / "ckpt")), iters=8)["losses"]
    assert sorted(first["losses"]) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7, 8]
    assert {i: full[i] for i in first["losses"]} == first["losses"]
    assert {i: full[i] for i in resumed} == resumed
