"""Plugin contract and registry. A plugin adds its own flags, is enabled by one of them, and
hooks into setup, each iteration, each optimizer step and shutdown; it may supply the
pipeline executor or the P2P transport. The trainer never tests a plugin's flag, and no plugin
reads another's: a plugin declares what it needs (`requires`), what it must follow (`after`),
what it turns on (`enables`) and what it cannot run with (`conflicts`), and `resolve_plugins`
checks and orders them; a plugin sees the other enabled plugins (`peers`) through their public
attributes only.

Plugins contribute values through hooks that return them, and the spine composes them in the
plugins' order: `configure_layout` returns the run config to validate, `rank_role` names what a
rank is, `wrap_transport` wraps each transport where it is made, `plan_iteration` says which
microbatches each replica runs. Nothing a plugin hands over is set on another object later."""
from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from megatron.app.config import ConfigError


@dataclass(frozen=True, slots=True)
class RankRole:
    """A rank's part where a plugin splits ranks into roles: its `name` (in trace file names) and
    whether it is `secondary` (it mirrors state held by another rank: it joins every collective,
    but prints no training log and writes no checkpoint files)."""

    name: str = ""
    secondary: bool = False


class Plugin:
    """Base class with no-op hooks; subclasses override what they need."""

    name: str = "plugin"
    flag: str = ""  # the flag that turns it on, for messages ("--trace")
    requires: tuple[str, ...] = ()  # plugins that must be on and set up before this one
    after: tuple[str, ...] = ()  # plugins set up before this one when they are on
    enables: tuple[str, ...] = ()  # plugins turned on with this one unless their flags say no
    conflicts: dict[str, str] = {}  # plugin name -> why the two cannot run together
    peers: dict[str, "Plugin"] = {}  # the other enabled plugins by name, set by resolve_plugins

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add an argument group with this plugin's flags."""

    def enabled(self, args: argparse.Namespace) -> bool | None:
        """Whether the flags turn this plugin on; None: its flags do not say, so it is on only
        when an enabled plugin lists it in `enables`."""
        return False

    def configure_layout(self, cfg):
        """Before the config is validated: a plugin that changes how ranks are used returns the
        config to run instead (e.g. `dataclasses.replace(cfg, parallel=...)` with world_size the size
        of the training mesh), or None to keep it; raise ConfigError. The config is frozen: this is
        the one place it may change."""
        return None

    def rank_role(self, cfg, rank: int) -> "RankRole | None":
        """What global rank `rank` is, where this plugin splits ranks into roles (the role names
        trace files; a secondary rank prints no training log and writes no checkpoint), or None."""
        return None

    def wrap_transport(self, ctx, transport):
        """Return `transport` wrapped (e.g. delayed links), or `transport` itself. Called for every
        transport the trainer or a step runner makes, in the plugins' order."""
        return transport

    def plan_iteration(self, ctx, iteration: int, plan):
        """Before iteration `iteration`: return the MicrobatchPlan (which of the global batch's
        microbatches each data-parallel replica runs) given the one planned so far (the even
        split, or an earlier plugin's), or None to keep it."""
        return None

    def configure(self, cfg) -> None:
        """Validate/adjust the run config before any work starts (raise ConfigError)."""

    def model_parallel_initializer(self, cfg):
        """Return a callable `(tp, pp, vpp) -> None` that sets up megatron-core's parallel state
        instead of `parallel_state.initialize_model_parallel`, or None."""
        return None

    def setup(self, ctx) -> None:
        """Called once the process groups, model, optimizer and data exist."""

    def split_backward(self, cfg) -> bool | None:
        """Whether this plugin's executor runs each backward as I and W (the layout then lists
        them), or None."""

    def make_executor(self, ctx):
        """Return a pipeline executor to use instead of the static one, or None."""
        return None

    def make_transport(self, ctx):
        """Return a P2P transport to use instead of torch.distributed, or None."""
        return None

    def make_step_runner(self, ctx):
        """Return a callable `(ctx, plugins) -> metrics` that runs one whole training iteration
        (schedule, grad sync, optimizer step) on this rank instead of the trainer's, or None."""
        return None

    def make_evaluator(self, ctx):
        """Return a callable `(ctx, iteration) -> validation loss or None` that replaces the
        trainer's forward-only evaluation on this rank (None: this rank does not evaluate), or None."""
        return None

    def load_checkpoint(self, ctx):
        """Resume this rank from `--load` instead of the trainer's full load (model, optimizer, RNG):
        return (iteration, consumed_samples), or None to leave it to the trainer."""
        return None

    def overrides(self, hook: str) -> bool:
        """Whether this plugin supplies its own `hook` (e.g. "make_step_runner")."""
        return getattr(type(self), hook) is not getattr(Plugin, hook)

    # Every iteration hook gets the same number: the index of the iteration (0 for the first; the
    # training log prints index + 1).
    def before_iteration(self, ctx, iteration: int) -> None: ...

    def after_iteration(self, ctx, iteration: int, metrics: dict[str, Any]) -> None: ...

    def before_optimizer_step(self, ctx, iteration: int) -> None: ...

    def after_optimizer_step(self, ctx, iteration: int) -> None: ...

    def shutdown(self, ctx) -> None: ...


