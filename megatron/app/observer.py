"""Instrumentation observer: the spine calls `span(kind, **attrs)` around every forward,
backward, send, receive, grad sync and optimizer step; MegaScan's collective wrappers report each
finished torch.distributed collective (`collective`), and its watchdog a hang starting or ending
(`hang`). A no-op until a plugin installs one; every installed observer (tracer, watchdog,
metrics) gets every event, so plugins subscribe here rather than to each other."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol


class Observer(Protocol):
    def span(self, kind: str, **attrs: Any) -> contextlib.AbstractContextManager: ...

    def instant(self, kind: str, **attrs: Any) -> None: ...

    # Optional: an observer without these methods does not receive those events.
    def collective(self, op: str, group: Any, seq: int, start_ns: int, end_ns: int) -> None: ...

    def hang(self, hung: bool) -> None: ...


class NullObserver:
    """Default observer: costs one attribute lookup and a shared null context."""

    _null = contextlib.nullcontext()

    def span(self, kind: str, **attrs: Any) -> contextlib.AbstractContextManager:
        return self._null

    def instant(self, kind: str, **attrs: Any) -> None:
        return None

    def collective(self, op: str, group: Any, seq: int, start_ns: int, end_ns: int) -> None:
        return None

    def hang(self, hung: bool) -> None:
        return None


class FanOutObserver:
    """Several observers at once (e.g. a tracer and a live metrics exporter)."""

    def __init__(self, observers: list) -> None:
        self.observers = observers

    @contextlib.contextmanager
    def span(self, kind: str, **attrs: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for observer in self.observers:
                stack.enter_context(observer.span(kind, **attrs))
            yield

    def instant(self, kind: str, **attrs: Any) -> None:
        for observer in self.observers:
            observer.instant(kind, **attrs)

    def collective(self, op: str, group: Any, seq: int, start_ns: int, end_ns: int) -> None:
        for observer in self.observers:
            method = getattr(observer, "collective", None)
            if method is not None:
                method(op, group, seq, start_ns, end_ns)

    def hang(self, hung: bool) -> None:
        for observer in self.observers:
            method = getattr(observer, "hang", None)
            if method is not None:
                method(hung)


_observer: Observer = NullObserver()
_wants_collectives = False


def get_observer() -> Observer:
    return _observer


def set_observer(observer: Observer | None) -> None:
    """Install an observer (None restores the no-op); several installs fan out."""
    global _observer
    if observer is None:
        _observer = NullObserver()
    elif isinstance(_observer, NullObserver):
        _observer = observer
    elif isinstance(_observer, FanOutObserver):
        _observer.observers.append(observer)
    else:
        _observer = FanOutObserver([_observer, observer])
    _update()


def remove_observer(observer: Observer) -> None:
    """Uninstall one observer (a plugin's shutdown); the others stay."""
    global _observer
    if _observer is observer:
        _observer = NullObserver()
    elif isinstance(_observer, FanOutObserver) and observer in _observer.observers:
        _observer.observers.remove(observer)
    _update()


def wants_collectives() -> bool:
    """Whether an installed observer takes collectives (the wrappers skip their bookkeeping if not);
    kept up to date by set_observer / remove_observer, so the hot path reads one global."""
    return _wants_collectives


def _update() -> None:
    global _wants_collectives
    members = _observer.observers if isinstance(_observer, FanOutObserver) else [_observer]
    _wants_collectives = any(not isinstance(o, NullObserver) and hasattr(o, "collective") for o in members)


def span(kind: str, **attrs: Any) -> contextlib.AbstractContextManager:
    return _observer.span(kind, **attrs)


def collective(op: str, group: Any, seq: int, start_ns: int, end_ns: int) -> None:
    """A finished collective, to every installed observer that takes collectives."""
    method = getattr(_observer, "collective", None)
    if method is not None:
        method(op, group, seq, start_ns, end_ns)


def hang(hung: bool) -> None:
    """A hang started (True) or ended, to every installed observer that takes it."""
    method = getattr(_observer, "hang", None)
    if method is not None:
        method(hung)
