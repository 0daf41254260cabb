"""torchrun's restarts (`--max-restarts`): a rank killed with SIGKILL mid-run, the job's workers are
restarted by torchrun, load the newest complete checkpoint and finish; every loss after the restart
equals the uninterrupted run's (CPU runs are deterministic; `--deterministic-mode` as a user passes
it for CUDA). Before the attempt store, the restarted workers read the dead attempt's addresses from
torchrun's store and failed (`Gloo connectFullMesh failed ... Connection refused`) or waited."""
from __future__ import annotations

import re

from conftest import SMALL_MODEL
from launch import torchrun
from logparse import losses

PLUGINS = {"MEGATRON_APP_PLUGINS": "tests.app.plugins_for_tests"}


def _job(tmp_path, name: str, extra: list[str]) -> list[str]:
    return [*SMALL_MODEL, "--mock-data", "--vocab-size", "256", "--train-iters", "16",
            "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / name), "--load", str(tmp_path / name),
            "--save-interval", "5", "--deterministic-mode", *extra]


def test_a_killed_rank_is_restarted_by_torchrun_and_the_curve_continues_exactly(tmp_path):
    clean = torchrun("pretrain_gpt.py", _job(tmp_path, "clean", []), nproc=4, timeout=240)
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-3000:]
    expected = losses(clean.stdout)
    assert sorted(expected) == list(range(1, 17))

    proc = torchrun("pretrain_gpt.py", _job(tmp_path, "killed", ["--kill-rank", "3:12"]), nproc=4, timeout=300,
                    extra_env=PLUGINS, torchrun_args=["--max-restarts", "1", "--monitor-interval", "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = proc.stdout
    # The first attempt ran to the kill; the second loaded iteration 10, the newest complete save.
    assert f"loaded checkpoint from {tmp_path / 'killed'} at iteration 10" in out
    first, _, second = out.partition("loaded checkpoint from")
    before, after = losses(first), losses(second)
    assert sorted(before) == list(range(1, 13)) and sorted(after) == list(range(11, 17))
    assert all(before[i] == expected[i] for i in before) and all(after[i] == expected[i] for i in after), (
        before, after, expected)
    assert not re.search(r"connectFullMesh failed", proc.stderr)
    assert (tmp_path / "killed" / "latest_checkpointed_iteration.txt").read_text().strip() == "16"
