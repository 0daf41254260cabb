"""CUDA tensors by IPC handle.

On any machine: the protocol (DeviceRts, the receiver's copy, DeviceDone or its refusal) through
two real endpoints, with the GPU side stood in for by `HostIpc`, whose descriptor carries the
bytes themselves. On a machine with a GPU: two processes on it move CUDA tensors by real IPC
handles (strdma_worker.py's cuda_ipc scenario).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from strdma_harness import make_pair, run_ranks
from megatron.shm_tensor_rdma import DEFAULT, TensorMismatchError, TransferTimeout, TransportError

GPU = torch.cuda.is_available()


class HostIpc:
    """Stands in for cuda_ipc.CudaIpc: `export` puts the tensor's bytes in the descriptor and
    `copy_in` writes them into the receive buffer, so every step but the GPU copy is real."""

    def __init__(self) -> None:
        self.copies = 0
        self.fail: str | None = None

    def uuid_of(self, tensor: torch.Tensor) -> str:
        return "GPU-host-stand-in"

    def export(self, tensor: torch.Tensor) -> str:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"GPU-host-stand-in {raw.hex() or '-'} 0"

    def copy_in(self, descriptor: str, out: torch.Tensor) -> None:
        if self.fail:
            raise RuntimeError(self.fail)
        raw = descriptor.split(" ")[1]
        if raw != "-":
            out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray.fromhex(raw), dtype=torch.uint8))
        self.copies += 1

    def close(self) -> None:
        pass


@pytest.fixture
def ipc_pair():
    a, b = make_pair()
    for ep in (a, b):
        ep._ipc = HostIpc()
    a._ipc_peers[1] = frozenset({"GPU-host-stand-in"})
    yield a, b
    a.close()
    b.close()


def test_a_device_send_finishes_only_once_the_receiver_copied_it(ipc_pair):
    a, b = ipc_pair
    sent = torch.arange(300, dtype=torch.float32)
    handle = a._post_device(sent, 1, 5, DEFAULT)
    time.sleep(0.3)
    assert not handle.done, "the send finished before any receive was posted"
    assert torch.equal(b.recv(torch.empty(300), 0, 5), sent)
    handle.wait(10)
    assert b._ipc.copies == 1
    assert a.stats()["device"] == b.stats()["device"] == 1


def test_every_way_of_receiving_copies_a_device_message_bit_exact(ipc_pair):
    a, b = ipc_pair
    cases = [torch.randn(7, 5), torch.randint(-9, 9, (64,), dtype=torch.int8), torch.ones(3, dtype=torch.bool),
             torch.randn(40).to(torch.bfloat16), torch.tensor(2.5, dtype=torch.float64)]
    receivers = {
        "recv": lambda t, tag: b.recv(torch.empty_like(t), 0, tag),
        "irecv(shape, dtype).wait": lambda t, tag: b.irecv((tuple(t.shape), t.dtype), 0, tag).wait(10),
        "irecv into a Parameter": lambda t, tag: b.irecv(torch.nn.Parameter(torch.empty_like(t),
                                                                            requires_grad=False), 0, tag).wait(10),
        "wait_any": lambda t, tag: _by_wait_any(b, b.irecv(torch.empty_like(t), 0, tag)),
        "recv without the fast path": lambda t, tag: _without_fast_path(b, t, tag),
    }
    tag = 100
    for name, receive in receivers.items():
        for sent in cases:
            tag += 1
            send = a._post_device(sent, 1, tag, DEFAULT)
            got = receive(sent, tag)
            send.wait(10)
            assert got.dtype == sent.dtype and got.shape == sent.shape, name
            assert got.reshape(-1).view(torch.uint8).tolist() == sent.reshape(-1).view(torch.uint8).tolist(), name
    count = len(receivers) * len(cases)
    assert b._ipc.copies == count and a.stats()["device"] == b.stats()["device"] == count


def _by_wait_any(ep, handle):
    deadline = time.monotonic() + 10
    while handle not in ep.wait_any(1) and time.monotonic() < deadline:
        pass
    return handle.wait(0.1)


def _without_fast_path(ep, tensor, tag):
    fast, ep._plain_transfer = ep._plain_transfer, None
    try:
        return ep.recv(torch.empty_like(tensor), 0, tag)
    finally:
        ep._plain_transfer = fast


def test_device_and_host_messages_on_one_tag_arrive_in_posting_order(ipc_pair):
    a, b = ipc_pair
    sent = [torch.full((50,), float(i)) for i in range(6)]
    handles = [a._post_device(t, 1, 7, DEFAULT) if i % 2 else a.isend(t, 1, 7) for i, t in enumerate(sent)]
    for i, t in enumerate(sent):
        assert torch.equal(b.recv(torch.empty(50), 0, 7), t), f"message {i} out of order"
    a.wait_all(handles, timeout=10)
    assert b._ipc.copies == 3


def test_a_shape_mismatch_fails_both_sides_and_names_both_shapes(ipc_pair):
    a, b = ipc_pair
    send = a._post_device(torch.ones(10), 1, 8, DEFAULT)
    with pytest.raises(TensorMismatchError, match=r"expects torch.float32 \[11\].*has torch.float32 \[10\]"):
        b.recv(torch.empty(11), 0, 8)
    with pytest.raises(TensorMismatchError):
        send.wait(10)
    assert b._ipc.copies == 0


def test_a_failed_copy_fails_both_sides_with_the_reason(ipc_pair):
    a, b = ipc_pair
    b._ipc.fail = "cudaIpcOpenMemHandle failed: invalid device context"
    send = a._post_device(torch.ones(16), 1, 9, DEFAULT)
    with pytest.raises(TransportError, match="CUDA IPC copy from rank 0 failed: cudaIpcOpenMemHandle failed.*"
                                             "cuda_ipc=False"):
        b.recv(torch.empty(16), 0, 9)
    with pytest.raises(TransportError, match="rank 1 could not copy the message: CUDA IPC copy"):
        send.wait(10)
    # The endpoints go on working.
    b._ipc.fail = None
    threading.Thread(target=lambda: a._post_device(torch.full((4,), 3.0), 1, 10, DEFAULT).wait(10)).start()
    assert torch.equal(b.recv(torch.empty(4), 0, 10), torch.full((4,), 3.0))


def test_an_unreceived_device_send_times_out_naming_the_peer(ipc_pair):
    a, _ = ipc_pair
    send = a._post_device(torch.ones(4), 1, 11, 0.3)
    with pytest.raises(TransferTimeout, match="rank 1 had not posted a matching irecv"):
        send.wait(5)


def test_device_path_says_why_cuda_tensors_are_staged():
    if GPU:
        torch.cuda.set_device(0)  # an endpoint offers IPC only in a process that initialized CUDA
    a, b = make_pair()
    try:
        if GPU:
            assert a.device_path(1) == "host staging (rank 1 is an endpoint of this process)"
        else:
            assert a.device_path(1) == "host staging (no GPU visible here)"
    finally:
        a.close()
        b.close()


def test_peers_agree_while_connecting_which_of_them_open_each_others_handles(tmp_path):
    """Three ranks with a stand-in GPU; rank 2 cannot open IPC handles. Ranks 0 and 1 send each
    other CUDA tensors by handle, and both stage what they send to rank 2, saying why; rank 2
    still sends by handle to them. The agreement is one message each way per pair."""
    run = run_ranks("ipc_agreement", 3, tmp_path, timeout=60, extra=["--fake-gpu", "--fake-gpu-refuse", "2"])
    refused = ("host staging (rank 2 cannot open this process's CUDA IPC handles: "
               "cudaIpcOpenMemHandle failed: operation not supported (fake))")
    assert run.check(0, "device_path_1")["detail"] == run.check(1, "device_path_0")["detail"] == "CUDA IPC"
    assert run.check(0, "device_path_2")["detail"] == run.check(1, "device_path_2")["detail"] == refused
    assert run.check(2, "device_path_0")["detail"] == run.check(2, "device_path_1")["detail"] == "CUDA IPC"
    for rank in range(3):
        run.check(rank, "closed")


def test_without_gpus_no_agreement_is_made(tmp_path):
    run = run_ranks("ipc_agreement", 2, tmp_path, timeout=60)
    expected = "host staging (no GPU visible here)" if not GPU else None
    for rank in (0, 1):
        path = run.check(rank, f"device_path_{1 - rank}")["detail"]
        assert path.startswith("host staging ("), path
        if expected:
            assert path == expected
        # Only the barrier's messages: no probe answers were exchanged.
        assert run.check(rank, "stats")["detail"]["eager"] == 2


def test_an_ipc_handle_survives_the_descriptor_with_its_zero_bytes():
    from megatron.shm_tensor_rdma.cuda_ipc import _IpcHandle, handle_from_hex, handle_hex

    raw = bytes([7, 0, 0, 3] + [0] * 30 + [255] * 29 + [1])
    handle = _IpcHandle.from_buffer_copy(raw)
    text = handle_hex(handle)
    assert len(text) == 128 and bytes(handle_from_hex(text).reserved) == raw
    with pytest.raises(ValueError, match="64 bytes"):
        handle_from_hex(text[:-2])


# ------------------------------------------------------------------------------ on a GPU

@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (two processes share it by IPC handle)")
def test_cuda_tensors_move_between_two_processes_by_ipc_handle(tmp_path):
    run = run_ranks("cuda_ipc", 2, tmp_path, timeout=240)
    for rank in (0, 1):
        assert run.check(rank, "device_path")["detail"] == "CUDA IPC"
        for name in ("dtypes_and_sizes", "views_and_host_buffers", "reused_and_reallocated", "many_in_flight",
                     "mismatch", "closed"):
            run.check(rank, name)
    sent, received = run.check(0, "paths")["detail"], run.check(1, "paths")["detail"]
    # Every CUDA send went by handle but the host tensor (staged) and the refused one.
    assert sent["device"] == received["device"] >= 150, (sent, received)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_with_cuda_ipc_off_cuda_tensors_are_staged_through_host_memory(tmp_path):
    run = run_ranks("cuda_ipc", 2, tmp_path, timeout=240, extra=["--no-cuda-ipc"])
    for rank in (0, 1):
        assert run.check(rank, "device_path")["detail"] == "host staging (cuda_ipc=False here)"
        for name in ("dtypes_and_sizes", "views_and_host_buffers", "reused_and_reallocated", "many_in_flight",
                     "mismatch", "closed"):
            run.check(rank, name)
    assert run.check(0, "paths")["detail"]["device"] == 0
