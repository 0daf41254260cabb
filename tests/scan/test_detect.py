"""Slow-rank detection on synthetic traces with known faults: each case lists the layout, the
injected faults and, beside them, the answer the detector must give."""
from __future__ import annotations

import json

import pytest

from megatron.scan.cli import main as scan_main
from megatron.scan.detect import run_detection
from megatron.scan.detect.faults import FaultCase, generate_case
from megatron.scan.detect.report import suspect_ranks, write_outputs

# (tp, pp, dp, slow ranks {rank: factor}, delayed links {(src, dst): ms}) -> expected suspect ranks, links
CASES = [
    ((1, 2, 2, {}, {}), [], []),
    ((2, 2, 2, {}, {}), [], []),
    ((1, 2, 2, {1: 1.5}, {}), [1], []),
    ((1, 2, 2, {2: 3.0}, {}), [2], []),
    ((2, 2, 1, {2: 1.3}, {}), [2], []),  # DP=1: TP peers
    ((2, 2, 2, {5: 1.2}, {}), [5], []),
    ((2, 2, 2, {0: 1.15}, {}), [], []),  # below the 1.2x floor of a small job: healthy ranks of a shared host differ this much
    ((1, 1, 4, {3: 1.5}, {}), [3], []),  # PP=1: DP peers only
    ((4, 1, 1, {1: 1.5}, {}), [1], []),  # TP only
    ((2, 2, 2, {1: 1.5, 6: 2.0}, {}), [1, 6], []),  # two faults at once
    ((1, 4, 2, {2: 1.5, 5: 1.5}, {}), [2, 5], []),
    ((1, 4, 1, {}, {(1, 2): 10.0}), [], [(1, 2)]),  # slow link, no slow rank
    ((1, 2, 2, {}, {(2, 0): 8.0}), [], [(2, 0)]),
]


def _case_id(case) -> str:
    (tp, pp, dp, slow, links), _, _ = case
    return f"tp{tp}pp{pp}dp{dp}-slow{slow}-links{list(links)}".replace(" ", "")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_detector_names_exactly_the_injected_faults(case, tmp_path):
    (tp, pp, dp, slow, links), expected_ranks, expected_links = case
    generate_case(FaultCase(tp=tp, pp=pp, dp=dp, slow=slow, link_delay_ms=links, seed=len(slow) + 7 * tp), tmp_path)
    detection = run_detection(tmp_path, jobs=1)
    assert sorted(suspect_ranks(detection)) == sorted(expected_ranks)
    assert sorted(tuple(s.ranks) for s in detection.suspects if s.kind == "link") == sorted(expected_links)
    assert detection.verdict == ("suspects" if expected_ranks or expected_links else "healthy")
    if expected_ranks and len(set(slow.values())) == len(slow):
        # The worst fault comes first.
        worst = max(expected_ranks, key=lambda r: slow[r])
        assert suspect_ranks(detection)[0] == worst


def test_outputs_json_txt_and_html(tmp_path):
    case = FaultCase(tp=2, pp=2, dp=2, slow={5: 1.5})
    generate_case(case, tmp_path)
    assert scan_main(["detect", str(tmp_path), "-j", "1"]) == 0
    result = json.loads((tmp_path / "abnormal.json").read_text())
    assert result["verdict"] == "suspects"
    assert result["suspects"][0]["ranks"] == [5] and result["suspects"][0]["coordinates"] == ["0-1-1"]
    assert result["suspects"][0]["what_if"]["cost_percent"] > 0
    assert (tmp_path / "abnormal.txt").read_text() == "5 0-1-1\n"
    page = (tmp_path / "report.html").read_text()
    assert "rank 5" in page and "http" not in page.replace("http-equiv", "")
    assert "confidence" in (tmp_path / "detection.txt").read_text()


def test_what_if_says_how_much_the_slow_rank_costs(tmp_path):
    generate_case(FaultCase(tp=1, pp=2, dp=2, slow={1: 2.0}, jitter=0.02), tmp_path)
    detection = run_detection(tmp_path, jobs=1)
    what_if = detection.suspects[0].what_if
    # Replica 1 runs stage 0 at half speed: a sizeable share of every iteration is lost to it.
    assert 15 < what_if["cost_percent"] < 60
    assert what_if["healthy_ms"] < what_if["measured_ms"]


@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 1)])
def test_nothing_to_compare_is_said_not_raised(layout, tmp_path):
    tp, pp, dp = layout
    generate_case(FaultCase(tp=tp, pp=pp, dp=dp, slow={0: 1.5}), tmp_path)
    detection = run_detection(tmp_path, jobs=1)
    write_outputs(detection, tmp_path)
    assert detection.verdict == ("cannot compare" if pp == 1 else "inconclusive")
    assert any("cannot" in note for note in detection.notes)
    assert (tmp_path / "abnormal.txt").read_text() == ""


def test_missing_directory_is_a_clear_error(tmp_path, capsys):
    assert scan_main(["detect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
