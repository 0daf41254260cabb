"""Observes torch.distributed point-to-point transfers of a program MegaScan did not write (the
zero-code launcher): `send`, `recv`, `isend`, `irecv` and `batch_isend_irecv` of `P2POp`s, each
with its peer's global rank and its bytes.

A send is recorded from its call to its return (for `isend`: the posting); a receive from the
moment the program waits for it to the end of that wait (for `recv`: the whole call), the same
meaning as the trainer's own `send` / `recv` spans. A program that never waits on an `irecv`
handle records no receive for it. Transfers are linked to receives by order per (sender,
receiver, iteration), which is how gloo and NCCL deliver them.

`P2POp` keeps the function it was given and torch checks it by identity (`op is isend`), so the
wrappers live only in `torch.distributed` (and early aliases of it), not in c10d itself, and
`P2POp` unwraps them on construction.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron.scan.collectives import mark_wrapper, untraced

P2P_FUNCTIONS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_PEER_PARAMETER = {"send": ("dst", "group_dst"), "isend": ("dst", "group_dst"),
                   "recv": ("src", "group_src"), "irecv": ("src", "group_src")}


class P2PObserver:
    """Installs the wrappers; `sink(kind, start_ns, end_ns, peer, bytes, dtype)` is called for
    each transfer while `recording()` is true, with times from `now()`."""

    def __init__(self, now: Callable[[], int], sink: Callable[..., None], recording: Callable[[], bool]) -> None:
        self.now = now
        self.sink = sink
        self.recording = recording
        self._originals: dict[str, Callable] = {}
        self._rebound: list[tuple[Any, str, Any]] = []
        self._p2pop: tuple[Any, Any] | None = None

    # --- wrappers --------------------------------------------------------------------------
    def _wrap_single(self, name: str, original: Callable) -> Callable:
        observer, sending = self, name in ("send", "isend")
        blocking = name in ("send", "recv")
        peer_name, group_peer_name = _PEER_PARAMETER[name]

        @functools.wraps(original)
        def wrapper(tensor, *args, **kwargs):
            if not observer.recording():
                return original(tensor, *args, **kwargs)
            peer = _global_peer(args, kwargs, peer_name, group_peer_name)
            if sending or blocking:
                start = observer.now()
                result = original(tensor, *args, **kwargs)
                observer.sink("send" if sending else "recv", start, observer.now(), peer, *_size(tensor))
                return result
            work = original(tensor, *args, **kwargs)
            return _ReceiveHandle(work, observer, [(peer, tensor)]) if work is not None else work

        return mark_wrapper(wrapper, original)

    def _wrap_batch(self, original: Callable) -> Callable:
        observer = self

        @functools.wraps(original)
        def wrapper(p2p_op_list):
            if not observer.recording():
                return original(p2p_op_list)
            start = observer.now()
            works = original(p2p_op_list)
            end = observer.now()
            receives = []
            for op in p2p_op_list:
                if op.op is self._originals["isend"]:
                    observer.sink("send", start, end, op.peer, *_size(op.tensor))
                else:
                    receives.append((op.peer, op.tensor))
            if not receives or not works:
                return works
            works = list(works)
            if len(works) == len(p2p_op_list):  # one handle per op (gloo): each receive has its own
                handles = iter(receives)
                for index, op in enumerate(p2p_op_list):
                    if op.op is not self._originals["isend"]:
                        works[index] = _ReceiveHandle(works[index], observer, [next(handles)])
            else:  # coalesced (NCCL): the batch's last handle completes every receive in it
                works[-1] = _ReceiveHandle(works[-1], observer, receives)
            return works

        return mark_wrapper(wrapper, original)

    # --- install ---------------------------------------------------------------------------
    def install(self, alias_module_prefixes: Iterable[str] = ()) -> None:
        if self._originals:
            return
        wrappers: dict[int, Callable] = {}
        for name in P2P_FUNCTIONS:
            original = untraced(getattr(c10d, name))
            self._originals[name] = original
            wrapper = self._wrap_batch(original) if name == "batch_isend_irecv" else self._wrap_single(name, original)
            wrappers[id(original)] = wrapper
        modules = [dist] + [m for n, m in list(sys.modules.items())
                            if m is not None and n.startswith(tuple(alias_module_prefixes))
                            and not n.startswith(("megatron.scan", "torch.distributed.distributed_c10d"))]
        for module in modules:
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for attribute, value in items:
                wrapper = wrappers.get(id(value)) if callable(value) else None
                if wrapper is not None:
                    setattr(module, attribute, wrapper)
                    self._rebound.append((module, attribute, value))
        self._patch_p2pop()

    def _patch_p2pop(self) -> None:
        """`P2POp(dist.isend, ...)` receives our wrapper; torch checks and dispatches on the original."""
        cls = c10d.P2POp
        original_new, original_init = cls.__new__, cls.__init__

        def __new__(klass, op, *args, **kwargs):
            return original_new(klass, untraced(op), *args, **kwargs)

        def __init__(instance, op, *args, **kwargs):
            original_init(instance, untraced(op), *args, **kwargs)

        cls.__new__, cls.__init__ = __new__, __init__
        self._p2pop = (original_new, original_init)

    def uninstall(self) -> None:
        for module, attribute, value in reversed(self._rebound):
            setattr(module, attribute, value)
        self._rebound.clear()
        if self._p2pop is not None:
            c10d.P2POp.__new__, c10d.P2POp.__init__ = self._p2pop
            self._p2pop = None
        self._originals.clear()


class _ReceiveHandle:
    """The handle of a posted receive: `wait()` records the receive(s) it completes."""

    __slots__ = ("_work", "_observer", "_receives", "_recorded")

    def __init__(self, work: Any, observer: P2PObserver, receives: list[tuple[int, Any]]) -> None:
        self._work = work
        self._observer = observer
        self._receives = receives
        self._recorded = False

    def wait(self, *args, **kwargs):
        observer = self._observer
        start = observer.now()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            if not self._recorded and observer.recording():
                self._recorded = True
                end = observer.now()
                for peer, tensor in self._receives:
                    observer.sink("recv", start, end, peer, *_size(tensor))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _global_peer(args: tuple, kwargs: dict, peer_name: str, group_peer_name: str) -> int:
    """The peer's global rank from (tensor, peer, group, tag, group_peer) arguments."""
    peer = kwargs.get(peer_name, args[0] if len(args) > 0 else None)
    if peer is not None:
        return int(peer)
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    group_peer = kwargs.get(group_peer_name, args[3] if len(args) > 3 else None)
    if group_peer is None:
        return -1
    return int(dist.get_global_rank(group or c10d._get_default_group(), group_peer))


def _size(tensor: Any) -> tuple[int, str | None]:
    try:
        return tensor.numel() * tensor.element_size(), str(tensor.dtype).replace("torch.", "")
    except AttributeError:
        return -1, None
