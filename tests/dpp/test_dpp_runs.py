"""The trainer with --use-dpp: a traced 4-rank run aggregates with every send linked to its receive
and forward/backward spans carrying chunk and microbatch; bad DPP flags stop with a clear message."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from launch import python, torchrun

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "512",
         "--device", "cpu"]


@pytest.fixture(scope="module")
def traced_dpp(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("dpp_trace")
    proc = torchrun("pretrain_gpt.py", [*MODEL, "--pipeline-model-parallel-size", "4", "--train-iters", "4",
                                        "--use-dpp", "--dpp-policy", "adaptive", "--trace", "--trace-dir",
                                        str(trace_dir), "--trace-interval", "2", "--continuous-trace-iterations", "2"],
                    nproc=4, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return trace_dir, proc


def test_dpp_trace_aggregates_with_every_send_linked(traced_dpp, tmp_path):
    from megatron.scan.aggregate import aggregate

    trace_dir, proc = traced_dpp
    assert "[dpp] policy adaptive" in proc.stdout
    assert "schedule dpp-adaptive (budget" in proc.stdout  # the trainer's start-up line names the dynamic order
    output = tmp_path / "merged.json"
    result = aggregate(trace_dir, output, jobs=2)
    trace, p2p = result.trace, result.p2p
    c = trace.columns
    names = Counter(trace.names[i] for i in c["name"])
    # 2 traced windows x 2 iterations, 8 microbatches, 4 stages: 3 links each way.
    assert names["forward"] == names["backward"] == 4 * 4 * 8
    assert names["send"] == names["recv"] == 4 * 2 * 3 * 8
    assert len(p2p) == names["send"] and len(p2p.unmatched_sends) == 0 and len(p2p.unmatched_recvs) == 0
    assert (c["microbatch"][p2p.recv_rows] == c["microbatch"][p2p.send_rows]).all()
    forward = c["name"] == trace.name_id("forward")
    assert set(c["microbatch"][forward]) == set(range(8)) and (c["chunk"][forward] == 0).all()
    flows = Counter((e["ph"], e["name"]) for e in json.loads(output.read_text())["traceEvents"] if e["ph"] in "sf")
    assert flows[("s", "p2p")] == flows[("f", "p2p")] == names["send"]


@pytest.mark.parametrize("flags,message", [
    (["--dpp-memory-budget", "lots"], "expected a count of stored activations"),
    (["--dpp-memory-budget", "1.5"], "whole number"),
    (["--dpp-memory-budget", "1", "--num-layers-per-virtual-pipeline-stage", "1"],
     "below what any schedule needs: 2 per rank"),
    (["--dpp-memory-budget", "1KB"], "below what any schedule needs"),
    (["--dpp-policy", "fastest"], "--dpp-policy 'fastest': choose one of adaptive, dfc, bfc"),
    (["--dpp-transport", "mpi"], "--dpp-transport 'mpi': choose one of shm, torch"),
    (["--node-ips", "10.0.0.1", "10.0.0.2"], "add --multi-node"),
])
def test_bad_dpp_flags_are_config_errors(flags, message):
    proc = python(["pretrain_gpt.py", *MODEL, "--pipeline-model-parallel-size", "2", "--train-iters", "1",
                   "--use-dpp", *flags], timeout=120, extra_env={"WORLD_SIZE": "4", "RANK": "0"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]


def test_shm_transport_without_the_extension_says_how_to_fix(monkeypatch):
    import builtins

    from megatron.app.config import ConfigError
    from megatron.dpp.config import check_transport

    real_import = builtins.__import__

    def no_extension(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "megatron.shm_tensor_rdma" and fromlist and "_C" in fromlist:
            raise ImportError("No module named 'megatron.shm_tensor_rdma._C'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_extension)
    with pytest.raises(ConfigError, match="needs the shm_tensor_rdma C.. extension.*--dpp-transport torch"):
        check_transport("shm", "cpu")
    with pytest.raises(ConfigError, match="NCCL"):
        check_transport("torch", "cuda")
