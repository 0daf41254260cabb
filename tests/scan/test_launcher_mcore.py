"""Zero-code tracing of an unmodified megatron-core pipeline job (`examples/megatron_core/train_loop.py`,
megatron-core's own schedule, P2P and DistributedDataParallel) through `python -m megatron.scan
launch`: every send is linked to its receive, every (chunk, microbatch) has a forward and a backward
span in every traced iteration, DDP's bucket all-reduce is recorded, each rank's file carries its
TP/PP/DP coordinates, and detection names a rank throttled from outside the job."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fault_runs import writable_hierarchy
from launch import ROOT, env, free_port, python

SCRIPT = ROOT / "examples" / "megatron_core" / "train_loop.py"
MICROBATCHES = 4


def _launch(trace_dir, layout: list[str], iterations: int, throttle_rank: int | None = None):
    port = free_port()
    throttle = None
    if throttle_rank is not None:
        # Applied from outside as soon as the rank's process exists, released when it ends.
        throttle = subprocess.Popen([sys.executable, "-m", "megatron.scan", "fault", "throttle", "--rank",
                                     str(throttle_rank), "--cpu-fraction", "0.25", "--job", f":{port}", "--wait", "120"],
                                    cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc = python(["-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir), "--trace-interval", "1",
                       "--continuous-trace-iterations", "1", "--hang-timeout", "120", "--",
                       sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
                       "127.0.0.1", "--master-port", str(port), str(SCRIPT), *layout,
                       "--num-microbatches", str(MICROBATCHES), "--train-iters", str(iterations)], timeout=300)
    finally:
        fault_output = throttle.communicate(timeout=60)[0] if throttle is not None else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if throttle is not None:
        assert "[fault] throttled" in fault_output and "[fault] released" in fault_output, fault_output
    return trace_dir


@pytest.fixture(scope="module")
def pp2_dp2_throttled(tmp_path_factory):
    if writable_hierarchy() is None:
        pytest.skip("needs a writable cgroup cpu hierarchy (root; v1 /sys/fs/cgroup/cpu or v2 with the cpu controller)")
    return _launch(tmp_path_factory.mktemp("mcore_pp2_dp2"), ["--pipeline-model-parallel-size", "2"], 14,
                   throttle_rank=3)


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("mcore_tp2_pp2"),
                   ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4)


def _check_pipeline_view(trace_dir, tmp_path, sizes: dict[str, int]) -> None:
    from megatron.scan.aggregate import aggregate
    from megatron.scan.trace_format import read_rank_file

    coordinates = set()
    for path in sorted(trace_dir.glob("benchmark-data-*.json")):
        trace = read_rank_file(path)
        header = trace.header
        assert {k: header["sizes"][k] for k in sizes} == sizes, path.name
        dp, pp, tp = (header["coordinates"][k] for k in ("dp", "pp", "tp"))
        assert path.name == f"benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json"
        assert header["num_microbatches"] == MICROBATCHES
        coordinates.add((dp, pp, tp))
        c = trace.columns
        names = [trace.names[n] for n in c["name"]]
        spans = {(names[i], int(c["chunk"][i]), int(c["microbatch"][i]), int(c["iteration"][i]))
                 for i in range(len(names)) if names[i] in ("forward", "backward")}
        iterations = sorted({it for *_, it in spans})
        assert iterations == sorted({int(i) for i in c["iteration"] if i >= 0}), path.name
        expected = {(kind, 0, mb, it) for kind in ("forward", "backward") for mb in range(MICROBATCHES)
                    for it in iterations}
        assert spans == expected, (path.name, sorted(spans ^ expected)[:6])
        sends = [i for i, n in enumerate(names) if n == "send"]
        assert sends and all(c["bytes"][i] > 0 and c["peer"][i] >= 0 for i in sends), path.name
        if sizes["dp"] > 1:  # megatron-core DDP's bucket reduction, one per traced iteration
            data_parallel = {i for i, g in enumerate(trace.groups) if g["desc"].startswith("DATA_PARALLEL")}
            reductions = [i for i, n in enumerate(names) if n == "all_reduce" and c["group"][i] in data_parallel]
            assert len(reductions) >= len(iterations), (path.name, len(reductions))
            assert min(int(c["bytes"][i]) for i in reductions) > 10_000  # the gradient buffer, not a scalar
    assert len(coordinates) == 4  # every rank its own place in the layout

    summary = aggregate(trace_dir, tmp_path / "merged.json", jobs=1).summary()
    links = summary["p2p_links"]
    # Per traced iteration and pipeline: each microbatch's activation forward and gradient back.
    traced_iterations = len(iterations)
    assert links == traced_iterations * MICROBATCHES * 2 * sizes["dp"] * sizes["tp"], summary
    assert summary["p2p_unmatched_sends"] == 0 and summary["p2p_unmatched_recvs"] == 0, summary
    merged = json.loads((tmp_path / "merged.json").read_text())
    flows = [e for e in merged["traceEvents"] if e.get("ph") in ("s", "f") and e.get("cat") == "p2p"]
    assert len(flows) == 2 * links


def test_launched_tp2_pp2_has_the_pipeline_view(tp2_pp2, tmp_path):
    _check_pipeline_view(tp2_pp2, tmp_path, {"dp": 1, "pp": 2, "tp": 2})


def test_launched_pp2_dp2_has_the_pipeline_view(pp2_dp2_throttled, tmp_path):
    _check_pipeline_view(pp2_dp2_throttled, tmp_path, {"dp": 2, "pp": 2, "tp": 1})


def test_detection_names_the_rank_throttled_from_outside(pp2_dp2_throttled):
    proc = python(["scripts/aggregate.py", "-b", str(pp2_dp2_throttled), "-d", "-j", "1"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((pp2_dp2_throttled / "abnormal.json").read_text())
    assert report["verdict"] == "suspects", proc.stdout
    assert report["suspects"][0]["ranks"] == [3], proc.stdout  # DP1-PP1-TP0


P2P_WORKER = '''
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed import isend as isend_bound_early  # as a script that imported it first would
from megatron.scan.p2p import P2PObserver

dist.init_process_group("gloo")
rank, peer = dist.get_rank(), 1 - dist.get_rank()
events = []
observer = P2PObserver(now=lambda: 0, sink=lambda *e: events.append(e[:1] + e[3:5]), recording=lambda: True)
observer.install([])  # leaves the early import as it was
x = torch.full((8,), float(rank))
y = torch.empty(8)
if rank == 0:
    dist.send(x, peer)                                   # blocking pair
    dist.isend(x[:4].contiguous(), dst=peer).wait()      # posted send
    ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
else:
    dist.recv(y, peer)
    z = torch.empty(4)
    dist.irecv(z, src=peer).wait()
    ops = [dist.P2POp(dist.irecv, y, peer), dist.P2POp(isend_bound_early, x, peer)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
received = float(y[0])
observer.uninstall()
dist.send(x, peer) if rank == 0 else dist.recv(y, peer)  # not recorded any more
json.dump({"events": events, "received": received, "restored": dist.isend is dist.distributed_c10d.isend},
          open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
dist.destroy_process_group()
'''


def test_p2p_observer_records_every_form_with_peer_and_bytes(tmp_path):
    from launch import torchrun

    script = tmp_path / "p2p_worker.py"
    script.write_text(P2P_WORKER)
    proc = torchrun(script, [str(tmp_path)], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["events"] == [["send", 1, 32], ["send", 1, 16], ["send", 1, 32], ["recv", 1, 32]]
    assert results[1]["events"] == [["recv", 0, 32], ["recv", 0, 16], ["send", 0, 32], ["recv", 0, 32]]
    # The batched exchange delivered each rank's tensor to the other, with P2POp given our wrapper
    # (rank 0) and the function imported before the wrappers existed (rank 1).
    assert results[0]["received"] == 1.0 and results[1]["received"] == 0.0
    assert all(r["restored"] for r in results)
