"""The plugin registry: plugins declare what they need, follow, enable and conflict with; the
registry checks and orders them, and no plugin reads another plugin's flags."""
from __future__ import annotations

import argparse
import inspect
import re

import pytest

from megatron.app.config import ConfigError
from megatron.app.plugins import Plugin, available_plugins, resolve_plugins
from megatron.app.train import parse

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--mock-data",
        "--vocab-size", "64"]


def _plugin(name: str, on: bool | None = True, **declared) -> Plugin:
    attributes = {"name": name, "flag": f"--{name}", "enabled": lambda self, args: on, **declared}
    return type(f"P_{name}", (Plugin,), attributes)()


def test_requirements_and_followers_come_first_whatever_the_registration_order():
    plugins = [_plugin("metrics", after=("watchdog", "tracer")), _plugin("detect", requires=("tracer",)),
               _plugin("watchdog", after=("tracer",)), _plugin("tracer"), _plugin("other")]
    ordered = resolve_plugins(plugins, argparse.Namespace()).names
    assert ordered == ["tracer", "watchdog", "metrics", "detect", "other"]
    detect = next(p for p in plugins if p.name == "detect")
    assert set(detect.peers) == {"tracer", "watchdog", "metrics", "other"}


def test_a_missing_requirement_names_the_flag_to_add():
    plugins = [_plugin("detect", requires=("tracer",)), _plugin("tracer", on=False)]
    with pytest.raises(ConfigError, match=r"--detect needs the tracer plugin \(--tracer\): add its flag"):
        resolve_plugins(plugins, argparse.Namespace())


def test_a_cycle_is_named():
    plugins = [_plugin("a", after=("b",)), _plugin("b", requires=("c",)), _plugin("c", after=("a",))]
    with pytest.raises(ConfigError, match=r"cycle: a -> b -> c -> a"):
        resolve_plugins(plugins, argparse.Namespace())


def test_conflicts_and_enables():
    with pytest.raises(ConfigError, match=r"--x cannot run with --y: both replace the step"):
        resolve_plugins([_plugin("x", conflicts={"y": "both replace the step"}), _plugin("y")], argparse.Namespace())
    undecided, refused = _plugin("helper", on=None), _plugin("refused", on=False)
    names = resolve_plugins([_plugin("main", enables=("helper", "refused")), undecided, refused],
                            argparse.Namespace()).names
    assert names == ["main", "helper"]  # `refused` said no through its own flags
    assert resolve_plugins([undecided], argparse.Namespace()).names == []


def test_the_trainers_plugins_are_ordered_by_what_they_declare():
    _, plugins = parse(BASE + ["--trace", "--trace-dir", "/tmp/unused-trace", "--online-detect",
                               "--metrics-port", "0", "--trace-interval", "4", "--continuous-trace-iterations", "2"])
    names = plugins.names
    assert names.index("scan") < names.index("scan_watchdog") < names.index("scan_metrics")
    assert names.index("scan") < names.index("online_detect")
    online = plugins.plugins[names.index("online_detect")]
    assert (online.interval, online.continuous) == (4, 2)  # from the tracer plugin's typed config
    _, plugins = parse(BASE + ["--trace", "--hang-timeout", "0"])
    assert "scan_watchdog" not in plugins.names
    with pytest.raises(ConfigError, match=r"--online-detect needs the scan plugin \(--trace\)"):
        parse(BASE + ["--online-detect"])
    with pytest.raises(ConfigError, match=r"--forward-backward-disaggregating cannot run with --use-dpp"):
        parse(BASE + ["--pipeline-model-parallel-size", "2", "--forward-backward-disaggregating", "--use-dpp"])


def test_no_plugin_reads_another_plugins_flags():
    plugins = [p for p in available_plugins() if type(p).__module__.startswith("megatron.")]
    owned: dict[str, str] = {}
    for plugin in plugins:
        parser = argparse.ArgumentParser(add_help=False)
        plugin.add_arguments(parser)
        owned.update({action.dest: plugin.name for action in parser._actions})
    assert {"trace", "use_dpp", "forward_backward_disaggregating", "metrics_port", "hang_timeout"} <= set(owned)
    reads = re.compile(r"\bargs\.(\w+)|getattr\(\w*args, \"(\w+)\"")
    trespass = []
    for plugin in plugins:
        source = inspect.getsource(inspect.getmodule(type(plugin)))
        for match in reads.finditer(source):
            dest = match.group(1) or match.group(2)
            if owned.get(dest, plugin.name) != plugin.name:
                trespass.append(f"{plugin.name} reads --{dest.replace('_', '-')} of {owned[dest]}")
    assert not trespass, trespass


def test_hooks_that_return_values_are_composed_in_the_plugins_order():
    """Each plugin gets the value the one before it returned; None keeps it."""
    seen = []

    def wrap(tag):
        def wrap_transport(self, ctx, transport):
            seen.append((tag, transport))
            return f"{tag}({transport})"
        return wrap_transport

    plugins = resolve_plugins([_plugin("outer", after=("inner",), wrap_transport=wrap("outer")),
                               _plugin("keeps", wrap_transport=lambda self, ctx, transport: None),
                               _plugin("inner", wrap_transport=wrap("inner"))], argparse.Namespace())
    assert plugins.names == ["inner", "outer", "keeps"]
    assert plugins.compose("wrap_transport", "torch", None) == "outer(inner(torch))"
    assert seen == [("inner", "torch"), ("outer", "inner(torch)")]


def test_the_run_config_is_frozen_and_a_layout_change_is_a_returned_config(monkeypatch):
    """A plugin cannot change the config behind the trainer's back; MegaFBD's layout change is the
    config its configure_layout returns, validated like any other (the training mesh is the
    backward instances: 4 ranks of which 2 train)."""
    import dataclasses

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cfg, plugins = parse([*BASE, "--pipeline-model-parallel-size", "2", "--forward-backward-disaggregating"])
    assert cfg.parallel.world_size == 2 and plugins.names == ["fbd"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.world_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = cfg.model


def test_rank_roles_come_from_the_plugin_before_anything_is_built(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cfg, plugins = parse([*BASE, "--pipeline-model-parallel-size", "2", "--forward-backward-disaggregating"])
    roles = [plugins.first("rank_role", cfg, rank) for rank in range(4)]
    # Backward instances are the training mesh's ranks 0-1; their forward twins are ranks 2-3.
    assert [(role.name, role.secondary) for role in roles] == [("bwd", False), ("bwd", False), ("fwd", True),
                                                               ("fwd", True)]
