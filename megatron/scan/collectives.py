"""Observes every torch.distributed collective by wrapping the functions themselves, so that
megatron-core's own TP/DP communication is traced without editing it. Each call gets a per-group
sequence number (counted always, recorded only inside traced windows) for cross-rank matching."""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from megatron.app import observer as spine
from megatron.scan.trace_format import FLAG_ASYNC

# Collectives worth tracing. Object collectives (all_gather_object, ...) are left out on purpose:
# they are built from these, so their inner tensor collectives are what gets recorded.
COLLECTIVE_FUNCTIONS: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "gather", "scatter",
    # torch 2.13's names for the one-tensor forms, which FSDP2 (fully_shard) calls
    "all_gather_single", "reduce_scatter_single",
)
# Where the originals are looked up and replaced: the public module and c10d itself (so that one
# collective implemented through another is seen once, thanks to the reentrancy guard).
_TARGET_MODULES = (dist, dist.distributed_c10d)
# The attribute that marks a MegaScan wrapper and holds the function it wraps (see mark_wrapper).
_ORIGINAL_ATTRIBUTE = "__megascan_original__"


def mark_wrapper(wrapper: Callable, original: Callable) -> Callable:
    """Marks `wrapper` as MegaScan's wrapper of `original` (a collective, a P2P function), so that
    `untraced` finds the original and a second install does not wrap the wrapper; returns it."""
    setattr(wrapper, _ORIGINAL_ATTRIBUTE, original)
    return wrapper


def untraced(function: Callable) -> Callable:
    """The function a MegaScan wrapper wraps, or `function` itself where it is none: what
    MegaScan's own exchanges call (they are not the program's: they stay out of the trace, its
    sequence numbers and the hang watchdog's view, every rank skipping them alike)."""
    return getattr(function, _ORIGINAL_ATTRIBUTE, function)


def is_wrapper(function: Any) -> bool:
    """Whether `function` is a MegaScan wrapper (marked by mark_wrapper)."""
    return untraced(function) is not function


