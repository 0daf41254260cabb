"""Live metrics: scrape /metrics of every rank of a real 4-rank CPU run (PP=2 x DP=2) while it
trains, and check the series, their labels and that label sets stay bounded."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("prometheus_client")

from launch import ROOT, env, free_port, kill_tree  # noqa: E402
from megatron.scan.collectives import GroupInfo  # noqa: E402
from megatron.scan.metrics import group_kind, read_targets, scrape, suspect_scores  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "256",
         "--device", "cpu"]
# Every label name any series may carry; per-microbatch or per-iteration labels would break this.
ALLOWED_LABELS = {"rank", "kind", "op", "group_kind", "direction", "quantile", "host", "world_size", "dp", "pp", "tp",
                  "reason"}


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    directory = tmp_path_factory.mktemp("metrics")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "pretrain_gpt.py", *MODEL, "--pipeline-model-parallel-size", "2",
               "--train-iters", "400", "--trace-dir", str(directory), "--metrics-port", "0",
               "--metrics-score-interval", "2"]
    log = open(directory / "torchrun.log", "w")
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    pages: dict[int, dict] = {}
    deadline = time.monotonic() + 200
    try:
        while time.monotonic() < deadline and proc.poll() is None and len(pages) < 4:
            targets = read_targets(directory) if len(list(directory.glob("metrics-targets-rank*.json"))) == 4 else {}
            for rank, target in targets.items():
                if rank in pages:
                    continue
                try:
                    page = scrape(f"http://{target}/metrics")
                except OSError:
                    continue
                # Wait for a few iterations and one suspect-score exchange.
                if page.get(("megascan_iterations_total", (("rank", str(rank)),)), 0) >= 4:
                    pages[rank] = page
            time.sleep(0.5)
    finally:
        running = proc.poll() is None
        kill_tree(proc.pid)
        proc.wait()
        log.close()
    assert len(pages) == 4, (sorted(pages), (directory / "torchrun.log").read_text()[-3000:])
    assert running
    return pages


def value(page, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    assert key in page, f"{key} not among {sorted(k for k in page if k[0] == name)}"
    return page[key]


def test_series_and_labels(scraped):
    for rank, page in scraped.items():
        r = str(rank)
        assert value(page, "megascan_iteration_seconds_count", rank=r) >= 4
        assert value(page, "megascan_iteration_seconds_sum", rank=r) > 0
        for kind in ("forward", "backward", "grad_sync", "optimizer"):
            assert value(page, "megascan_span_seconds_count", rank=r, kind=kind) > 0
        # The DP gradient all-reduce, labelled by op and group kind.
        assert value(page, "megascan_collective_seconds_count", rank=r, op="all_reduce", group_kind="dp") >= 4
        assert value(page, "megascan_hang", rank=r) == 0
        assert value(page, "megascan_suspect_score", rank=r) > 0
        stage = 0 if rank < 2 else 1  # PP=2 x DP=2: ranks 0,1 are stage 0
        direction = "send" if stage == 0 else "recv"
        assert value(page, "megascan_p2p_bytes_total", rank=r, direction=direction) > 0
        assert value(page, "megascan_p2p_bandwidth_bytes_per_second", rank=r, direction=direction) > 0
        info = {dict(labels).get("pp") for name, labels in page if name == "megascan_rank_info"}
        assert info == {str(stage)}
        label_names = {name for _, labels in page for name, _ in labels}
        assert label_names <= ALLOWED_LABELS, label_names - ALLOWED_LABELS
        assert {dict(labels)["rank"] for name, labels in page if name.startswith("megascan_")} == {r}


def test_suspect_scores_and_group_kinds():
    assert suspect_scores([1.0, 1.0, 2.0, 1.0]) == [1.0, 1.0, 2.0, 1.0]
    assert suspect_scores([0.0, 0.0]) == [1.0, 1.0]
    assert group_kind(GroupInfo(0, "3", (0, 1), "TENSOR_MODEL_PARALLEL_GROUP"), 4) == "tp"
    assert group_kind(GroupInfo(0, "5", (0, 2), "DATA_PARALLEL_GROUP"), 4) == "dp"
    assert group_kind(GroupInfo(0, "0", (0, 1, 2, 3), ""), 4) == "world"
