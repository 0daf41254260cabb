"""Instrumentation observer: the spine calls `span(kind, **attrs)` around every forward,
backward, send, receive, grad sync and optimizer step. A no-op until a plugin installs one."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol


class Observer(Protocol):
    def span(self, kind: str, **attrs: Any) -> contextlib.AbstractContextManager: ...

    def instant(self, kind: str, **attrs: Any) -> None: ...


class NullObserver:
    """Default observer: costs one attribute lookup and a shared null context."""

    _null = contextlib.nullcontext()

    def span(self, kind: str, **attrs: Any) -> contextlib.AbstractContextManager:
        return self._null

    def instant(self, kind: str, **attrs: Any) -> None:
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


_observer: Observer = NullObserver()


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


def span(kind: str, **attrs: Any) -> contextlib.AbstractContextManager:
    return _observer.span(kind, **attrs)