_REGISTRY: dict[str, Callable[[], Plugin]] = {}
# Plugins shipped in this distribution, imported lazily so a missing optional dependency of
# one plugin never breaks training without it. Modules register themselves on import.
_BUILTIN_MODULES: tuple[str, ...] = ("megatron.scan.plugin", "megatron.scan.inject", "megatron.scan.watchdog", "megatron.scan.metrics", "megatron.scope.plugin",
                                     "megatron.scan.detect.online", "megatron.fbd.plugin", "megatron.dpp.plugin",
                                     "megatron.mitigation.plugin")


def register_plugin(factory: Callable[[], Plugin]) -> Callable[[], Plugin]:
    """Class decorator / function to make a plugin known by its `name`."""
    name = getattr(factory, "name", None) or factory().name
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"plugin name {name!r} is registered twice")
    _REGISTRY[name] = factory
    return factory


def unregister_plugin(name: str) -> None:
    _REGISTRY.pop(name, None)


def available_plugins() -> list[Plugin]:
    """Every registered plugin: the built-in ones plus modules named in MEGATRON_APP_PLUGINS
    (comma-separated import paths), which lets a user add a plugin without editing this package."""
    extra = [m.strip() for m in os.environ.get("MEGATRON_APP_PLUGINS", "").split(",") if m.strip()]
    for module in extra:
        importlib.import_module(module)  # a typo here should fail loudly, not silently skip
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # pragma: no cover - depends on optional extras
            print(f"[plugins] {module} unavailable: {exc}")
    return [factory() for factory in _REGISTRY.values()]  # registration order


def resolve_plugins(candidates: list[Plugin], args: argparse.Namespace) -> "PluginSet":
    """The plugins the flags turn on (and those they enable), checked and ordered: a missing
    requirement or a conflict is a ConfigError listing every problem; a plugin comes after what
    it requires or follows, otherwise in registration order; a cycle is a ConfigError."""
    by_name = {plugin.name: plugin for plugin in candidates}
    decided = {plugin.name: plugin.enabled(args) for plugin in candidates}
    on = {name for name, choice in decided.items() if choice}
    grown = True
    while grown:  # `enables` is transitive
        grown = False
        for name in list(on):
            for other in by_name[name].enables:
                if other in by_name and decided[other] is None and other not in on:
                    on.add(other)
                    grown = True
    problems = []
    for name in sorted(on, key=list(by_name).index):
        plugin = by_name[name]
        for needed in plugin.requires:
            if needed not in on:
                wanted = by_name.get(needed)
                flag = f" ({wanted.flag})" if wanted is not None and wanted.flag else ""
                problems.append(f"{plugin.flag or name} needs the {needed} plugin{flag}: add its flag")
        for other, why in plugin.conflicts.items():
            if other in on:
                problems.append(f"{plugin.flag or name} cannot run with {by_name[other].flag or other}: {why}")
    if problems:
        raise ConfigError("; ".join(problems))
    ordered: list[Plugin] = []
    placing: list[str] = []

    def place(name: str) -> None:
        if any(plugin.name == name for plugin in ordered):
            return
        if name in placing:
            cycle = placing[placing.index(name):] + [name]
            raise ConfigError(f"plugins depend on each other in a cycle: {' -> '.join(cycle)}")
        placing.append(name)
        plugin = by_name[name]
        for before in (*plugin.requires, *plugin.after):
            if before in on:
                place(before)
        placing.pop()
        ordered.append(plugin)

    for name in by_name:
        if name in on:
            place(name)
    for plugin in ordered:
        plugin.peers = {other.name: other for other in ordered if other is not plugin}
    return PluginSet(ordered)


class PluginSet:
    """The enabled plugins, in the order resolve_plugins gave them (requirements first)."""

    def __init__(self, plugins: list[Plugin]) -> None:
        self.plugins = plugins

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.plugins]

    def call(self, hook: str, *args: Any) -> None:
        for plugin in self.plugins:
            getattr(plugin, hook)(*args)

    def compose(self, hook: str, value: Any, *args: Any) -> Any:
        """`value` passed through each plugin's `hook(*args, value)` in order; a plugin returning
        None keeps the value it was given."""
        for plugin in self.plugins:
            made = getattr(plugin, hook)(*args, value)
            if made is not None:
                value = made
        return value

    def first(self, factory_hook: str, *args: Any):
        """The first non-None object a plugin supplies (executor, transport, step runner...)."""
        for plugin in self.plugins:
            made = getattr(plugin, factory_hook)(*args)
            if made is not None:
                return made
        return None
