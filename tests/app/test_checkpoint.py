"""Checkpoints: a killed run resumes on the exact loss curve; torn saves are never loaded."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from conftest import SMALL_MODEL
from launch import ROOT, env, free_port, kill_tree, torchrun
from logparse import losses

RUN = [*SMALL_MODEL, "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
       "--mock-data", "--vocab-size", "512", "--train-iters", "16", "--lr-decay-style", "cosine"]


def _launch(args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "pretrain_gpt.py", *args]
    return subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.mark.slow  # 25-56 s on 2 cores
def test_kill_and_resume_continues_the_loss_curve_exactly(tmp_path):
    reference = torchrun("pretrain_gpt.py", RUN, nproc=4)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    expected = losses(reference.stdout)
    assert sorted(expected) == list(range(1, 17))

    save = tmp_path / "ckpt"
    job = _launch([*RUN, "--save", str(save), "--save-interval", "5"])
    seen = []
    deadline = time.time() + 240
    for line in job.stdout:
        seen.append(line)
        if "iteration       12/" in line or time.time() > deadline:
            break
    kill_tree(job.pid)  # the whole job dies at once, as on a node failure
    job.wait(timeout=60)
    assert any("saved checkpoint at iteration 10" in line for line in seen), "".join(seen[-30:])
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "10"

    resumed = torchrun("pretrain_gpt.py", [*RUN, "--load", str(save), "--save", str(save)], nproc=4)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "loaded checkpoint from" in resumed.stdout and "at iteration 10" in resumed.stdout
    after = losses(resumed.stdout)
    assert sorted(after) == list(range(11, 17))
    assert after == {k: expected[k] for k in range(11, 17)}

    # The tied word embedding (first stage) and output layer (last stage) stayed identical
    # through 16 optimizer steps: their gradients are summed over the embedding group.
    final = save / "iter_0000016"
    for tp in (0, 1):
        first = torch.load(final / f"mp_rank_{tp:02d}_000" / "model_optim_rng.pt", weights_only=False)
        last = torch.load(final / f"mp_rank_{tp:02d}_001" / "model_optim_rng.pt", weights_only=False)
        torch.testing.assert_close(first["model"][0]["embedding.word_embeddings.weight"],
                                   last["model"][0]["output_layer.weight"], rtol=0, atol=0)


def test_torn_save_is_ignored_and_damaged_file_is_reported(tmp_path):
    from megatron.app import checkpoint as ckpt

    root = tmp_path / "ckpt"
    # A finished checkpoint at 5 and a save of 10 that died half-way (only the staging dir).
    done = ckpt.rank_file(ckpt.iteration_dir(str(root), 5), 0, 0)
    done.parent.mkdir(parents=True)
    torch.save({"iteration": 5}, done)
    (root / ckpt.TRACKER).write_text("5\n")
    torn = ckpt.rank_file(ckpt.iteration_dir(str(root), 10), 0, 0)
    torn = torn.parents[1].with_name("iter_0000010.tmp") / torn.parent.name / torn.name
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b"\x80\x02partial")
    assert ckpt.find_latest(str(root)) == 5

    done.write_bytes(b"\x80\x02truncated")
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.load_checkpoint(str(root), [], None, _FakeCfg(), 0, 0)


class _FakeCfg:
    pass
