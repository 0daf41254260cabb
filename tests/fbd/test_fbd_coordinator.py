"""Coordinator property test: random interleavings of collectives over overlapping groups,
issued by threads of two gloo processes, always complete with correct sums."""
from __future__ import annotations

import json

from launch import ROOT, torchrun

WORKER = ROOT / "tests" / "fbd" / "workers" / "coordinator_worker.py"


def test_random_interleavings_complete_with_correct_results(tmp_path):
    proc = torchrun(WORKER, ["--seed", "7", "--trials", "40", "--threads", "3", "--out", str(tmp_path)], nproc=2,
                    timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["trials"] == 40 for r in ranks)
    assert ranks[0]["collectives"] > 100
    # Collectives spanning both processes ran in the same order on both.
    assert ranks[0]["orders"] == ranks[1]["orders"]
    assert sum(len(o) for o in ranks[0]["orders"]) > 50
