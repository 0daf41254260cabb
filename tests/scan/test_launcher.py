"""Zero-code-change tracing: a plain PyTorch DDP script (nothing from megatron.app), one rank slowed,
run through `python -m megatron.scan launch -- torchrun ...`; its rank files aggregate cleanly and
the slowed rank is the one every peer waits for in the gradient all-reduce."""
from __future__ import annotations

import json
import shlex
import statistics
import sys

import numpy as np
import pytest

from launch import ROOT, free_port, python

SCRIPT = ROOT / "examples" / "scan" / "plain_ddp.py"
SLOW_RANK = 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("launched")
    proc = python(["-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir), "--trace-interval", "4",
                   "--continuous-trace-iterations", "2", "--hang-timeout", "120", "--",
                   sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), str(SCRIPT), "--steps", "10", "--slow-rank", str(SLOW_RANK),
                   "--slow-ms", "80"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return trace_dir


def test_rank_files_aggregate(launched, tmp_path):
    from megatron.scan.aggregate import aggregate

    files = sorted(p.name for p in launched.glob("benchmark-data-*.json"))
    assert files == [f"benchmark-data-{r}-pipeline-0-tensor-0.json" for r in range(4)]
    result = aggregate(launched, tmp_path / "merged.json", jobs=1)
    summary = result.summary()
    assert len(summary["ranks"]) == 4
    # Windows of iterations 0-1, 4-5, 8-9: per step one DDP bucket all-reduce and one logging all-reduce.
    assert summary["collective_instances"] >= 10
    assert summary["collective_instances_incomplete"] == 0 and summary["collective_op_mismatches"] == 0
    assert not (launched / "crash-rank0-fatal.txt").exists()  # a clean exit leaves no crash files


def test_windows_given_on_the_command_line_are_traced_exactly(launched):
    from megatron.scan.trace_format import read_rank_file

    for path in launched.glob("benchmark-data-*.json"):
        trace = read_rank_file(path)
        assert [w["iterations"] for w in trace.windows] == [[0, 1], [4, 5], [8, 9]], path
        assert trace.header["trace"]["dense_until"] == 0  # no dense start: --trace-interval was given


def test_slowed_rank_is_waited_for(launched):
    from megatron.scan.trace_format import read_rank_file

    waits = {}
    for path in launched.glob("benchmark-data-*.json"):
        trace = read_rank_file(path)
        c = trace.columns
        bucket = int(c["bytes"][c["name"] == trace.names.index("all_reduce")].max())  # the gradient bucket
        rows = (c["name"] == trace.names.index("all_reduce")) & (c["bytes"] == bucket)
        assert rows.sum() >= 6, trace.rank  # recorded from issue to completion in every traced step
        assert (np.asarray(trace.columns["iteration"])[rows] >= 0).all()
        waits[trace.rank] = statistics.median((c["end_ns"][rows] - c["start_ns"][rows]).tolist())
    # Everyone else waits ~80 ms for the slowed rank in the all-reduce; the slowed rank barely waits.
    assert min(waits, key=waits.get) == SLOW_RANK, waits
    others = [w for r, w in waits.items() if r != SLOW_RANK]
    assert min(others) > 2 * waits[SLOW_RANK] and min(others) > 40e6, waits


def test_environment_form_single_process(tmp_path):
    """The printed `export` lines arm a process started any other way (here one rank, no torchrun)."""
    printed = python(["-m", "megatron.scan", "launch", "--trace-dir", str(tmp_path), "--print-env"], timeout=60)
    assert printed.returncode == 0, printed.stderr
    # As the shell's `eval` reads them: the session's JSON is quoted.
    env = dict(shlex.split(line)[1].split("=", 1) for line in printed.stdout.splitlines())
    assert env["MEGASCAN_TRACE_DIR"] == str(tmp_path)
    assert json.loads(env["MEGASCAN_SESSION"])["trace"]["directory"] == str(tmp_path)
    env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())})
    proc = python([str(SCRIPT), "--steps", "3"], extra_env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from megatron.scan.trace_format import read_rank_file

    trace = read_rank_file(tmp_path / "benchmark-data-0-pipeline-0-tensor-0.json")
    assert trace.ended and "all_reduce" in trace.names and "optimizer" in trace.names
    # Default flags: the dense start, so all 3 steps of this short run are traced.
    assert [m["iteration"] for w in trace.windows for m in w["metrics"]] == [0, 1, 2]
