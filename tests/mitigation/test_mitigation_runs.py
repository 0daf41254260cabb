"""Straggler mitigation in real 4-rank gloo jobs: with a rank slowed, the replicas' shares of the
global batch change and the loss curve stays the plain run's (same samples, same steps); a rank
throttled from outside the job (cgroup CPU quota) is worked around and its cgroup is gone after."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, env, free_port, torchrun, writable_hierarchy

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "32",
         "--lr", "1e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--device", "cpu", "--mock-data",
         "--vocab-size", "256", "--train-iters", "18"]
QUICK = ["--straggler-mitigation", "--mitigation-window", "3", "--mitigation-patience", "2"]
ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+)")
SHARES = re.compile(r"\[mitigation\] iteration (\d+): DP shares( back to even)? ([0-9,]+) microbatches; (.*)")

LAYOUTS = {
    "dp4": [],
    "pp2-dp2": ["--pipeline-model-parallel-size", "2"],
    "tp2-dp2": ["--tensor-model-parallel-size", "2"],
    # megatron-core's own interleaved schedule: shares move in groups of pp, the loss is rescaled
    "pp2-dp2-vpp-mcore": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                          "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "megatron-core"],
    # MegaDPP's dynamic order over shm_tensor_rdma runs whatever count its replica has
    "pp2-dp2-dpp": ["--pipeline-model-parallel-size", "2", "--use-dpp"],
}
# A rank of the second replica (dp rank 1) in every layout.
SLOW_RANK = {"dp4": 1, "pp2-dp2": 3, "tp2-dp2": 2, "pp2-dp2-vpp-mcore": 3, "pp2-dp2-dpp": 3}


def curve(text: str) -> dict[int, tuple[float, float]]:
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in ITERATION.finditer(text)}


def changes(text: str) -> list[tuple[int, list[int]]]:
    return [(int(m.group(1)), [int(s) for s in m.group(3).split(",")]) for m in SHARES.finditer(text)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow  # 25-56 s on 2 cores
def test_loss_curve_is_the_plain_runs_with_a_rank_slowed(layout):
    args = [*MODEL, *LAYOUTS[layout]]
    plain = torchrun("pretrain_gpt.py", args, 4)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-3000:]
    slowed = torchrun("pretrain_gpt.py", [*args, *QUICK, "--inject-slowdown", f"{SLOW_RANK[layout]}:4"], 4)
    assert slowed.returncode == 0, slowed.stdout[-2000:] + slowed.stderr[-3000:]
    moved = changes(slowed.stdout)
    assert moved, "no [mitigation] plan change with a rank 4x slower:\n" + slowed.stdout[-3000:]
    iteration, shares = moved[0]
    assert sum(shares) == 32 // 1 and shares[1] < min(s for d, s in enumerate(shares) if d != 1), shares
    assert f"rank {SLOW_RANK[layout]} at" in slowed.stdout
    if "vpp" in layout:
        assert "vpp chunks=2" in slowed.stdout
        assert all(s % 2 == 0 for s in shares), shares  # whole groups of pp for the interleaved schedule
    a, b = curve(plain.stdout), curve(slowed.stdout)
    assert sorted(a) == sorted(b) == list(range(1, 19))
    for it in a:
        assert b[it][0] == pytest.approx(a[it][0], rel=2e-6), (it, a[it], b[it])
        assert b[it][1] == pytest.approx(a[it][1], rel=1e-3, abs=2e-3), (it, a[it], b[it])
    assert "[mitigation] summary:" in slowed.stdout


def test_healthy_run_keeps_the_even_split():
    # Two ranks on this two-core machine: each has a core, so neither is slow (with four, the host's
    # scheduler really does give some ranks less CPU for a while, and mitigation rightly acts on it).
    run = torchrun("pretrain_gpt.py", [*[a if a != "18" else "24" for a in MODEL], "--straggler-mitigation"], 2)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert changes(run.stdout) == [], run.stdout[-3000:]
    assert "[mitigation] summary: 0 plan changes; 0 iterations rebalanced" in run.stdout


def test_flags_are_checked():
    for bad, message in ((["--mitigation-threshold", "1.5"], "--mitigation-threshold must be in (0, 1)"),
                         (["--mitigation-window", "0"], "--mitigation-window must be >= 1"),
                         (["--forward-backward-disaggregating"], "cannot run with")):
        run = torchrun("pretrain_gpt.py", [*MODEL, "--straggler-mitigation", *bad], 2)
        assert run.returncode != 0 and message in run.stdout + run.stderr, run.stderr[-2000:]


@pytest.mark.skipif(writable_hierarchy() is None, reason="needs a writable cgroup cpu hierarchy (root)")
@pytest.mark.slow  # 25-56 s on 2 cores
def test_a_rank_throttled_from_outside_gets_fewer_microbatches_until_it_recovers():
    from megatron.scan.fault import cgroups

    # Two ranks on this two-core machine, so that each has a core of its own and only the quota
    # makes one slow (with more ranks than cores the host's scheduler does that too, now and then).
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(port), "pretrain_gpt.py",
               *[a if a != "18" else "400" for a in MODEL], "--straggler-mitigation", "--mitigation-window", "5"]
    job = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The quota comes 8 s after the rank starts (training has begun by then), holds 8 s, then goes,
    # leaving a few hundred iterations (under 0.1 s each) in which to notice the recovery, including
    # any hold-off the mitigation's feedback imposed (a CFS quota lets short bursts through, so a
    # throttled rank's speed depends on its share, and some changes do not pay).
    fault = subprocess.Popen([sys.executable, "-m", "megatron.scan", "fault", "throttle", "--rank", "1",
                              "--cpu-fraction", "0.3", "--job", f":{port}", "--wait", "120", "--after", "8",
                              "--for", "8"],
                             cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = job.communicate(timeout=500)
        fault_out, _ = fault.communicate(timeout=60)
    finally:
        for proc in (job, fault):
            if proc.poll() is None:
                proc.kill()
    assert job.returncode == 0, out[-3000:]
    assert "throttled rank 1" in fault_out and "released rank 1" in fault_out, fault_out
    moved = changes(out)
    assert moved, out[-3000:]
    _, shares = moved[0]
    assert shares[1] < 16 < shares[0] and sum(shares) == 32, (shares, out[-3000:])
    assert "rank 1 at" in out
    # Once the quota is gone, the even split comes back.
    assert " back to even 16,16 microbatches" in out, out[-4000:]
    assert cgroups.leftover_groups() == []


def test_changes_show_in_prometheus_and_in_the_merged_trace(tmp_path):
    import json
    import time

    from launch import kill_tree, python
    from megatron.scan.metrics import read_targets, scrape

    trace = tmp_path / "trace"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "pretrain_gpt.py",
               *[a if a != "18" else "40" for a in MODEL], *QUICK, "--inject-slowdown", "1:4",
               "--metrics-port", "0", "--trace", "--trace-dir", str(trace), "--trace-interval", "5",
               "--continuous-trace-iterations", "5"]
    log = open(tmp_path / "torchrun.log", "w")
    job = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    pages: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None and len(pages) < 4:
            targets = read_targets(trace) if len(list(trace.glob("metrics-targets-rank*.json"))) == 4 else {}
            for rank, target in targets.items():
                try:
                    page = scrape(f"http://{target}/metrics")
                except OSError:
                    continue
                if page.get(("megascan_mitigation_changes_total", (("rank", str(rank)),)), 0) >= 1:
                    pages[rank] = page
            time.sleep(0.2)
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()
        log.close()
    text = (tmp_path / "torchrun.log").read_text()
    assert job.returncode == 0, text[-3000:]
    assert len(pages) == 4, (sorted(pages), text[-3000:])

    def gauge(rank, name):
        return pages[rank][(name, (("rank", str(rank)),))]

    shares = [gauge(rank, "megascan_mitigation_microbatches") for rank in range(4)]
    # (each rank's page is from the moment it first showed a change: they may be from different plans)
    assert shares[1] < 8 and shares[1] < min(shares[0], shares[2], shares[3]), shares
    assert gauge(1, "megascan_mitigation_replica_speed") < min(0.8, gauge(0, "megascan_mitigation_replica_speed"))
    assert gauge(0, "megascan_mitigation_predicted_saving_seconds") > 0

    merged = tmp_path / "merged.json"
    agg = python(["scripts/aggregate.py", "-b", str(trace), "-o", str(merged), "--quiet"])
    assert agg.returncode == 0, agg.stderr[-3000:]
    events = json.loads(merged.read_text())["traceEvents"]
    counters = [e for e in events if e.get("ph") == "C" and e["name"] == "microbatches"]
    by_rank: dict[int, set] = {}
    for event in counters:
        by_rank.setdefault(event["pid"], set()).add(event["args"]["microbatches"])
    assert set(by_rank) == {0, 1, 2, 3}
    assert 8 in by_rank[1] and min(by_rank[1]) < 8 < max(by_rank[0]), by_rank  # even, then fewer on the slow one
    marks = {e["pid"] for e in events if e["name"] == "mitigation"}
    assert marks == {0, 1, 2, 3}, marks


def test_a_slow_stage_gets_a_layer_split_applied_at_restart(tmp_path):
    import json

    save = tmp_path / "ckpt"
    base = [*[a if a != "18" else "16" for a in MODEL], "--num-layers", "4", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "8"]
    plain = torchrun("pretrain_gpt.py", base, 2)
    assert plain.returncode == 0, plain.stderr[-3000:]
    # DP=1: nothing to rebalance, so the slow stage 1 (3x per layer) gets a layer split instead.
    first = torchrun("pretrain_gpt.py", [*base, *QUICK, "--inject-slowdown", "1:3", "--save", str(save),
                                         "--save-interval", "10", "--exit-interval", "10"], 2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "recommended --pipeline-layer-split 3,1 instead of 2,2" in first.stdout, first.stdout[-3000:]
    assert json.loads((save / "mitigation.json").read_text())["pipeline_layer_split"] == [3, 1]
    resumed = torchrun("pretrain_gpt.py", [*base, "--straggler-mitigation", "--load", str(save)], 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[mitigation] applying --pipeline-layer-split 3,1" in resumed.stdout, resumed.stdout[-3000:]
    assert "converted checkpoint from layer split 2,2 to 3,1" in resumed.stdout
    assert "layers 3,1 per stage" in resumed.stdout
    a, b = curve(plain.stdout), curve(resumed.stdout)
    assert sorted(b) == list(range(11, 17))
    for it in b:
        assert b[it][0] == pytest.approx(a[it][0], rel=1e-5), (it, a[it], b[it])
