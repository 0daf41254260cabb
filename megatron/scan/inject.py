"""Fault injection for validating slow-rank detection and dynamic schedules: a rank whose device
computes FACTOR x slower (`--inject-slowdown`) or stalls now and then (`--inject-stall`), the extra
time spent inside each transformer layer's forward and backward; a P2P link that delivers late
(`--inject-link-delay`)."""
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
from megatron.scan.layers import LayerWatcher, transformer_layers, unwatch_layers, watch_layers
from megatron.scan.speed import COMPUTE_SPANS


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
class Stall:
    """RANK's device is away STALL_MS at a time, at most once every EVERY_MS, from START_ITER on."""

    rank: int
    stall_ms: float
    every_ms: float
    start_iteration: int = 0

    FORM = "RANK:STALL_MS:EVERY_MS[:START_ITER] (e.g. 1:50:500:10: rank 1 stalls 50 ms every 500 ms from iteration 10)"

    @classmethod
    def parse(cls, text: str) -> "Stall":
        parts = text.split(":")
        try:
            if len(parts) not in (3, 4):
                raise ValueError
            rank, stall_ms, every_ms = int(parts[0]), float(parts[1]), float(parts[2])
            start = int(parts[3]) if len(parts) == 4 else 0
        except ValueError:
            raise ConfigError(f"--inject-stall wants {cls.FORM}, got {text!r}") from None
        problems = [need for need, bad in (("RANK >= 0", rank < 0), ("STALL_MS > 0", not stall_ms > 0),
                                           ("EVERY_MS > STALL_MS", not every_ms > stall_ms),
                                           ("START_ITER >= 0", start < 0)) if bad]
        if problems:
            raise ConfigError(f"--inject-stall {text}: need {', '.join(problems)}; the form is {cls.FORM}")
        return cls(rank, stall_ms, every_ms, start)


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


class Burner:
    """Spends injected time the way a slower device would. On CUDA: matmuls on the device's current
    stream (a throttled GPU, not an idle one). On CPU: a busy loop, or a sleep when a host runs more
    ranks than it has cores, where a busy loop would also slow whichever rank shares the core, a
    fault a real slow device never causes (`mode` says which)."""

    def __init__(self, device: Any = None, *, oversubscribed: bool = False) -> None:
        self.device = device
        self._cuda = getattr(device, "type", "cpu") == "cuda"
        self._sleep = oversubscribed and not self._cuda
        self._matrix = None
        self.mode = "device matmuls" if self._cuda else ("sleep (ranks outnumber cores)" if self._sleep else "busy CPU")

    def clock(self) -> Any:
        """A token for `since`: a CUDA event on the current stream, else the host clock."""
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def since(self, token: Any) -> float:
        """Seconds the device worked since `clock()` returned `token` (waits for it on CUDA)."""
        if self._cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return token.elapsed_time(end) / 1e3
        return time.perf_counter() - token

    def burn(self, seconds: float) -> None:
        if seconds <= 0:
            return
        deadline = time.perf_counter() + seconds
        if self._cuda:
            import torch

            if self._matrix is None:
                self._matrix = torch.randn(1024, 1024, device=self.device)
            a = self._matrix
            while time.perf_counter() < deadline:
                (a @ a).clamp_(-1, 1)
                torch.cuda.synchronize(self.device)
            return
        if self._sleep:
            time.sleep(seconds)
            return
        while time.perf_counter() < deadline:
            pass


