"""How MegaScan's pieces find each other: --trace-dir resolved once (TraceConfig) and taken from the
scan plugin's config by the watchdog, metrics and online detection, and by launched workers
through TraceConfig.from_env; the collective wrappers' original found through `untraced`; the
metrics registry public. The source rules at the end fail where a module goes around them."""
from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron.app.plugins import resolve_plugins
from megatron.scan import launcher
from megatron.scan.collectives import CollectiveObserver, is_wrapper, mark_wrapper, untraced
from megatron.scan.detect.online import OnlineDetectPlugin
from megatron.scan.plugin import ScanPlugin
from megatron.scan.session import SESSION_VARIABLE, TRACE_DIR_VARIABLE, TraceConfig, launch_requested
from megatron.scan.watchdog import WatchdogPlugin

ROOT = Path(__file__).resolve().parents[2]


def _plugins():
    from megatron.scan.metrics import MetricsPlugin

    return [ScanPlugin(), WatchdogPlugin(), MetricsPlugin(), OnlineDetectPlugin()]


def _configured(argv: list[str], scan_directory: Path | None = None):
    """The plugins the flags turn on, configured in order; `scan_directory` replaces the scan
    plugin's directory once it is configured (what the others write to must follow it)."""
    pytest.importorskip("prometheus_client")
    candidates = _plugins()
    parser = argparse.ArgumentParser()
    for plugin in candidates:
        plugin.add_arguments(parser)
    args = parser.parse_args(argv)
    plugins = resolve_plugins(candidates, args)
    cfg = SimpleNamespace(args=args)
    for plugin in plugins.plugins:
        plugin.configure(cfg)
        if plugin.name == "scan" and scan_directory is not None:
            plugin.config = dataclasses.replace(plugin.config, directory=scan_directory)
    return {plugin.name: plugin for plugin in plugins.plugins}


def test_the_watchdog_metrics_and_online_detection_write_where_the_scan_plugin_says(tmp_path):
    elsewhere = tmp_path / "resolved"
    on = _configured(["--trace", "--trace-dir", str(tmp_path / "flag"), "--metrics-port", "0", "--online-detect"],
                     scan_directory=elsewhere)
    assert set(on) == {"scan", "scan_watchdog", "scan_metrics", "online_detect"}
    directory = on["scan"].config.directory
    assert directory == elsewhere
    assert on["scan_watchdog"].directory is directory and on["scan_metrics"].directory is directory
    assert on["online_detect"].trace_dir is directory  # a Path, handed on as it is


def test_without_trace_the_watchdog_and_metrics_read_the_same_flags_through_trace_config(tmp_path):
    on = _configured(["--hang-timeout", "30", "--trace-dir", str(tmp_path / "d"), "--metrics-port", "0"])
    assert set(on) == {"scan_watchdog", "scan_metrics"}
    assert on["scan_watchdog"].directory == on["scan_metrics"].directory == tmp_path / "d"


def test_a_launched_worker_reads_its_trace_config_through_one_constructor(tmp_path):
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    options = launcher.launch_options(parser.parse_args(["--trace-dir", str(tmp_path / "a"), "--trace-interval", "3",
                                                         "--continuous-trace-iterations", "1"]))
    env = launcher.launch_environment(options, base={})
    assert launch_requested(env) and not launch_requested({})
    assert TraceConfig.from_env(env) == options.trace == launcher.options_from_environment(env).trace
    env[TRACE_DIR_VARIABLE] = str(tmp_path / "b")  # a printed environment edited for another node
    assert TraceConfig.from_env(env) == dataclasses.replace(options.trace, directory=tmp_path / "b")
    assert launcher.options_from_environment(env).trace == TraceConfig.from_env(env)
    by_hand = {TRACE_DIR_VARIABLE: str(tmp_path / "c"), "MEGASCAN_TRACE_INTERVAL": "3",
               "MEGASCAN_CONTINUOUS_ITERATIONS": "1"}
    assert launch_requested(by_hand) and SESSION_VARIABLE not in by_hand
    assert TraceConfig.from_env(by_hand) == dataclasses.replace(options.trace, directory=tmp_path / "c")


def test_untraced_finds_the_function_a_wrapper_wraps():
    def original():
        return "original"

    def wrapper():
        return "wrapped"

    assert untraced(original) is original and not is_wrapper(original)
    assert mark_wrapper(wrapper, original) is wrapper
    assert untraced(wrapper) is original and is_wrapper(wrapper)
    before = dist.all_reduce
    observer = CollectiveObserver(now=lambda: 0, sink=lambda *args: None)
    observer.install(())
    try:
        assert dist.all_reduce is not before and is_wrapper(dist.all_reduce)
        assert untraced(dist.all_reduce) is before
        again = CollectiveObserver(now=lambda: 0, sink=lambda *args: None)
        assert untraced(again._wrap("all_reduce", untraced(dist.all_reduce))) is before  # never a wrapper's wrapper
    finally:
        observer.uninstall()
    assert dist.all_reduce is before


def test_the_metrics_plugin_shares_its_registry():
    pytest.importorskip("prometheus_client")
    from megatron.scan.metrics import MetricsPlugin, RankMetrics

    plugin = MetricsPlugin()
    assert plugin.registry is None  # before setup
    plugin.metrics = RankMetrics({"rank": 0, "world_size": 1, "local_rank": 0})
    assert plugin.registry is plugin.metrics.registry


# --- source rules --------------------------------------------------------------------------


def _sources():
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        if "node_modules" not in path.parts:
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _breaches(allowed: str, found) -> list[str]:
    return [f"{name}:{node.lineno}" for name, tree in _sources() if name != allowed
            for node in ast.walk(tree) if found(node)]


def test_only_collectives_py_knows_how_a_wrapper_is_marked():
    marker = "__megascan_original__"
    breaches = _breaches("megatron/scan/collectives.py", lambda node: (
        isinstance(node, ast.Constant) and node.value == marker) or (isinstance(node, ast.Attribute)
                                                                     and node.attr == marker))
    assert not breaches, f"use megatron.scan.collectives.untraced / mark_wrapper instead: {breaches}"


def test_only_session_py_reads_the_trace_directory_from_flags_or_environment():
    def found(node) -> bool:
        if isinstance(node, ast.Constant) and node.value == TRACE_DIR_VARIABLE:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "trace_dir":
            owner = node.value
            return (owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")) == "args"
        return False

    breaches = _breaches("megatron/scan/session.py", found)
    assert not breaches, ("resolve --trace-dir through TraceConfig (the scan plugin's config, shared_trace_config, "
                          f"TraceConfig.from_env) and test the environment with launch_requested: {breaches}")


def test_a_ranks_compute_spans_are_named_in_one_place():
    def found(node) -> bool:
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        return any(isinstance(t, ast.Name) and t.id in ("COMPUTE_SPANS", "COMPUTE_KINDS") for t in targets)

    breaches = _breaches("megatron/scan/speed.py", found)
    assert not breaches, f"import COMPUTE_SPANS from megatron.scan.speed: {breaches}"
