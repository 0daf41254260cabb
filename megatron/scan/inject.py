"""Fault injection for validating slow-rank detection and dynamic schedules: a rank whose
compute is FACTOR x slower (`--inject-slowdown`), a P2P link that delivers late (`--inject-link-delay`)."""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from megatron.app.config import ConfigError
from megatron.app.observer import set_observer
from megatron.app.plugins import Plugin, register_plugin

COMPUTE_SPANS = ("forward", "backward")


@dataclass(frozen=True, slots=True)
class Slowdown:
    rank: int
    factor: float
    start_iteration: int = 0

    @classmethod
    def parse(cls, text: str) -> "Slowdown":
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rank, factor = int(parts[0]), float(parts[1])
            start = int(parts[2]) if len(parts) == 3 else 0
        except ValueError:
            raise ConfigError(f"--inject-slowdown wants RANK:FACTOR[:START_ITER] (e.g. 2:1.5:10), got {text!r}") from None
        if factor < 1.0 or rank < 0 or start < 0:
            raise ConfigError(f"--inject-slowdown {text}: need RANK >= 0, FACTOR >= 1, START_ITER >= 0")
        return cls(rank, factor, start)


@dataclass(frozen=True, slots=True)
class LinkDelay:
    src: int
    dst: int
    delay_ms: float

    @classmethod
    def parse(cls, text: str) -> "LinkDelay":
        parts = text.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            src, dst, delay = int(parts[0]), int(parts[1]), float(parts[2])
        except ValueError:
            raise ConfigError(f"--inject-link-delay wants SRC:DST:MS with global ranks (e.g. 1:2:20), got {text!r}") from None
        if src < 0 or dst < 0 or src == dst or delay < 0:
            raise ConfigError(f"--inject-link-delay {text}: need two different ranks >= 0 and MS >= 0")
        return cls(src, dst, delay)


