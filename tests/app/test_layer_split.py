"""--pipeline-layer-split: an uneven split trains the same model as the even one, and a checkpoint
moves between splits (converted while loading, or by tools/convert_checkpoint.py) without
changing the resumed loss curve."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from launch import ROOT, python, torchrun
from logparse import losses

TINY = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--log-interval", "1", "--device", "cpu", "--mock-data",
        "--vocab-size", "128", "--train-iters", "6"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _curve(args: list[str], nproc: int = 2) -> tuple[dict[int, float], str]:
    proc = torchrun("pretrain_gpt.py", [*TINY, *args], nproc=nproc, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {k: float(v) for k, v in losses(proc.stdout).items()}, proc.stdout


def _same(curve: dict[int, float], reference: dict[int, float], iterations) -> None:
    assert sorted(curve) == list(iterations), curve
    torch.testing.assert_close([curve[i] for i in iterations], [reference[i] for i in iterations],
                               rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def even_curve() -> dict[int, float]:
    """The uninterrupted PP=2 run with the even split 4,4."""
    return _curve(PP2)[0]


def test_uneven_split_trains_the_same_model(even_curve):
    uneven, out = _curve([*PP2, "--pipeline-layer-split", "3,5"])
    assert "parameters=" in out
    _same(uneven, even_curve, range(1, 7))
    one_rank, _ = _curve([], nproc=1)
    _same(one_rank, even_curve, range(1, 7))


def _converter():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resume_under_another_split_continues_the_curve(even_curve, tmp_path):
    saved = tmp_path / "even"
    first, _ = _curve([*PP2, "--save", str(saved), "--exit-interval", "3"])
    _same(first, even_curve, range(1, 4))
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    # Converted while loading.
    resumed, out = _curve([*PP2, "--load", str(saved), "--pipeline-layer-split", "3,5"])
    assert "converted checkpoint from layer split 4,4 to 3,5 while loading" in out
    _same(resumed, even_curve, range(4, 7))

    # Converted by the tool, then loaded as it is.
    converted = tmp_path / "uneven"
    proc = python(["tools/convert_checkpoint.py", "--load", str(saved), "--save", str(converted),
                   "--pipeline-layer-split", "5,3"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from layer split 4,4 to 5,3" in proc.stdout and "[convert_checkpoint]" in proc.stderr
    assert sorted(p.name for p in converted.iterdir()) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    resumed, out = _curve([*PP2, "--load", str(converted), "--pipeline-layer-split", "5,3"])
    assert "converted checkpoint" not in out
    _same(resumed, even_curve, range(4, 7))

    # Back to 4,4: every tensor (weights, AdamW moments and steps) is the saved one again.
    back = tmp_path / "back"
    tool = _converter()
    tool.convert(str(converted), str(back), [4, 4])
    for stage in (0, 1):
        original = torch.load(saved / "iter_0000003" / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt",
                              weights_only=False)
        again = torch.load(back / "iter_0000003" / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt",
                           weights_only=False)
        assert again["layout"] == original["layout"] and again["optimizer_keys"] == original["optimizer_keys"]
        assert list(again["model"][0]) == list(original["model"][0])
        torch.testing.assert_close(again["model"], original["model"], rtol=0, atol=0)
        torch.testing.assert_close(again["optimizer"], original["optimizer"], rtol=0, atol=0)

    # A split that does not fit the checkpoint: nothing is written.
    with pytest.raises(tool.ckpt.CheckpointError, match="sum must be the checkpoint's 8 layers"):
        tool.convert(str(saved), str(tmp_path / "bad"), [3, 4])
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("split, message", [
    ("3,4", "--pipeline-layer-split 3,4 sums to 7, but the sum must be --num-layers (8)"),
    ("2,2,4", "--pipeline-layer-split 2,2,4 has 3 entries but there are pp(2) pipeline stages"),
    ("8,0", "--pipeline-layer-split 8,0: every stage needs at least 1 layer"),
])
def test_bad_split_is_refused(monkeypatch, capsys, split, message):
    from megatron.app.train import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    code = main([*TINY, *PP2, "--pipeline-layer-split", split])
    assert code == 2
    assert message in capsys.readouterr().err


def test_megatron_lm_first_and_last_stage_flags():
    from megatron.app.arguments import build_parser, config_from_args
    from megatron.app.config import ConfigError

    def split(*flags: str):
        return config_from_args(build_parser().parse_args([*flags]), world_size=4).parallel.pipeline_layer_split

    assert split("--num-layers", "10", "--pipeline-model-parallel-size", "4",
                 "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3") == [1, 3, 3, 3]
    assert split("--num-layers", "8", "--pipeline-model-parallel-size", "3",
                 "--decoder-last-pipeline-num-layers", "2") == [3, 3, 2]
    with pytest.raises(ConfigError, match="do not spread evenly over the other 2 pipeline stage"):
        split("--num-layers", "8", "--pipeline-model-parallel-size", "3", "--decoder-last-pipeline-num-layers", "3")


def test_virtual_chunks_split_each_stage_evenly():
    from megatron.app.config import ParallelConfig, layer_split_problems

    parallel = ParallelConfig(pipeline_model_parallel_size=2, pipeline_layer_split=[4, 12],
                              num_layers_per_virtual_pipeline_stage=2, world_size=2)
    assert parallel.layers_per_chunk(16) == [[1, 1, 1, 1], [3, 3, 3, 3]]
    # The model runs chunk 0 of every stage, then chunk 1 of every stage, ...
    assert [parallel.first_layer(16, stage, chunk) for chunk in range(4) for stage in range(2)] == \
        [0, 1, 4, 5, 8, 9, 12, 13]
    parallel = dataclasses.replace(parallel, pipeline_layer_split=[6, 10])  # the config is frozen
    assert "every entry must be a multiple of 4 (stage 0: 6, stage 1: 10)" in layer_split_problems(parallel, 16)[0]
