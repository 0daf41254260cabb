"""torchrun's restarts (`--max-restarts`): a rank killed with SIGKILL mid-run, the job's workers are
restarted by torchrun, load the newest complete checkpoint and finish; every loss after the restart
equals the uninterrupted run's (CPU runs are deterministic; `--deterministic-mode` as a user passes
it for CUDA). Before the attempt store, the restarted workers read the dead attempt's addresses from
torchrun's store and failed (`Gloo connectFullMesh failed ... Connection refused`) or waited."""
from __future__ import annotations

import re

import pytest

from conftest import SMALL_MODEL
from launch import torchrun
from logparse import losses

PLUGINS = {"MEGATRON_APP_PLUGINS": "tests.app.plugins_for_tests"}


def _job(tmp_path, name: str, extra: list[str]) -> list[str]:
    return [*SMALL_MODEL, "--mock-data", "--vocab-size", "256", "--train-iters", "16",
            "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / name), "--load", str(tmp_path / name),
            "--save-interval", "5", "--deterministic-mode", *extra]


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[int, str]:
    """The uninterrupted run's losses (the same job without a kill)."""
    clean = torchrun("pretrain_gpt.py", _job(tmp_path_factory.mktemp("clean"), "clean", []), nproc=4, timeout=240)
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-3000:]
    result = losses(clean.stdout)
    assert sorted(result) == list(range(1, 17))
    return result


def test_a_killed_rank_is_restarted_by_torchrun_and_the_curve_continues_exactly(tmp_path, expected):
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


@pytest.mark.slow  # 25-56 s on 2 cores
def test_a_traced_restart_is_one_run_with_the_rolled_back_iterations_left_out(tmp_path):
    """MegaScan across the restart: the restarted attempt's files join the first attempt's run (one
    run id, one merged trace), the iterations the restart rolled back are left out so each iteration
    is there once, collectives of both attempts match, the restart is marked, and no hang is reported."""
    import numpy as np

    from megatron.scan.aggregate import aggregate
    from megatron.scan.load import load_directory

    trace = tmp_path / "trace"
    proc = torchrun("pretrain_gpt.py", _job(tmp_path, "ckpt", ["--kill-rank", "3:12", "--trace", "--trace-dir",
                                                               str(trace)]),
                    nproc=4, timeout=300, extra_env=PLUGINS, torchrun_args=["--max-restarts", "1", "--monitor-interval",
                                                                             "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    names = sorted(p.name for p in trace.glob("benchmark-data-*.json"))
    assert len(names) == 8 and sum(n.endswith("-attempt1.json") for n in names) == 4, names
    loaded = load_directory(trace)
    assert len(loaded.ranks) == 4
    iterations = loaded.columns["iteration"][loaded.columns["name"] == loaded.name_id("iteration")]
    ranks = loaded.columns["rank"][loaded.columns["name"] == loaded.name_id("iteration")]
    for rank in range(4):  # 16 iterations, each once: 10-12 of the first attempt were rolled back
        assert sorted(iterations[ranks == rank].tolist()) == list(range(16)), rank
    assert all(h["restarts"][0]["start_iteration"] == 10 for h in loaded.ranks.values())
    assert any("rolled back" in w for w in loaded.warnings)
    result = aggregate(trace, trace / "merged.json")
    assert len(result.collectives) and not np.any(result.collectives.members < result.collectives.expected)
    assert (trace / "merged.json").read_text().count("torchrun restart: attempt 1, resumed at iteration 10") == 4
    assert not list(trace.glob("hang-*"))


@pytest.mark.slow  # 25-56 s on 2 cores
def test_two_nodes_restart_together_under_c10d_rendezvous(tmp_path, expected):
    """Two `torchrun --nnodes 2 --rdzv-backend c10d` nodes, rank 3 (node 1) killed: node 1's agent
    counts a restart, node 0's restarts its workers because node 1 is waiting and does not, so the
    attempts disagree on TORCHELASTIC_RESTART_COUNT; the job still resumes from the checkpoint and
    every loss after the restart equals the uninterrupted run's."""
    import sys

    from launch import free_port, run_nodes

    port = free_port()
    results = run_nodes([["env", f"MEGATRON_APP_PLUGINS={PLUGINS['MEGATRON_APP_PLUGINS']}", sys.executable, "-m",
                          "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-test", "--max-restarts", "1",
                          "--monitor-interval", "1", "pretrain_gpt.py",
                          *_job(tmp_path, "nodes", ["--kill-rank", "3:12"])] for _ in range(2)], timeout=300)
    assert [code for code, _ in results] == [0, 0], [output[-3000:] for _, output in results]
    logged = "\n".join(output for _, output in results)
    assert f"loaded checkpoint from {tmp_path / 'nodes'} at iteration 10" in logged
    # The last pipeline stage (node 1) logs the losses: iterations 11 and 12 twice (before the kill and
    # after the restart), the later line of each iteration is the one the model kept.
    assert len(re.findall(r" iteration\s+11/", logged)) == 2
    kept = losses(logged)
    assert sorted(kept) == list(range(1, 17)) and all(kept[i] == expected[i] for i in kept), (kept, expected)


def test_running_the_same_command_again_continues_the_trace(tmp_path):
    """A job that stopped (no restarts left) and is run again by hand resumes from its checkpoint and
    its trace continues the same run as the next attempt (before, its files replaced the first
    run's and the directory mixed two runs)."""
    from megatron.scan.load import load_directory

    trace = tmp_path / "trace"
    traced = ["--trace", "--trace-dir", str(trace)]
    failed = torchrun("pretrain_gpt.py", _job(tmp_path, "ckpt", [*traced, "--kill-rank", "3:12"]), nproc=4,
                      timeout=240, extra_env=PLUGINS)
    assert failed.returncode != 0
    again = torchrun("pretrain_gpt.py", _job(tmp_path, "ckpt", traced), nproc=4, timeout=240)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"loaded checkpoint from {tmp_path / 'ckpt'} at iteration 10" in again.stdout
    loaded = load_directory(trace)  # one run: no "mixes trace files of 2 different runs"
    rows = loaded.columns["name"] == loaded.name_id("iteration")
    for rank in range(4):
        assert sorted(loaded.columns["iteration"][rows & (loaded.columns["rank"] == rank)].tolist()) == list(range(16))