@dataclass(slots=True)
class GroupInfo:
    """A process group as the trace names it: the name torch gives it (equal on all ranks, since
    every rank creates every group in the same order), its global ranks and megatron's description."""

    gid: int
    name: str
    ranks: tuple[int, ...]
    desc: str
    seq: int = 0
    # For the hang watchdog: (op, seq, monotonic seconds at entry) of a call that has not returned,
    # and (op, seq) of the last one that did (for async_op calls: was issued).
    in_flight: tuple[str, int, float] | None = None
    last_completed: tuple[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": list(self.ranks), "desc": self.desc}


def _tensor_size(value: Any) -> tuple[int, str | None]:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size(), str(value.dtype).replace("torch.", "")
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return sum(t.numel() * t.element_size() for t in value), str(value[0].dtype).replace("torch.", "")
    return 0, None


class CollectiveObserver:
    """Installs wrappers around the collectives; `sink(name, start, end, bytes, dtype, group, seq,
    flags)` is called for each outermost call while `recording` is true."""

    def __init__(self, now: Callable[[], Any], sink: Callable[..., None],
                 wait_sink: Callable[[Any, Any], None] | None = None) -> None:
        self.now = now
        self.sink = sink
        # Called as wait_sink(start, end) when code waits on the handle of an async collective
        # issued in a traced window: that wait is time the rank spent on its peers, not its work.
        self.wait_sink = wait_sink
        self.recording = False
        self.groups: dict[int, GroupInfo] = {}
        self._by_object: dict[int, tuple[Any, GroupInfo]] = {}
        # Per thread: a collective in progress on one thread (its inner calls not counted again)
        # says nothing of another thread's.
        self._local = threading.local()
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[int, Callable] = {}  # id(original) -> wrapper
        self._rebound: list[tuple[Any, str, Any]] = []
        # Called as listener(op, group_info, seq, start_ns, end_ns) with host perf_counter_ns times
        # after every outermost call, traced window or not (watchdog progress, live metrics).
        self.listeners: list[Callable[[str, GroupInfo, int, int, int], None]] = []

    # --- groups ---------------------------------------------------------------------
    def group_info(self, group: Any) -> GroupInfo:
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        known = self._by_object.get(id(group))
        if known is not None and known[0] is group:
            return known[1]
        ranks = tuple(dist.get_process_group_ranks(group))
        name = getattr(group, "group_name", "") or ",".join(map(str, ranks))
        desc = getattr(group, "group_desc", "") or ""
        info = GroupInfo(gid=len(self.groups), name=str(name), ranks=ranks, desc=str(desc))
        self.groups[info.gid] = info
        self._by_object[id(group)] = (group, info)  # holding the group keeps id() unique
        return info

    # --- wrapping ---------------------------------------------------------------------
    @property
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @_depth.setter
    def _depth(self, value: int) -> None:
        self._local.depth = value

    def _wrap(self, op: str, original: Callable) -> Callable:
        signature = inspect.signature(original)
        parameters = list(signature.parameters)
        group_index = parameters.index("group") if "group" in parameters else None
        async_index = parameters.index("async_op") if "async_op" in parameters else None
        observer = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if observer._depth:
                return original(*args, **kwargs)
            if "group" in kwargs:
                group = kwargs["group"]
            elif group_index is not None and len(args) > group_index:
                group = args[group_index]
            else:
                group = None
            try:
                info = observer.group_info(group)
            except Exception:  # a group this rank is not in: nothing to count or record
                return original(*args, **kwargs)
            info.seq += 1
            recording = observer.recording
            if not recording and not observer.listeners and not spine.wants_collectives():
                # Still one collective: torch 2.13 builds all_gather_into_tensor on all_gather_single,
                # whose wrapper must not count it a second time.
                observer._depth += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    observer._depth -= 1
            seq = info.seq - 1
            size, dtype, async_op = 0, None, False
            if recording:
                async_op = kwargs.get("async_op", args[async_index] if async_index is not None and len(args) > async_index else False)
                for value in (*args, *kwargs.values()):
                    candidate = _tensor_size(value)
                    if candidate[0] > size:
                        size, dtype = candidate
            observer._depth += 1
            info.in_flight = (op, seq, time.monotonic())
            host_start = time.perf_counter_ns()
            start = observer.now() if recording else host_start
            try:
                result = original(*args, **kwargs)
                if async_op and result is not None and observer.wait_sink is not None:
                    result = _TracedWork(result, observer)
                return result
            finally:
                end = observer.now() if recording else None
                host_end = time.perf_counter_ns()
                observer._depth -= 1
                info.in_flight = None
                info.last_completed = (op, seq)
                if recording:
                    observer.sink(op, start, end, size, dtype, info.gid, seq, FLAG_ASYNC if async_op else 0)
                for listener in observer.listeners:
                    listener(op, info, seq, host_start, host_end)
                spine.collective(op, info, seq, host_start, host_end)

        wrapper.__megascan_observer__ = observer  # type: ignore[attr-defined]
        return mark_wrapper(wrapper, original)

    def install(self, alias_module_prefixes: Iterable[str] = ("megatron",)) -> None:
        """Replace the collectives in torch.distributed, and every alias of them that already-imported
        modules hold (megatron-core binds e.g. `dist_all_gather_func = all_gather_into_tensor`)."""
        if self._originals:
            return
        for op in COLLECTIVE_FUNCTIONS:
            original = getattr(dist.distributed_c10d, op, None) or getattr(dist, op, None)
            if original is None:
                continue
            original = untraced(original)
            self._originals[op] = original
            self._wrappers[id(original)] = self._wrap(op, original)
        for module in _TARGET_MODULES:
            self._rebind_module(module)
        prefixes = tuple(alias_module_prefixes)
        for name, module in list(sys.modules.items()):
            if module is not None and name.startswith(prefixes) and not name.startswith("megatron.scan"):
                self._rebind_module(module)

    def _rebind_module(self, module: Any) -> None:
        try:
            items = list(vars(module).items())
        except TypeError:
            return
        for attribute, value in items:
            wrapper = self._wrappers.get(id(value)) if callable(value) else None
            if wrapper is not None:
                setattr(module, attribute, wrapper)
                self._rebound.append((module, attribute, value))

    def uninstall(self) -> None:
        for module, attribute, value in reversed(self._rebound):
            if getattr(module, attribute, None) is self._wrappers.get(id(value)):
                setattr(module, attribute, value)
        self._rebound.clear()
        self._originals.clear()
        self._wrappers.clear()

    @property
    def installed(self) -> bool:
        return bool(self._originals)


class _TracedWork:
    """The handle of an async collective issued in a traced window: `wait()` is timed (megatron-
    core's backward issues the TP all-reduce async and waits on it later, inside the backward
    span); everything else is the handle's own."""

    __slots__ = ("_work", "_observer")

    def __init__(self, work: Any, observer: CollectiveObserver) -> None:
        self._work = work
        self._observer = observer

    def wait(self, *args, **kwargs):
        observer = self._observer
        if not observer.recording:
            return self._work.wait(*args, **kwargs)
        start = observer.now()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            observer.wait_sink(start, observer.now())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def installed_observer() -> CollectiveObserver | None:
    """The observer whose wrappers torch.distributed currently holds, so that a second consumer
    (watchdog, metrics) listens to it instead of wrapping the wrappers."""
    return getattr(getattr(dist.distributed_c10d, "all_reduce", None), "__megascan_observer__", None)
