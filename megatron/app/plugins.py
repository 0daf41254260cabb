"""Plugin contract and registry. A plugin adds its own flags, is enabled by one of them, and
hooks into setup, each iteration, each optimizer step and shutdown; it may supply the
pipeline executor or the P2P transport. The trainer never tests a plugin's flag."""
from __future__ import annotations

import argparse
import importlib
import os
from typing import Any, Callable


class Plugin:
    """Base class with no-op hooks; subclasses override what they need."""

    name: str = "plugin"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add an argument group with this plugin's flags."""

    def enabled(self, args: argparse.Namespace) -> bool:
        """Whether the flags turn this plugin on."""
        return False

    def configure_layout(self, cfg) -> None:
        """Before the config is validated: a plugin that changes how ranks are used may rewrite
        cfg.parallel (e.g. make world_size the size of the training mesh); raise ConfigError."""

    def configure(self, cfg) -> None:
        """Validate/adjust the run config before any work starts (raise ConfigError)."""

    def model_parallel_initializer(self, cfg):
        """Return a callable `(tp, pp, vpp) -> None` that sets up megatron-core's parallel state
        instead of `parallel_state.initialize_model_parallel`, or None."""
        return None

    def setup(self, ctx) -> None:
        """Called once the process groups, model, optimizer and data exist."""

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

    def before_iteration(self, ctx, iteration: int) -> None: ...

    def after_iteration(self, ctx, iteration: int, metrics: dict[str, Any]) -> None: ...

    def before_optimizer_step(self, ctx, iteration: int) -> None: ...

    def after_optimizer_step(self, ctx, iteration: int) -> None: ...

    def shutdown(self, ctx) -> None: ...


_REGISTRY: dict[str, Callable[[], Plugin]] = {}
# Plugins shipped in this distribution, imported lazily so a missing optional dependency of
# one plugin never breaks training without it. Modules register themselves on import.
_BUILTIN_MODULES: tuple[str, ...] = ("megatron.scan.plugin", "megatron.scan.inject", "megatron.scan.watchdog", "megatron.scan.metrics", "megatron.scope.plugin",
                                     "megatron.scan.detect.online", "megatron.fbd.plugin", "megatron.dpp.plugin")


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
    return [factory() for _, factory in sorted(_REGISTRY.items())]


class PluginSet:
    """The enabled plugins, called in registration order."""

    def __init__(self, plugins: list[Plugin]) -> None:
        self.plugins = plugins

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.plugins]

    def call(self, hook: str, *args: Any) -> None:
        for plugin in self.plugins:
            getattr(plugin, hook)(*args)

    def first(self, factory_hook: str, *args: Any):
        """The first non-None object a plugin supplies (executor, transport, step runner...)."""
        for plugin in self.plugins:
            made = getattr(plugin, factory_hook)(*args)
            if made is not None:
                return made
        return None
