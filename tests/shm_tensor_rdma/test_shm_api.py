"""In-process tests of the Python API: argument errors, setup errors, close semantics, GIL
release, /dev/shm name hygiene, tags and dtype codes. Two endpoints in one process talk over
the same shared-memory path as two processes do, which keeps these tests fast."""
from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from launch import free_port
from megatron.shm_tensor_rdma import (
    Endpoint,
    EndpointClosedError,
    EndpointConfig,
    PeerError,
    TensorMismatchError,
    TransferTimeout,
    _C,
    make_tag,
    split_tag,
)
from megatron.shm_tensor_rdma.dtypes import dtype_code
from strdma_harness import make_pair, shm_names_of


@pytest.fixture
def pair():
    endpoints = make_pair()
    yield endpoints
    for ep in endpoints:
        ep.close()


@pytest.fixture
def single():
    ep = Endpoint(f"single-{uuid.uuid4().hex[:8]}", 0, 1, [f"127.0.0.1:{free_port()}"])
    yield ep
    ep.close()


def test_bad_peer_tag_tensor_and_timeout_arguments_raise_value_error(single):
    t = torch.zeros(4)
    cases = [
        (lambda: single.isend(t, 0, 1), "own rank"),
        (lambda: single.isend(t, 1, 1), "dst must be in [0, 1)"),
        (lambda: single.irecv(t, -1, 1), "src must be in [0, 1)"),
        (lambda: single.isend([1, 2], 0, 1), "expected a torch.Tensor"),
        (lambda: single.isend(t, 0, 2**64), "tag must fit in a signed 64-bit integer"),
        (lambda: single.isend(t, 0, "a"), "tag must be an int"),
        (lambda: single.isend(t, 0.0, 1), "dst must be an int"),
        (lambda: single.irecv(torch.zeros(4, 4).t(), 0, 1), "must be contiguous"),
        (lambda: single.irecv(((2,), "float"), 0, 1), "(shape, dtype) pair"),
        (lambda: single.irecv(((-2,), torch.float32), 0, 1), "cannot allocate"),
        (lambda: single.isend(t, 0, 1, timeout=-1), "timeout must be a positive number"),
        (lambda: single.isend(torch.zeros([1] * 33), 0, 1), "more than 32 dimensions"),
        (lambda: single.isend(torch.zeros(4).to_sparse(), 0, 1), "only dense"),
        (lambda: single.send(t, 0, 1), "own rank"),
        (lambda: single.send(t, 0, 2**64), "tag must fit in a signed 64-bit integer"),
        (lambda: single.recv(t, 1.5, 1), "src must be an int"),
        (lambda: single.recv(t, 0, 1, timeout=0), "timeout must be a positive number"),
    ]
    for call, expected in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert expected in str(info.value), (expected, str(info.value))


def test_constructor_arguments_are_checked_up_front():
    cases = [
        (lambda: Endpoint("j", 2, 2, ["a:1", "b:2"]), "rank must be in [0, world_size=2)"),
        (lambda: Endpoint("j", 0, 0, []), "world_size must be >= 1"),
        (lambda: Endpoint("j", 0, 2, ["127.0.0.1:1"]), "peer_addresses has 1 entries"),
        (lambda: Endpoint("j", 0, 1, ["localhost"]), "must look like 'host:port'"),
        (lambda: Endpoint("", 0, 1, ["127.0.0.1:5"]), "job_id must be a non-empty"),
        (lambda: Endpoint("j", 0, 1, ["127.0.0.1:5"], config=EndpointConfig(transports=("ib",))),
         "transports must be a non-empty subset"),
        (lambda: Endpoint("j", 0, 1, ["127.0.0.1:5"], config=EndpointConfig(shm_bulk_slots=3)), "powers of two"),
        (lambda: Endpoint("j", 0, 1, ["127.0.0.1:5"], config=EndpointConfig(workload_bytes=10)), "workload_bytes"),
    ]
    for call, expected in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert expected in str(info.value), (expected, str(info.value))


def test_setup_timeout_names_the_missing_rank():
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    config = EndpointConfig(connect_timeout=0.5)
    with pytest.raises(PeerError) as waiting:
        Endpoint("lonely", 0, 2, addresses, config=config)
    assert waiting.value.peer_rank == 1 and "timed out waiting for rank(s) 1" in str(waiting.value)
    with pytest.raises(PeerError) as dialing:
        Endpoint("lonely", 1, 2, addresses, config=config)
    assert dialing.value.peer_rank == 0 and "connecting to rank 0" in str(dialing.value)


