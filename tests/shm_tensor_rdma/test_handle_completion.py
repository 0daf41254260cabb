"""Handle and Endpoint meet only through the Completer interface (completion.py): a Handle driven
by a stand-in completer behaves as with a real endpoint, every way of finishing a transfer on a
real pair delivers the same bytes, and the endpoint offers everything the interface names."""
from __future__ import annotations

import inspect
import threading

import pytest
import torch

from megatron.shm_tensor_rdma import Endpoint, EndpointClosedError, TransferTimeout
from megatron.shm_tensor_rdma.completion import DONE, FAILED, Completer
from megatron.shm_tensor_rdma.handle import Handle, deliver_finished
from strdma_harness import make_pair


class RecordingCompleter:
    """A Completer that records what a Handle asks and settles it as told."""

    def __init__(self, wait_done=None, outcome=(DONE, None)) -> None:
        self.unsettled: dict[int, Handle] = {}
        self.wait_done = wait_done
        self.outcome = outcome
        self.calls: list[tuple] = []

    def refresh(self, handle: Handle) -> None:
        self.calls.append(("refresh", handle.id))

    def wait_for(self, handle: Handle, timeout, taken=None) -> None:
        self.calls.append(("wait_for", handle.id, timeout, taken))
        if self.unsettled.pop(handle.id, None) is not None:
            handle.settle(*self.outcome, False)


def _posted(completer: RecordingCompleter, kind: str = "recv", wire: torch.Tensor | None = None) -> Handle:
    tensor = torch.zeros(3)
    handle = Handle(completer, 7, kind, 1, 5, tensor, tensor if wire is None else wire)
    completer.unsettled[7] = handle
    return handle


def test_the_short_wait_settles_a_host_handle_without_asking_the_endpoint_again():
    completer = RecordingCompleter(wait_done=lambda request_id: None)
    handle = _posted(completer)
    assert handle.wait() is handle.tensor
    assert handle.settled and handle.test() and completer.unsettled == {} and completer.calls == []


def test_a_handle_taken_from_the_table_first_is_left_to_whoever_took_it():
    """close() may take the handle out of the table while the short wait returns: the waiter
    then waits for that settlement instead of recording success itself."""
    completer = RecordingCompleter(wait_done=lambda request_id: None)
    handle = _posted(completer)
    completer.unsettled.clear()
    handle.settle(FAILED, EndpointClosedError("rank 0: endpoint closed", 1), False)
    with pytest.raises(EndpointClosedError):
        handle.wait()
    assert completer.calls == []


def test_an_outcome_the_short_wait_took_goes_to_the_endpoint_to_record():
    failure = (7, FAILED, 2, "timed out")
    completer = RecordingCompleter(wait_done=lambda request_id: failure,
                                   outcome=(FAILED, TransferTimeout("rank 0: timed out", 1)))
    handle = _posted(completer)
    with pytest.raises(TransferTimeout):
        handle.wait()
    assert completer.calls == [("wait_for", 7, None, failure)]


def test_a_limited_wait_a_staged_tensor_and_an_unconnected_endpoint_take_the_long_way():
    for wait_done, timeout, wire in [(lambda i: None, 2.0, None), (lambda i: None, None, torch.zeros(3)),
                                     (None, None, None)]:
        completer = RecordingCompleter(wait_done=wait_done)
        handle = _posted(completer, wire=wire)
        handle.wait(timeout)
        assert completer.calls == [("wait_for", 7, timeout, None)]


def test_done_asks_the_endpoint_only_while_pending():
    completer = RecordingCompleter()
    handle = _posted(completer)
    assert not handle.done and completer.calls == [("refresh", 7)]
    handle.settle(DONE, None, False)
    assert handle.done and handle.exception() is None and completer.calls == [("refresh", 7)]


def test_settle_copies_a_staged_receive_out_and_returns_the_staging_buffer():
    staging = torch.arange(3.0)
    handle = _posted(RecordingCompleter(), wire=staging)
    assert handle.settle(DONE, None, True) is staging
    assert torch.equal(handle.tensor, staging) and handle.test()
    # A failed or device-copied receive is not copied; a send is never copied into its tensor.
    for kind, state, copy_out in [("recv", FAILED, False), ("recv", DONE, False), ("send", DONE, True)]:
        handle = _posted(RecordingCompleter(), kind=kind, wire=torch.arange(3.0))
        assert handle.settle(state, TransferTimeout("x", 1) if state == FAILED else None, copy_out) is not None
        assert torch.equal(handle.tensor, torch.zeros(3))
    # The core used the tensor itself: nothing to hand back.
    assert _posted(RecordingCompleter()).settle(DONE, None, True) is None
    assert repr(handle).endswith("done)")


def test_a_failed_handle_in_a_batch_raises_with_the_whole_batch():
    good, bad = _posted(RecordingCompleter()), _posted(RecordingCompleter())
    good.settle(DONE, None, False)
    bad.settle(FAILED, TransferTimeout("rank 0: timed out", 1), False)
    assert deliver_finished([good, bad], raise_errors=False) == [good, bad]
    with pytest.raises(TransferTimeout) as caught:
        deliver_finished([good, bad], raise_errors=True)
    assert caught.value.finished == [good, bad]


def test_the_endpoint_offers_every_member_of_the_completer_interface():
    members = set(Completer.__annotations__) | {name for name, value in vars(Completer).items()
                                               if inspect.isfunction(value) and not name.startswith("_")}
    assert members == {"unsettled", "wait_done", "refresh", "wait_for"}
    a, b = make_pair()
    try:
        for name in members:
            assert hasattr(a, name), name
        assert inspect.signature(Endpoint.wait_for).parameters.keys() == {"self", "handle", "timeout", "taken"}
    finally:
        a.close()
        b.close()


def test_every_way_of_finishing_delivers_the_same_bytes_and_reports_each_handle_once():
    """wait() (the short way and with a limit), done, poll() and wait_any() finish the same
    transfers; what poll/wait_any report is exactly what nobody else settled first."""
    a, b = make_pair()
    try:
        sent = [torch.arange(i, i + 4, dtype=torch.float64) for i in range(5)]
        ways = ["wait", "wait_limited", "done", "poll", "wait_any"]
        got = {}
        for tag, way in enumerate(ways):
            recvs = [b.irecv(((4,), torch.float64), 0, 50 + tag) for _ in sent]
            sends = [a.isend(t, 1, 50 + tag) for t in sent]
            if way in ("wait", "wait_limited"):
                for h in sends + recvs:
                    h.wait(None if way == "wait" else 10)
            elif way == "done":
                while not all(h.done for h in sends + recvs):
                    pass
            else:
                reported: list[Handle] = []
                while len(reported) < 2 * len(sent):
                    reported += (a.poll() + b.poll()) if way == "poll" else (a.wait_any(1) + b.wait_any(1))
                assert sorted(map(id, reported)) == sorted(map(id, sends + recvs))
            assert all(h.settled and h.test() for h in sends + recvs)
            got[way] = [h.tensor for h in recvs]
        assert a.poll() == [] and b.poll() == []
        for way in ways:
            assert all(torch.equal(x, y) for x, y in zip(got[way], sent)), way
        assert a.unsettled == {} and b.unsettled == {}
    finally:
        a.close()
        b.close()


def test_close_fails_a_handle_a_thread_is_waiting_on():
    a, b = make_pair()
    handle = b.irecv(((2,), torch.float32), 0, 99)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            handle.wait()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    b.close()
    thread.join(10)
    a.close()
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], EndpointClosedError), errors
    assert handle.settled and handle.done