class DeviceFault(LayerWatcher):
    """One rank's slower device: every piece of its compute that took T takes FACTOR x T (the
    slowdowns in force, compounded), and while a stall schedule is in force, the first compute
    at least EVERY_MS after the last stall began stalls STALL_MS (a time-shared or preempted device).

    The extra time is spent inside the work: after each transformer layer's forward, and inside
    autograd after each layer's backward (`attach` with the layers), so every traced span around
    the layer (forward, backward, layer scopes) lengthens as on a slow device. A model with no
    transformer layers found gets it at the end of each forward/backward span instead, while the
    span is still open. A split backward's W (the `backward_weight` span) runs outside the layers'
    hooks, so with `attach(..., weight_grads=True)` it is slowed at the end of its span too (this
    object is then an observer as well)."""

    adds_work = True

    def __init__(self, slowdowns: Sequence[Slowdown] = (), stalls: Sequence[Stall] = (), *,
                 burner: Burner | None = None) -> None:
        self.slowdowns = tuple(slowdowns)
        self.stalls = tuple(stalls)
        self.burner = burner or Burner()
        self.start_iteration = min((s.start_iteration for s in (*self.slowdowns, *self.stalls)), default=0)
        self.factor = 1.0
        self._stalls_in_force: tuple[int, ...] = ()  # indices into `stalls`
        self._last_stall: dict[int, float] = {}  # index -> when its last stall began
        self.layers: list = []
        self.attached = False
        self.injected_s = 0.0
        self.stall_count = 0
        self._observing = False

    def begin_iteration(self, iteration: int) -> None:
        self.factor = 1.0
        for slowdown in self.slowdowns:
            if iteration >= slowdown.start_iteration:
                self.factor *= slowdown.factor
        self._stalls_in_force = tuple(i for i, s in enumerate(self.stalls) if iteration >= s.start_iteration)

    def attach(self, layers: Sequence[Any], *, weight_grads: bool = False) -> None:
        """Start slowing: per layer when there are layers, else per forward/backward span; with
        `weight_grads` (backwards split into I and W) every W span as well."""
        self.layers = list(layers)
        if self.layers:
            watch_layers(self.layers, self)
        if not self._observing and (weight_grads or not self.layers):
            set_observer(self)
            self._observing = True
        self.attached = True

    def detach(self) -> None:
        if self.layers:
            unwatch_layers(self.layers, self)
        self.attached = False

    def compute_done(self, seconds: float) -> None:
        """`seconds` of compute just finished: spend what a slower device would add to it."""
        extra = seconds * (self.factor - 1.0)
        now = time.perf_counter()
        for index in self._stalls_in_force:
            stall = self.stalls[index]
            last = self._last_stall.get(index)
            if last is None or now - last >= stall.every_ms / 1e3:
                self._last_stall[index] = now + extra  # it begins once the time queued before it is spent
                extra += stall.stall_ms / 1e3
                self.stall_count += 1
        if extra > 0:
            self.burner.burn(extra)
            self.injected_s += extra

    # --- layer hooks -------------------------------------------------------------------
    def forward_begin(self, layer):
        return self.burner.clock()

    def forward_end(self, layer, begun):
        self.compute_done(self.burner.since(begun))

    def backward_begin(self, layer, state, chained):
        return self.burner.clock()

    def backward_end(self, layer, state, begun):
        self.compute_done(self.burner.since(begun))

    # --- observer: W's span, and every compute span of models without transformer layers --
    @contextlib.contextmanager
    def span(self, kind: str, **attrs: Any) -> Iterator[None]:
        slowed = kind == "backward_weight" or (kind in COMPUTE_SPANS and not self.layers)
        if not slowed or not self.attached:
            yield
            return
        begun = self.burner.clock()
        yield
        self.compute_done(self.burner.since(begun))

    def instant(self, kind: str, **attrs: Any) -> None:
        return None


