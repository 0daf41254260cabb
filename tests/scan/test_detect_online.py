"""Online detection: a slowdown injected at iteration K of a traced run is reported as a warning
naming the slow rank by iteration K + 2 (two one-iteration windows), and written to the trace dir."""
from __future__ import annotations

import json
import re

import numpy as np

from launch import torchrun
from megatron.scan.detect.model import DetectionInput, RankRole
from megatron.scan.detect.online import restrict

ONSET = 3


def test_slowdown_is_reported_within_two_windows_of_its_onset(tmp_path):
    proc = torchrun("pretrain_gpt.py", [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
        "--device", "cpu", "--train-iters", "8", "--pipeline-model-parallel-size", "2",
        "--trace", "--trace-dir", str(tmp_path), "--trace-interval", "1", "--continuous-trace-iterations", "1",
        "--online-detect", "--inject-slowdown", f"1:3:{ONSET}"], nproc=4, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    alerts = re.findall(r"online detection \(iterations (\d+)-(\d+)\): rank (\d+) ", proc.stderr)
    first_for_rank_1 = min((int(last) for _, last, rank in alerts if rank == "1"), default=None)
    assert first_for_rank_1 is not None, proc.stderr[-3000:]
    assert first_for_rank_1 <= ONSET + 2
    saved = json.loads((tmp_path / "online_abnormal.json").read_text())
    assert any(alert["ranks"] == [1] for alert in saved["alerts_so_far"])


def test_restrict_keeps_the_sliding_window():
    table = lambda **cols: {k: np.array(v, dtype=np.int64) for k, v in cols.items()}  # noqa: E731
    data = DetectionInput(
        roles={0: RankRole(rank=0, dp=0, pp=0, tp=0)}, sizes={"dp": 1, "pp": 1, "tp": 1},
        compute=table(rank=[0, 0, 0], iteration=[0, 1, 2], kind=[0, 0, 0], chunk=[0, 0, 0], microbatch=[0, 0, 0],
                      start=[0, 10, 20], busy=[1, 1, 1]),
        collectives=table(instance=[0, 1], rank=[0, 0], arrive=[5, 25], end=[6, 26], group_size=[2, 2], kind=[0, 0]),
        group_kinds=["DATA_PARALLEL_GROUP"],
        p2p=table(src=[], dst=[], iteration=[], backward=[], send_start=[], send_end=[], recv_start=[], recv_end=[],
                  bytes=[]),
        iteration_time=table(rank=[0, 0, 0], iteration=[0, 1, 2], start=[0, 10, 20], end=[9, 19, 29]))
    kept = restrict(data, 2)
    assert kept.compute["iteration"].tolist() == [2]
    assert kept.collectives["instance"].tolist() == [1]
