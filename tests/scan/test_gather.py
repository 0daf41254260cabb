"""Two "nodes" on one machine, each writing its own --trace-dir (no shared file system): two
`torchrun --nnodes 2 --node-rank i` launches of one PP=2 job, each node one rank on a core of its
own (as two single-GPU nodes: two ranks per node on this 2-core machine would share a core, and
the slowed rank's busy loop then starves its neighbour, a fault no real slow device causes).
Rank 0 reports the rank slowed on the second node online, and its directory ends up with every
rank's trace file, byte for byte the second node's own, which aggregate completely.

Traced with per-layer spans (`--trace-granularity full`), as a PP-only job should be: each rank is
alone in its stage, and without layer spans it is compared with its own history only, which this
shared 2-core host's noise moves (rank 0 was named at iterations 6-8 in one CI run; with two
background CPU hogs, in 5 of 8 runs, see docs/megascan-detection.md)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from launch import ROOT, env, free_port, kill_tree, run_nodes
from megatron.scan.gather import TraceReceiver

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
         "--device", "cpu", "--pipeline-model-parallel-size", "2"]
ONSET = 3


def test_two_nodes_without_a_shared_file_system(tmp_path):
    port = free_port()
    jobs, logs = [], []
    cores = sorted(os.sched_getaffinity(0))
    for node in (0, 1):
        trace_dir = tmp_path / f"node{node}"
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "pretrain_gpt.py", *MODEL, "--train-iters", "14", "--trace", "--trace-dir", str(trace_dir),
                   "--trace-interval", "1", "--continuous-trace-iterations", "1", "--trace-granularity", "full",
                   "--online-detect", "--inject-slowdown", f"1:4:{ONSET}"]
        logs.append(tmp_path / f"node{node}.log")
        core = {cores[node % len(cores)]}
        jobs.append(subprocess.Popen(command, cwd=ROOT, env=env(), stdout=open(logs[-1], "w"),
                                     stderr=subprocess.STDOUT, preexec_fn=lambda: os.sched_setaffinity(0, core)))
    try:
        codes = [job.wait(timeout=300) for job in jobs]
    finally:
        for job in jobs:
            kill_tree(job.pid)
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], (text[0][-3000:], text[1][-3000:])
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    assert "gathering the trace files of ranks 1 (no shared file system" in text[0]

    # Online: rank 0 (node 0) names rank 1 (node 1), and no other rank, not before the onset.
    alerts = re.findall(r"online detection \(iterations (\d+)-(\d+)\): rank (\d+) ", text[0])
    assert alerts and {rank for _, _, rank in alerts} == {"1"}, (alerts, text[0][-3000:])
    assert min(int(last) for _, last, _ in alerts) >= ONSET
    saved = json.loads((node0 / "online_abnormal.json").read_text())
    assert any(alert["ranks"] == [1] for alert in saved["alerts_so_far"])

    # Gathered: node 0 has every rank's file, node 1's byte for byte; node 1 keeps its own.
    names = {rank: f"benchmark-data-0-pipeline-{rank}-tensor-0.json" for rank in range(2)}
    assert sorted(p.name for p in node0.glob("benchmark-data-*.json")) == sorted(names.values())
    assert sorted(p.name for p in node1.glob("benchmark-data-*.json")) == [names[1]]
    assert (node0 / names[1]).read_bytes() == (node1 / names[1]).read_bytes()
    assert not list(node0.glob(".megascan-rank0-*"))  # the start-up marker is gone

    from megatron.scan.aggregate import aggregate

    summary = aggregate(node0, tmp_path / "merged.json", jobs=1).summary()
    assert summary["ranks"] == [0, 1]
    assert summary["collective_instances_incomplete"] == 0 and summary["collective_op_mismatches"] == 0
    assert summary["p2p_links"] > 0 and summary["p2p_unmatched_sends"] == summary["p2p_unmatched_recvs"] == 0
    assert not summary["warnings"], summary["warnings"]


def test_the_receiver_writes_whole_lines_and_keeps_a_rank_that_writes_there_itself(tmp_path):
    """Chunks split lines; the gathered file only ever holds whole lines. A file of this run that is
    already there (the rank shares the directory after all) is left alone; an earlier run's is replaced."""
    receiver = TraceReceiver.__new__(TraceReceiver)
    receiver.directory, receiver.run_id, receiver.files, receiver.pending = tmp_path, "run-a", {}, {5, 6, 7}
    receiver.bytes_received = 0
    name = "benchmark-data-1-pipeline-1-tensor-0.json"
    receiver._take(5, 1, name, b'{"run_id":"run-a"}\n{"type":"win')
    assert (tmp_path / name).read_bytes() == b'{"run_id":"run-a"}\n'
    receiver._take(5, 2, name, b'dow"}\n{"type":"end"}\n')
    receiver._take(5, 3, name, b"")
    assert (tmp_path / name).read_bytes() == b'{"run_id":"run-a"}\n{"type":"window"}\n{"type":"end"}\n'
    assert receiver.pending == {6, 7}

    mine = "benchmark-data-0-pipeline-1-tensor-0.json"
    (tmp_path / mine).write_bytes(b'{"run_id":"run-a"}\n{"own":1}\n')
    receiver._take(6, 1, mine, b'{"run_id":"run-a"}\n{"sent":1}\n')
    assert (tmp_path / mine).read_bytes() == b'{"run_id":"run-a"}\n{"own":1}\n'
    stale = "benchmark-data-1-pipeline-0-tensor-0.json"
    (tmp_path / stale).write_bytes(b'{"run_id":"old"}\n{"old":1}\n')
    receiver._take(7, 1, stale, b'{"run_id":"run-a"}\n')
    assert (tmp_path / stale).read_bytes() == b'{"run_id":"run-a"}\n'
    try:
        receiver._take(7, 2, "../../etc/passwd", b"x\n")
        raise AssertionError("a path outside the directory was accepted")
    except ValueError:
        pass


def test_the_zero_code_launcher_gathers_too(tmp_path):
    """A plain DDP script under `python -m megatron.scan launch`, two "nodes" with their own trace
    directories: node 0's directory gets node 1's rank file, byte for byte, and aggregates."""
    port = free_port()
    results = run_nodes([[sys.executable, "-m", "megatron.scan", "launch", "--trace-dir", str(tmp_path / f"node{node}"),
                          "--trace-interval", "3", "--continuous-trace-iterations", "2", "--", sys.executable, "-m",
                          "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                          "--master-addr", "127.0.0.1", "--master-port", str(port),
                          str(ROOT / "examples" / "scan" / "plain_ddp.py"), "--steps", "9"] for node in (0, 1)])
    assert [code for code, _ in results] == [0, 0], [output for _, output in results]
    gathered = tmp_path / "node0" / "benchmark-data-1-pipeline-0-tensor-0.json"
    assert gathered.read_bytes() == (tmp_path / "node1" / gathered.name).read_bytes()
    from megatron.scan.aggregate import aggregate

    summary = aggregate(tmp_path / "node0", tmp_path / "merged.json", jobs=1).summary()
    assert summary["ranks"] == [0, 1] and summary["collective_instances"] >= 6
    assert summary["collective_instances_incomplete"] == 0
