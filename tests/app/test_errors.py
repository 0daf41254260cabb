"""Bad input gives one clear message and a non-zero exit on every rank; nobody hangs."""
from __future__ import annotations

import shutil
import time

import pytest

from conftest import SMALL_MODEL
from launch import torchrun

MOCK = ["--mock-data", "--vocab-size", "256", "--train-iters", "4"]


def _fails_with(proc, *fragments: str) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-2000:]
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in output:\n{text[-3000:]}"


def test_world_size_mismatch_names_every_factor():
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, *MOCK, "--tensor-model-parallel-size", "2",
                                        "--pipeline-model-parallel-size", "2"], nproc=3)
    _fails_with(proc, "tp(2) x pp(2) x dp(1) = 4 != world_size(3)")


def test_all_divisibility_problems_in_one_message(monkeypatch, capsys):
    from megatron.app.train import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    code = main([*SMALL_MODEL, *MOCK, "--pipeline-model-parallel-size", "2", "--num-layers", "5",
                 "--global-batch-size", "10", "--micro-batch-size", "4", "--num-attention-heads", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "num_layers(5) is not divisible by pipeline stages pp(2)" in err
    assert "global_batch_size(10) is not divisible by micro_batch_size(4) x dp(2) = 8" in err
    assert "hidden_size(64) is not divisible by num_attention_heads(3)" in err


def test_virtual_pipeline_needs_divisible_layers(monkeypatch, capsys):
    from megatron.app.train import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    code = main([*SMALL_MODEL, *MOCK, "--pipeline-model-parallel-size", "2", "--num-layers", "6",
                 "--num-layers-per-virtual-pipeline-stage", "2"])
    assert code == 2
    assert "layers per stage num_layers(6) / pp(2) = 3 is not divisible by" in capsys.readouterr().err


def test_no_data_source(monkeypatch, capsys):
    from megatron.app.train import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([*SMALL_MODEL, "--train-iters", "2"]) == 2
    assert "pass --data-path PREFIX (see tools/preprocess_data.py) or --mock-data" in capsys.readouterr().err


def test_missing_data_files(tmp_path):
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, "--train-iters", "2", "--data-path", str(tmp_path / "nothing"),
                                        "--tokenizer-type", "ByteLevelTokenizer"], nproc=2, timeout=120)
    _fails_with(proc, "nothing.idx", "preprocess_data.py")


def test_corrupt_index(tmp_path, demo_corpus):
    prefix = tmp_path / "broken_text_document"
    shutil.copy(demo_corpus["data_path"] + ".bin", str(prefix) + ".bin")
    data = open(demo_corpus["data_path"] + ".idx", "rb").read()
    (tmp_path / "broken_text_document.idx").write_bytes(data[: len(data) // 2])
    args = [a if a != demo_corpus["data_path"] else str(prefix) for a in demo_corpus["args"]]
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, "--train-iters", "2", *args], nproc=2, timeout=120)
    _fails_with(proc, "broken_text_document.idx")


def test_load_of_missing_directory(tmp_path):
    """As in Megatron-LM: --load DIR without a checkpoint starts from scratch with a warning;
    --exit-on-missing-checkpoint makes it an error."""
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, *MOCK, "--load", str(tmp_path / "no_such_ckpt"),
                                        "--exit-on-missing-checkpoint"], nproc=2, timeout=120)
    _fails_with(proc, "no_such_ckpt: directory does not exist")
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, *MOCK, "--load", str(tmp_path / "no_such_ckpt"),
                                        "--train-iters", "1"], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: no checkpoint to load in --load" in proc.stdout and "starting from scratch" in proc.stdout


def test_dead_rank_stops_the_job_in_bounded_time():
    started = time.time()
    proc = torchrun("pretrain_gpt.py", [*SMALL_MODEL, "--mock-data", "--vocab-size", "256", "--train-iters", "50",
                                        "--pipeline-model-parallel-size", "2", "--kill-rank", "2:3"], nproc=4,
                    timeout=180, extra_env={"MEGATRON_APP_PLUGINS": "tests.app.plugins_for_tests"})
    assert proc.returncode != 0
    assert time.time() - started < 120
    assert " iteration       50/" not in proc.stdout
