"""run_master.sh + run_worker.sh form one 4-rank job from two 'nodes' on loopback."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import SMALL_MODEL
from launch import ROOT, env, free_port


def _node_env(node_rank: int | None, port: int) -> dict:
    result = env()
    result.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2", NPROC_PER_NODE="2",
                  VIRTUAL_ENV=sys.prefix, PATH=os.path.dirname(sys.executable) + os.pathsep + result["PATH"])
    if node_rank is not None:
        result["NODE_RANK"] = str(node_rank)
    return result


def test_two_node_launch_over_loopback():
    port = free_port()
    args = [*SMALL_MODEL, "--mock-data", "--vocab-size", "256", "--train-iters", "4",
            "--pipeline-model-parallel-size", "2"]
    master = subprocess.Popen(["bash", "run_master.sh", *args], cwd=ROOT, env=_node_env(None, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = subprocess.Popen(["bash", "run_worker.sh", *args], cwd=ROOT, env=_node_env(1, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        master_out, _ = master.communicate(timeout=240)
        worker_out, _ = worker.communicate(timeout=60)
    finally:
        master.kill()
        worker.kill()
    assert master.returncode == 0, master_out[-3000:]
    assert worker.returncode == 0, worker_out[-3000:]
    assert "[node 0/2]" in master_out and "[node 1/2]" in worker_out
    # Ranks 0-1 (first stage) live on node 0, ranks 2-3 (last stage, which logs) on node 1.
    assert "[rank 0] tp=0 pp=0 dp=0" in master_out and "[rank 2] tp=0 pp=1 dp=0" in worker_out
    assert " iteration        4/" in worker_out


def test_worker_refuses_node_rank_zero():
    proc = subprocess.run(["bash", "run_worker.sh"], cwd=ROOT, env=_node_env(0, free_port()),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "NODE_RANK must be >= 1" in proc.stderr
