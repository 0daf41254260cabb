"""Straggler mitigation's Prometheus series go into the metrics plugin's public registry, served
with MegaScan's; without --metrics-port there are none."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.mitigation.plugin import MitigationPlugin


def test_the_series_go_into_the_metrics_plugins_registry():
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from megatron.scan.metrics import MetricsPlugin, RankMetrics

    metrics = MetricsPlugin()
    metrics.metrics = RankMetrics({"rank": 3, "world_size": 4, "local_rank": 3})  # what its setup makes
    plugin = MitigationPlugin()
    plugin.peers, plugin.nominal = {"scan_metrics": metrics}, 6
    gauges = plugin._gauges(SimpleNamespace(rank=3))
    page = generate_latest(metrics.registry).decode()
    assert 'megascan_mitigation_microbatches{rank="3"} 6.0' in page
    assert 'megascan_mitigation_replica_speed{rank="3"} 1.0' in page
    gauges["changes"].inc()
    assert 'megascan_mitigation_changes_total{rank="3"} 1.0' in generate_latest(metrics.registry).decode()


def test_without_metrics_there_are_no_series():
    plugin = MitigationPlugin()
    plugin.peers, plugin.nominal = {}, 6
    assert plugin._gauges(SimpleNamespace(rank=0)) is None
    pytest.importorskip("prometheus_client")
    from megatron.scan.metrics import MetricsPlugin

    plugin.peers = {"scan_metrics": MetricsPlugin()}  # not set up: no registry yet
    assert plugin._gauges(SimpleNamespace(rank=0)) is None
