"""Where a Handle meets the endpoint that posted it: the request states the core reports, and
`Completer`, the endpoint's side as a Handle sees it. Handle (handle.py) depends on this module,
not on endpoint.py; Endpoint (endpoint.py) implements Completer and settles handles through their
public `settle`. So the two form no import circle and touch none of each other's private names."""
from __future__ import annotations

from typing import Any, Callable, Protocol

# A request's state as the core reports it (ReqState in the C++ core).
PENDING, DONE, FAILED = 0, 1, 2

# What the core reports of a finished request: (request id, state, error kind, message).
Outcome = tuple[int, int, int, str]


class Completer(Protocol):
    """What a Handle asks of its endpoint. The handle table decides who settles a handle: whoever
    takes it out of `unsettled` (a Handle's own short wait, or the endpoint) records its outcome."""

    unsettled: dict[int, Any]
    """Posted handles whose outcome is not recorded yet, by request id."""

    wait_done: Callable[[int], Outcome | None] | None
    """The core's wait, without a limit, for a host transfer: None once it finished well (its
    outcome is taken), else its Outcome. None while the endpoint is not connected."""

    def refresh(self, handle: Any) -> None:
        """Settles `handle` if the core has finished its request (without waiting)."""

    def wait_for(self, handle: Any, timeout: float | None, taken: Outcome | None = None) -> None:
        """Settles `handle`: with `taken`, an outcome this thread already took from the core, when
        that is final, else by waiting at most `timeout` seconds (None: no limit) for the core;
        raises TransferTimeout naming the peer when the request is still unfinished then."""
