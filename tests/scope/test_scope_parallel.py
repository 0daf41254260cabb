"""TP=2 x PP=2 captures (gathered over TP, routed from both pipeline stages to rank 0) equal the
one-rank captures, with and without perturbations, on a checkpoint that pretrain_gpt.py saved
with TP=2 x PP=2 (so loading merges shards and stages for one rank and re-slices them for four)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from scope_helpers import fresh_job_env
from launch import ROOT, torchrun

WORKER = Path(__file__).parent / "workers" / "capture_worker.py"


TRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--lr", "1e-2", "--init-method-std", "0.3", "--device", "cpu", "--mock-data",
         "--tokenizer-type", "ByteLevelTokenizer", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2"]


def test_tp2_pp2_captures_match_single_rank(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    trained = torchrun(ROOT / "pretrain_gpt.py", [*TRAIN, "--save", checkpoint], nproc=4, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    clean = fresh_job_env()
    single = subprocess.run([sys.executable, str(WORKER), "--load", checkpoint, "--out", str(tmp_path / "single.pt")],
                            cwd=ROOT, env=clean, capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = torchrun(WORKER, ["--load", checkpoint, "--tp", "2", "--pp", "2", "--out", str(tmp_path / "tp2pp2.pt")],
                        nproc=4, timeout=300)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    want = torch.load(tmp_path / "single.pt")
    got = torch.load(tmp_path / "tp2pp2.pt")
    for name in ("clean", "perturbed"):
        assert got[name]["texts"] == want[name]["texts"], name
        assert len(got[name]["arrays"]) == len(want[name]["arrays"]) == 3
        for step, (g, w) in enumerate(zip(got[name]["arrays"], want[name]["arrays"])):
            assert set(g) == set(w) == {"qkv", "attention", "fc1", "fc2", "layer", "lens_ids", "lens_probs"}
            for kind in w:
                # float16 on the wire; the layouts differ only by float summation order
                torch.testing.assert_close(g[kind].float(), w[kind].float(), rtol=2e-3, atol=2e-3,
                                           msg=f"{name} step {step} {kind}")
    assert got["clean"]["texts"] != got["perturbed"]["texts"] or not torch.equal(
        got["clean"]["arrays"][0]["layer"], got["perturbed"]["arrays"][0]["layer"])