class SlowdownObserver:
    """After each forward/backward of the slowed rank, keeps the CPU busy for (FACTOR-1) x the
    time the span took, so the rank looks like a proportionally slower device. On CUDA the extra
    time is spent in matmuls on the device's current stream (a throttled GPU, not an idle one).

    When a host runs more ranks than it has cores, a busy CPU would also slow whichever rank
    shares its core, a fault a real throttled device never causes; there the extra time is
    slept instead (`mode` says which), so only the injected rank is slower."""

    def __init__(self, factor: float, start_iteration: int, device: Any, *, oversubscribed: bool = False) -> None:
        self.factor = factor
        self.start_iteration = start_iteration
        self.iteration = 0
        self.device = device
        self.injected_s = 0.0
        self._cuda = getattr(device, "type", "cpu") == "cuda"
        self._sleep = oversubscribed and not self._cuda
        self.mode = "device matmuls" if self._cuda else ("sleep (ranks outnumber cores)" if self._sleep else "busy CPU")

    @contextlib.contextmanager
    def span(self, kind: str, **attrs: Any) -> Iterator[None]:
        if kind not in COMPUTE_SPANS or self.iteration < self.start_iteration:
            yield
            return
        if self._cuda:
            import torch

            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        yield
        if self._cuda:
            import torch

            torch.cuda.synchronize(self.device)
        extra = (time.perf_counter() - started) * (self.factor - 1.0)
        self._burn(extra)
        self.injected_s += extra

    def instant(self, kind: str, **attrs: Any) -> None:
        return None

    def _burn(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        if self._cuda:
            import torch

            a = torch.randn(1024, 1024, device=self.device)
            while time.perf_counter() < deadline:
                a = (a @ a).clamp_(-1, 1)
                torch.cuda.synchronize(self.device)
            return
        if self._sleep:
            time.sleep(max(0.0, seconds))
            return
        while time.perf_counter() < deadline:
            pass


def _ranks_outnumber_cores() -> bool:
    """More ranks on this host (torchrun's LOCAL_WORLD_SIZE) than cores this process may use."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return local_ranks > cores


class _DelayedHandle:
    """Completes `delay_s` after the wrapped receive is first seen complete."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.arrived_at: float | None = None

    def _arrived(self) -> bool:
        if self.arrived_at is None and self.inner.is_completed():
            self.arrived_at = time.perf_counter()
        return self.arrived_at is not None

    def is_completed(self) -> bool:
        return self._arrived() and time.perf_counter() >= self.arrived_at + self.delay_s

    def wait(self, *args, **kwargs) -> None:
        self.inner.wait(*args, **kwargs)
        if self.arrived_at is None:
            self.arrived_at = time.perf_counter()
        remaining = self.arrived_at + self.delay_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class DelayedTransport:
    """Wraps a transport; receives from a delayed link's source complete `ms` late."""

    def __init__(self, inner, delays_from: dict[int, float]) -> None:
        self.inner = inner
        self.delays_from = delays_from  # source global rank -> seconds
        self.name = f"{getattr(inner, 'name', 'transport')}+delay"

    def post(self, sends: Sequence, recvs: Sequence) -> list:
        handles = self.inner.post(sends, recvs)
        if not recvs:
            return handles
        # post() returns send handles first, then one per receive.
        first_recv = len(handles) - len(recvs)
        for offset, message in enumerate(recvs):
            delay = self.delays_from.get(message.peer)
            if delay:
                handles[first_recv + offset] = _DelayedHandle(handles[first_recv + offset], delay)
        return handles

    def __getattr__(self, name):
        return getattr(self.inner, name)


@register_plugin
class InjectPlugin(Plugin):
    name = "inject"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("fault injection (MegaScan validation)")
        g.add_argument("--inject-slowdown", action="append", default=[], metavar="RANK:FACTOR[:START_ITER]",
                       help="make RANK's forward/backward FACTOR x slower from iteration START_ITER on; repeatable")
        g.add_argument("--inject-link-delay", action="append", default=[], metavar="SRC:DST:MS",
                       help="deliver P2P messages from global rank SRC to DST MS milliseconds late; repeatable")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(args.inject_slowdown or args.inject_link_delay)

    def configure(self, cfg) -> None:
        self.slowdowns = [Slowdown.parse(t) for t in cfg.args.inject_slowdown]
        self.delays = [LinkDelay.parse(t) for t in cfg.args.inject_link_delay]
        world = cfg.parallel.world_size
        bad = [r for r in [s.rank for s in self.slowdowns] + [d.src for d in self.delays] + [d.dst for d in self.delays]
               if r >= world]
        if bad:
            raise ConfigError(f"fault injection names rank(s) {sorted(set(bad))} but world_size is {world}")
        self.observer = None

    def setup(self, ctx) -> None:
        mine = [s for s in self.slowdowns if s.rank == ctx.rank]
        if mine:
            # Several slowdowns of one rank compound.
            factor = 1.0
            for s in mine:
                factor *= s.factor
            self.observer = SlowdownObserver(factor, min(s.start_iteration for s in mine), ctx.backend.device,
                                             oversubscribed=_ranks_outnumber_cores())
            set_observer(self.observer)
            print(f"[inject] rank {ctx.rank}: compute x{factor:g} from iteration "
                  f"{self.observer.start_iteration} ({self.observer.mode})", flush=True)
        incoming = {d.src: d.delay_ms / 1e3 for d in self.delays if d.dst == ctx.rank}
        if incoming and ctx.executor is not None:
            ctx.executor.transport = DelayedTransport(ctx.executor.transport, incoming)
            print(f"[inject] rank {ctx.rank}: messages from {sorted(incoming)} delayed "
                  f"{[incoming[s] * 1e3 for s in sorted(incoming)]} ms", flush=True)

    def before_iteration(self, ctx, iteration: int) -> None:
        if self.observer is not None:
            self.observer.iteration = iteration

