"""With the same seed, data and global batch, an FBD run's 20-iteration loss curve and final
weights equal the non-disaggregated run's (PP=1, PP=2, TP=2 with merged forward instances, and PP=2 with a virtual pipeline)."""
from __future__ import annotations

import pytest
import torch

from fbd_runs import assert_same_training, launch

FBD = ("--forward-backward-disaggregating",)
EVAL = ("--eval-interval", "10", "--eval-iters", "2")
CASES = {
    # name: (baseline nproc, FBD nproc, layout flags, extra FBD flags)
    "pp1": (2, 2, ("--pipeline-model-parallel-size", "1"), ()),
    "pp2": (4, 4, ("--pipeline-model-parallel-size", "2", *EVAL), ("--trace", "--trace-interval", "5",
                                                             "--continuous-trace-iterations", "2")),
    "tp2-merged-forward": (4, 3, ("--tensor-model-parallel-size", "2"), ("--ignore-forward-tensor-parallel",)),
    # Virtual pipeline: 4 layers, 2 chunks per stage, interleaved 1F1B on the baseline.
    "pp2-vpp2": (4, 4, ("--pipeline-model-parallel-size", "2", "--num-layers", "4",
                        "--num-layers-per-virtual-pipeline-stage", "1"), ()),
}


def fbd_run(name: str) -> dict:
    _, nproc, layout, extra = CASES[name]
    trace = ("--trace-dir", str(launch_dir(name) / "trace")) if "--trace" in extra else ()
    return launch(f"{name}-fbd", nproc, (*layout, *FBD, *extra, *trace))


def launch_dir(name: str):
    from fbd_runs import _ROOT

    return _ROOT / f"{name}-fbd"


@pytest.mark.parametrize("name", list(CASES))
def test_fbd_matches_baseline(name):
    """Same seed, data and global batch: FBD's loss curve and final weights equal the baseline's."""
    baseline_nproc, _, layout, _ = CASES[name]
    baseline = launch(f"{name}-baseline", baseline_nproc, layout)
    fbd = fbd_run(name)
    assert_same_training(fbd, baseline, 20)
    assert fbd["losses"][20] < fbd["losses"][1]
    # Evaluation runs on the backward instances only, with the weights just stepped.
    assert fbd["validation"].keys() == baseline["validation"].keys() == ({10, 20} if "--eval-interval" in layout else set())
    for it in fbd["validation"]:
        torch.testing.assert_close(fbd["validation"][it], baseline["validation"][it], rtol=2e-6, atol=0)
    # Both maps are printed at start-up; one forward and one backward instance per logical rank.
    assert "FBD physical rank map" in fbd["stdout"] and "FBD virtual rank map" in fbd["stdout"]
    assert fbd["stdout"].count(" fwd instance of ") == (1 if "merged" in name else CASES[name][1] // 2)


def read_losses(path) -> dict[tuple[int, int], str]:
    import json

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {(r["iteration"], r["microbatch"]): r["loss"] for r in rows}


@pytest.mark.parametrize("vpp", [(), ("--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1")],
                         ids=["pp2", "pp2-vpp2"])
def test_dropout_recomputation_equals_the_forward_instance(vpp):
    """--hidden-dropout/--attention-dropout 0.1, PP=2: the backward instance restores the RNG state
    the forward instance used, so its recomputed loss equals the forward's for every microbatch,
    bit for bit. (The weights do not equal a non-FBD run's: one replica draws the masks of 2x
    microbatches from one stream, where two DP ranks draw them from two; see docs/megafbd.md.)"""
    name = "dropout" + ("-vpp" if vpp else "")
    log = launch_dir(name) / "losses"
    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    run = launch(f"{name}-fbd", 4, ("--pipeline-model-parallel-size", "2", *vpp, *FBD, *dropout,
                                    "--fbd-loss-log", str(log)), iters=4)
    forward, backward = read_losses(log / "fwd-replica0.jsonl"), read_losses(log / "bwd-replica0.jsonl")
    assert sorted(forward) == [(i, mb) for i in range(4) for mb in range(4)]
    assert forward == backward
    # Dropout is really on: the same first step without it gives another loss.
    plain = launch(f"{'pp2-vpp2' if vpp else 'pp2'}-baseline", 4, CASES["pp2-vpp2" if vpp else "pp2"][2])
    assert run["losses"][1] != plain["losses"][1]
