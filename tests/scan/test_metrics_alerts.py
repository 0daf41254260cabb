"""deploy/prometheus/alerts.yml: checked and unit-tested with promtool when it is installed
(Debian package `prometheus`), and always against a YAML schema of Prometheus rule files."""
from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
EXPECTED = {"MegaScanJobHung", "MegaScanNoProgress", "MegaScanSlowRank", "MegaScanThroughputDrop"}
KNOWN_SERIES = ("megascan_hang", "megascan_seconds_since_progress", "megascan_suspect_score",
                "megascan_iterations_total")


def test_rules_schema():
    document = yaml.safe_load(RULES.read_text())
    assert set(document) == {"groups"}
    names = set()
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert isinstance(rule["expr"], str) and rule["expr"].count("(") == rule["expr"].count(")")
            assert rule["labels"]["severity"] in {"critical", "warning"}
            assert rule["annotations"]["summary"]
            assert any(series in rule["expr"] for series in KNOWN_SERIES), rule["alert"]
            names.add(rule["alert"])
    assert names == EXPECTED


PROMTOOL_TESTS = textwrap.dedent("""
    rule_files: [RULES]
    evaluation_interval: 1m
    tests:
      - interval: 1m
        input_series:
          - series: 'megascan_hang{job="gpt", rank="0"}'
            values: '0 0 1 1 1 1'
          - series: 'megascan_hang{job="gpt", rank="1"}'
            values: '0 0 0 0 0 0'
          - series: 'megascan_suspect_score{job="gpt", rank="2"}'
            values: '1.6x20'
          - series: 'megascan_suspect_score{job="gpt", rank="3"}'
            values: '1x20'
        alert_rule_test:
          - eval_time: 2m
            alertname: MegaScanJobHung
            exp_alerts: []
          - eval_time: 5m
            alertname: MegaScanJobHung
            exp_alerts:
              - exp_labels: {job: gpt, severity: critical}
                exp_annotations: ANNOTATIONS_MegaScanJobHung
          - eval_time: 15m
            alertname: MegaScanSlowRank
            exp_alerts:
              - exp_labels: {job: gpt, rank: "2", severity: warning}
                exp_annotations: ANNOTATIONS_MegaScanSlowRank
      - interval: 1m
        input_series:
          - series: 'megascan_iterations_total{job="gpt", rank="0"}'
            values: '0+60x80 4800+10x60'
        alert_rule_test:
          - eval_time: 70m
            alertname: MegaScanThroughputDrop
            exp_alerts: []
          - eval_time: 120m
            alertname: MegaScanThroughputDrop
            exp_alerts:
              - exp_labels: {job: gpt, severity: warning}
                exp_annotations: ANNOTATIONS_MegaScanThroughputDrop
""")


def expected_annotations(rule: dict) -> str:
    """The rule's annotations as Prometheus renders them for the test series above (job gpt, rank 2,
    value 1.6), as a one-line YAML flow mapping."""
    import json

    rendered = {}
    for key, text in rule.get("annotations", {}).items():
        text = text.replace("{{ $labels.job }}", "gpt").replace("{{ $labels.rank }}", "2")
        rendered[key] = text.replace('{{ $value | printf "%.2f" }}', "1.60")
    return json.dumps(rendered)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_check_and_unit_tests(tmp_path):
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = tmp_path / "alerts_test.yml"
    text = PROMTOOL_TESTS.replace("RULES", str(RULES))
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            text = text.replace(f"ANNOTATIONS_{rule['alert']}", expected_annotations(rule))
    tests.write_text(text)
    run = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