def test_a_peer_of_another_job_is_refused():
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    config = EndpointConfig(connect_timeout=1.0)
    errors = {}

    def build(rank: int, job: str) -> None:
        try:
            Endpoint(job, rank, 2, addresses, config=config).close()
        except PeerError as e:
            errors[rank] = e

    threads = [threading.Thread(target=build, args=(0, "job-a")), threading.Thread(target=build, args=(1, "job-b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert "job 'job-b'" in str(errors[1]) and "job 'job-a'" in str(errors[1]), errors
    assert errors[0].peer_rank == 1


def test_wait_any_releases_the_gil_while_blocking(pair):
    a, b = pair
    pending = b.irecv(((1000,), torch.float32), 0, tag=7)
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(b.wait_any(timeout=10)))
    waiter.start()
    counted, until = 0, time.monotonic() + 0.3
    while time.monotonic() < until:  # runs only if the waiting thread let go of the GIL
        counted += 1
    a.isend(torch.arange(1000.0), 1, tag=7).wait(5)
    waiter.join(10)
    assert counted > 10_000 and got == [pending]
    assert torch.equal(pending.tensor, torch.arange(1000.0))


def test_close_fails_in_flight_handles_and_the_peer_sees_it(pair):
    a, b = pair
    never = a.irecv(((4,), torch.float32), 1, tag=1)
    waiting_on_a = b.irecv(((4,), torch.float32), 0, tag=2)
    a.close()
    with pytest.raises(EndpointClosedError):
        never.wait(5)
    with pytest.raises(EndpointClosedError):
        a.isend(torch.zeros(1), 1, 3)
    with pytest.raises(EndpointClosedError):
        a.transport(1)
    assert a.poll() == [] and a.in_flight == 0
    with pytest.raises(PeerError) as info:
        waiting_on_a.wait(5)
    assert info.value.peer_rank == 0 and "rank 0 closed its endpoint" in str(info.value)


def test_sends_completed_before_close_still_arrive(pair):
    a, b = pair
    # Large sends complete once every chunk is in the receiver's inbox; small ones once queued,
    # even before a receive is posted. Both must survive the sender closing right after.
    large = [b.irecv(((300_000,), torch.float32), 0, tag=i) for i in range(3)]
    for i in range(3):
        a.isend(torch.full((300_000,), float(i)), 1, tag=i).wait(10)
    a.isend(torch.tensor([42.0]), 1, tag=9).wait(10)
    a.close()
    for i, handle in enumerate(large):
        assert bool((handle.wait(10) == i).all())
    assert b.irecv(((1,), torch.float32), 0, tag=9).wait(10).item() == 42.0


def test_segment_names_are_job_scoped_unlinked_at_once_and_foreign_names_untouched():
    job_id = f"names-{uuid.uuid4().hex[:8]}"
    name = _C.shm_segment_name(job_id, 3)
    assert name.startswith("/strdma.") and ".r3." in name
    # Entries that look like ours but belong to another job, or to nobody we know.
    foreign = [_C.shm_segment_name("some-other-job", 0).lstrip("/"), "strdma-not-ours"]
    for entry in foreign:
        with open(f"/dev/shm/{entry}", "w") as f:
            f.write("x")
    try:
        a, b = make_pair(job_id)
        assert a.transport(1) == "shm"
        assert shm_names_of(job_id) == []  # unlinked while the endpoints are alive
        a.close()
        b.close()
        assert shm_names_of(job_id) == []
        assert all(os.path.exists(f"/dev/shm/{entry}") for entry in foreign)
    finally:
        for entry in foreign:
            os.unlink(f"/dev/shm/{entry}")


def test_the_same_store_and_job_id_can_build_endpoints_again():
    store = dist.HashStore()
    for _ in range(2):
        a, b = make_pair("again", store=store)
        a.isend(torch.ones(3), 1, 0)
        assert torch.equal(b.irecv(((3,), torch.float32), 0, 0).wait(5), torch.ones(3))
        a.close()
        b.close()


def test_tags_pack_kind_chunk_microbatch():
    tag = make_tag(1, 3, 1000)
    assert split_tag(tag) == (1, 3, 1000)
    assert len({make_tag(k, c, m) for k in range(2) for c in range(4) for m in range(8)}) == 64
    with pytest.raises(ValueError, match="chunk=70000"):
        make_tag(0, 70000, 0)


def test_dtype_codes_are_stable_and_distinct():
    assert dtype_code(torch.float32) == 1 and dtype_code(torch.bfloat16) == 4
    codes = [dtype_code(d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool)]
    assert len(set(codes)) == len(codes)


def test_endpoint_serves_as_the_pipeline_executors_transport(pair):
    from megatron.app.transport import Message, message_tag
    from megatron.shm_tensor_rdma.transport import ShmTensorTransport

    a, b = pair
    sender, receiver = ShmTensorTransport(a), ShmTensorTransport(b, close_endpoint=False)
    tags = [message_tag(kind, 1, mb, 4) for kind in ("F", "B") for mb in range(4)]
    sent = [torch.randn(8, 16) for _ in tags]
    got = [torch.empty(8, 16) for _ in tags]
    handles = receiver.post([], [Message(0, tag, out) for tag, out in zip(tags, got)])
    for h in sender.post([Message(1, tag, t) for tag, t in zip(tags, sent)], []):
        h.wait(10)
    for h in handles:
        h.wait(10)
        assert h.is_completed()
    assert all(torch.equal(x, y) for x, y in zip(sent, got))
    sender.close()
    assert a.in_flight == 0 and receiver.endpoint is b


def test_blocking_send_and_recv_move_tensors_and_raise_the_transfers_errors(pair):
    a, b = pair
    for shape, dtype in [((3,), torch.int64), ((513, 1031), torch.bfloat16)]:  # eager, then single copy
        sent = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).to(dtype)
        sender = threading.Thread(target=a.send, args=(sent, 1, 5))
        sender.start()
        got = b.recv(torch.empty(shape, dtype=dtype), 0, 5)
        sender.join(10)
        assert torch.equal(got, sent)
    with pytest.raises(TransferTimeout) as info:
        b.recv(((4,), torch.float32), 0, 7, timeout=0.2)
    assert "rank 0 had not sent a matching message" in str(info.value) and info.value.peer_rank == 0
    errors: list = []
    sender = threading.Thread(target=lambda: errors.extend(_raised(a.send, torch.zeros(100_000), 1, 8)))
    sender.start()
    with pytest.raises(TensorMismatchError) as info:
        b.recv(((100_000,), torch.float64), 0, 8)
    sender.join(10)
    assert "float64" in str(info.value) and "float32" in str(info.value)
    assert len(errors) == 1 and "rank 1 refused the message" in str(errors[0])


def _raised(fn, *args) -> list:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return [e]
    return []


def test_copy_path_and_stats_say_how_large_messages_moved():
    for single_copy, expected in [(True, "single copy (cross-memory attach)"),
                                  (False, "two copies through the ring (single copy disabled by configuration)")]:
        a, b = make_pair(config=EndpointConfig(single_copy=single_copy))
        try:
            assert a.copy_path(1) == b.copy_path(0) == expected
            recv = b.irecv(((1 << 20,), torch.float32), 0, 1)
            a.isend(torch.full((1 << 20,), 3.0), 1, 1).wait(10)
            a.isend(torch.ones(4), 1, 2).wait(10)
            assert bool((recv.wait(10) == 3.0).all()) and b.recv(((4,), torch.float32), 0, 2).sum().item() == 4
            sent, received = a.stats(), b.stats()
            large = "read" if single_copy else "copied"
            assert sent[large] == received[large] == 1 and sent["eager"] == received["eager"] == 1, (sent, received)
            assert set(sent) == {"eager", "copied", "read", "written", "device", "wakeups"}
        finally:
            a.close()
            b.close()


def _plain_cases() -> list[tuple[str, torch.Tensor]]:
    big = torch.arange(40, dtype=torch.float64)
    cases = [
        ("scalar", torch.tensor(7.5)),
        ("empty", torch.empty(0, dtype=torch.int32)),
        ("bool", torch.tensor([True, False, True])),
        ("int8 8-d", torch.arange(256, dtype=torch.int8).reshape(2, 2, 2, 2, 2, 2, 2, 2)),
        ("bfloat16", torch.linspace(-3, 3, 1000).to(torch.bfloat16)),
        ("complex64", torch.randn(17, dtype=torch.complex64)),
        ("view with an offset", big[3:29]),  # contiguous, data_ptr past the storage start
        ("single copy", torch.randn(300, 700)),  # rendezvous: read out of the sender's memory
    ]
    if hasattr(torch, "float8_e4m3fn"):
        cases.append(("float8", torch.randn(64).to(torch.float8_e4m3fn)))
    return cases


def test_plain_host_tensors_take_the_fast_path_and_arrive_bit_exact(pair, monkeypatch):
    """send/recv and isend/irecv read a plain, contiguous host tensor in the core (one call);
    the Python checks run only for anything else. Both must deliver the same bytes."""
    a, b = pair
    checked: list[str] = []
    original_post, original_blocking = type(a)._post, type(a)._blocking
    monkeypatch.setattr(type(a), "_post", lambda self, *args: checked.append("post") or original_post(self, *args))
    monkeypatch.setattr(type(a), "_blocking",
                        lambda self, *args: checked.append("blocking") or original_blocking(self, *args))

    def as_bytes(t: torch.Tensor) -> bytes:
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

    for tag, (name, sent) in enumerate(_plain_cases()):
        sender = threading.Thread(target=a.send, args=(sent, 1, 100 + tag))
        sender.start()
        got = b.recv(torch.empty_like(sent), 0, 100 + tag)
        sender.join(10)
        handle = b.irecv((tuple(sent.shape), sent.dtype), 0, 200 + tag)
        a.isend(sent, 1, 200 + tag).wait(10)
        for received in (got, handle.wait(10)):
            assert received.shape == sent.shape and received.dtype == sent.dtype, name
            assert as_bytes(received) == as_bytes(sent), name
    assert checked == [], f"plain host tensors went through the checked path: {checked}"

    # Anything else takes the checked path and still arrives: a subclass, a transposed view.
    param = torch.nn.Parameter(torch.randn(5, 3))
    sender = threading.Thread(target=a.send, args=(param, 1, 300))
    sender.start()
    assert torch.equal(b.recv(torch.empty(5, 3), 0, 300), param.detach())
    sender.join(10)
    transposed = torch.randn(6, 4).t()
    handle = b.irecv(((4, 6), torch.float32), 0, 301)
    a.isend(transposed, 1, 301).wait(10)
    assert torch.equal(handle.wait(10), transposed)
    assert checked == ["post", "post"], checked  # send of a subclass goes through isend(...).wait()

    # Past close the fast path is gone and the checked path names the closed endpoint.
    a.close()
    with pytest.raises(EndpointClosedError):
        a.send(torch.ones(2), 1, 400)
    with pytest.raises(EndpointClosedError):
        a.isend(torch.ones(2), 1, 400)


def test_a_backlog_of_mid_size_messages_is_copied_by_both_sides(pair):
    """With more messages waiting, the receiver reads every other one and hands the rest to
    the sender, which writes them: both processes copy at once."""
    a, b = pair
    sent = [torch.full((16384,), float(i)) for i in range(32)]  # 64 KiB each
    sends = [a.isend(t, 1, 9) for t in sent]  # all requests to send are queued before any irecv
    recvs = [b.irecv(((16384,), torch.float32), 0, 9) for _ in sent]
    waiter = threading.Thread(target=lambda: [h.wait(20) for h in sends])
    waiter.start()
    got = [h.wait(20) for h in recvs]
    waiter.join(20)
    assert all(torch.equal(g, t) for g, t in zip(got, sent))
    stats = b.stats()
    assert stats["read"] + stats["written"] == 32, stats
    assert stats["read"] >= 8 and stats["written"] >= 8, stats


def test_a_poll_in_another_thread_never_loses_a_handle_posted_meanwhile(pair):
    """isend/irecv register their handle just after posting, without a lock; a poll() racing
    with that (here: a thread polling both endpoints nonstop while eager sends finish as they
    are posted) hands the outcome over instead of dropping it. Every handle finishes, and poll
    reports none twice."""
    a, b = pair
    stop, polled = threading.Event(), []

    def poller():
        while not stop.is_set():
            polled.extend(a.poll())
            polled.extend(b.poll())

    thread = threading.Thread(target=poller)
    thread.start()
    try:
        handles = []
        for i in range(3000):
            handles.append(b.irecv(((2,), torch.int64), 0, 7))
            handles.append(a.isend(torch.tensor([i, -i]), 1, 7))
        for h in handles:
            h.wait(10)
    finally:
        stop.set()
        thread.join(10)
    assert [h.tensor.tolist() for h in handles[0::2]] == [[i, -i] for i in range(3000)]
    assert len(polled) == len(set(map(id, polled))), "a handle was reported twice"
    assert polled, "the poller never saw a handle finish: the race was not exercised"
