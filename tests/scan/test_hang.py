"""Hang diagnosis: one of 4 real ranks blocks at the start of an iteration; every rank's watchdog
dumps within timeout + 30 s and `python -m megatron.scan hang DIR` names the blocked rank."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import ROOT, env, free_port, kill_tree, python

HANG_TIMEOUT_S = 10
HUNG_RANK, HUNG_ITERATION = 1, 2
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "256",
         "--device", "cpu"]


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory):
    """PP=2 x DP=2 with tracing on; rank 1 (stage 0, dp 1) blocks forever at iteration 2. Stage-1
    rank 3 then waits in a P2P receive from it, rank 0 in the DP gradient all-reduce, rank 2 in
    its DP all-reduce with rank 3: the wait-for graph has rank 1 as its only sink."""
    trace_dir = tmp_path_factory.mktemp("hang")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "pretrain_gpt.py", *MODEL, "--pipeline-model-parallel-size", "2",
               "--train-iters", "50", "--trace", "--trace-dir", str(trace_dir), "--trace-interval", "5",
               "--continuous-trace-iterations", "1", "--hang-timeout", str(HANG_TIMEOUT_S),
               "--inject-hang", f"{HUNG_RANK}:{HUNG_ITERATION}"]
    log = open(trace_dir / "torchrun.log", "w")
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    marker = trace_dir / f"hang-injected-rank{HUNG_RANK}.json"
    deadline = time.monotonic() + 240  # startup on a loaded 2-core machine, then the hang
    dumps: list[Path] = []
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            dumps = sorted(trace_dir.glob("hang-rank*.json"))
            if len(dumps) == 4:
                break
            time.sleep(0.5)
        still_running = proc.poll() is None
    finally:
        kill_tree(proc.pid)
        proc.wait()
        log.close()
    output = (trace_dir / "torchrun.log").read_text()
    assert marker.exists(), output[-4000:]
    assert len(dumps) == 4, f"dumps: {[p.name for p in dumps]}\n{output[-4000:]}"
    return trace_dir, json.loads(marker.read_text()), still_running


def test_every_rank_dumps_within_timeout_and_job_keeps_running(hung_run):
    trace_dir, marker, still_running = hung_run
    assert still_running, "the watchdog must not kill the job"
    for rank in range(4):
        dump = json.loads((trace_dir / f"hang-rank{rank}.json").read_text())
        assert dump["rank"] == rank and dump["world_size"] == 4
        delay_s = (dump["wall_ns"] - marker["wall_ns"]) / 1e9
        assert 0 < delay_s <= HANG_TIMEOUT_S + 30, (rank, delay_s)
        assert any(t["main"] for t in dump["threads"]) and dump["groups"]


def test_hang_command_names_the_blocked_rank(hung_run, tmp_path):
    trace_dir, _, _ = hung_run
    proc = python(["-m", "megatron.scan", "hang", str(trace_dir), "--json", str(tmp_path / "hang.json")], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"culprit ranks: {HUNG_RANK} " in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "hang.json").read_text())
    assert report["culprits"] == [HUNG_RANK]
    # Rank 0 waits for rank 1 in their DP all-reduce; rank 3 waits in a receive from rank 1.
    dp_waits = [g for g in report["groups"] if HUNG_RANK in g["never_joined"]]
    assert dp_waits and all(0 in g["waiting"] for g in dp_waits), report["groups"]
    assert {"rank": 3, "peer": HUNG_RANK} in [{"rank": p["rank"], "peer": p["peer"]} for p in report["p2p"]]
    # The merged stacks show the injected block on rank 1 only.
    line = next(line for line in proc.stdout.splitlines() if "inject_hang  scan/watchdog.py" in line)
    assert line.split()[0] == str(HUNG_RANK)
    page = (trace_dir / "hang-report.html").read_text()
    assert "<svg" in page and "culprit ranks" in page and "http://" not in page.replace("http://www.w3.org", "")