def ranks_outnumber_cores() -> bool:
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
    flag = "--inject-slowdown"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("MegaScan fault injection (validation)")
        g.add_argument("--inject-slowdown", action="append", default=[], metavar="RANK:FACTOR[:START_ITER]",
                       help="make RANK's device FACTOR x slower from iteration START_ITER on: each transformer "
                            "layer's forward and backward takes FACTOR x as long; repeatable (factors compound)")
        g.add_argument("--inject-stall", action="append", default=[], metavar="RANK:STALL_MS:EVERY_MS[:START_ITER]",
                       help="make RANK's device stall STALL_MS whenever it computes and EVERY_MS have passed since "
                            "its last stall began (a time-shared or preempted device), from iteration START_ITER "
                            "on; repeatable")
        g.add_argument("--inject-link-delay", action="append", default=[], metavar="SRC:DST:MS",
                       help="deliver P2P messages from global rank SRC to DST MS milliseconds late; repeatable")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(args.inject_slowdown or args.inject_stall or args.inject_link_delay)

    def configure(self, cfg) -> None:
        self.slowdowns = [Slowdown.parse(t) for t in cfg.args.inject_slowdown]
        self.stalls = [Stall.parse(t) for t in cfg.args.inject_stall]
        self.delays = [LinkDelay.parse(t) for t in cfg.args.inject_link_delay]
        # Global ranks of the job: a plugin may have made cfg.parallel's world the training mesh only
        # (MegaFBD's backward instances), while a fault may name any rank.
        world = int(os.environ.get("WORLD_SIZE", cfg.parallel.world_size))
        named = ([s.rank for s in self.slowdowns] + [s.rank for s in self.stalls]
                 + [d.src for d in self.delays] + [d.dst for d in self.delays])
        bad = [r for r in named if r >= world]
        if bad:
            raise ConfigError(f"fault injection names rank(s) {sorted(set(bad))} but world_size is {world}")
        if self.delays and cfg.training.pipeline_schedule == "megatron-core":
            raise ConfigError("--inject-link-delay delays this trainer's pipeline transport, which "
                              "--pipeline-schedule megatron-core does not use (megatron-core sends through "
                              "torch.distributed itself); pick another --pipeline-schedule or drop the delay")
        self.fault = None

    def _incoming(self, rank: int) -> dict[int, float]:
        """Source global rank -> seconds, for the links into `rank` that deliver late."""
        return {d.src: d.delay_ms / 1e3 for d in self.delays if d.dst == rank}

    def wrap_transport(self, ctx, transport):
        """Receives from a delayed link's source complete late, on every transport this rank makes
        (the trainer's executor, MegaDPP's, MegaFBD's roles)."""
        incoming = self._incoming(ctx.rank)
        return DelayedTransport(transport, incoming) if incoming else transport

    def setup(self, ctx) -> None:
        slowdowns = [s for s in self.slowdowns if s.rank == ctx.rank]
        stalls = [s for s in self.stalls if s.rank == ctx.rank]
        if slowdowns or stalls:
            self.fault = DeviceFault(slowdowns, stalls,
                                     burner=Burner(ctx.backend.device, oversubscribed=ranks_outnumber_cores()))
            self.layers = transformer_layers(ctx.chunks)
            where = ("per transformer layer" if self.layers
                     else "at the end of each forward/backward span: no transformer layers found")
            mode = self.fault.burner.mode
            for s in slowdowns:
                print(f"[inject] rank {ctx.rank}: compute x{s.factor:g} from iteration {s.start_iteration}, "
                      f"{where} ({mode})", flush=True)
            for s in stalls:
                print(f"[inject] rank {ctx.rank}: stalls of {s.stall_ms:g} ms every {s.every_ms:g} ms from "
                      f"iteration {s.start_iteration}, {where} ({mode})", flush=True)
        incoming = self._incoming(ctx.rank)
        if incoming:
            print(f"[inject] rank {ctx.rank}: messages from {sorted(incoming)} delayed "
                  f"{[incoming[s] * 1e3 for s in sorted(incoming)]} ms", flush=True)

    def before_iteration(self, ctx, iteration: int) -> None:
        fault = self.fault
        if fault is None:
            return
        fault.begin_iteration(iteration)
        # Attached only from START_ITER on, and after every plugin's setup: in the fallback the
        # fault's observer is then the innermost one, so its time lies inside the others' spans.
        if not fault.attached and iteration >= fault.start_iteration:
            layout = getattr(ctx, "layout", None)
            fault.attach(self.layers, weight_grads=layout is not None and layout.split_backward)

    def shutdown(self, ctx) -> None:
        if self.fault is not None and self.fault.attached:
            self.fault.detach()
