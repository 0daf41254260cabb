"""One rank of a multi-process shm_tensor_rdma test scenario (run by strdma_harness).

Every check records {"ok", "detail"} under its name in <out>/rank<r>.json, so a failing
check is reported by name with its traceback while the other checks still run.
"""
from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from pathlib import Path

import torch

from megatron.shm_tensor_rdma import (
    Endpoint,
    EndpointConfig,
    PeerError,
    TensorMismatchError,
    TransferTimeout,
)

# Every dtype whose bytes can be viewed as uint8 (quantized dtypes cannot hold raw bytes).
DTYPES = [d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.complex32,
    getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
) if d is not None]
SHAPES = [(), (0,), (3, 0, 2), (7,), (33, 65), (1 << 18,)]


def pattern(seed: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic arbitrary bits (NaNs, denormals included) of the given shape and dtype."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class Checks:
    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"rank{rank}.json"
        self.results: dict[str, dict] = {}

    def run(self, name: str, fn) -> None:
        try:
            detail = fn()
            self.results[name] = {"ok": True, "detail": detail}
        except Exception as e:  # noqa: BLE001 - every failure is reported by name
            self.results[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1))
        tmp.replace(self.path)


def barrier(ep: Endpoint, tag: int) -> None:
    """All ranks exchange a tiny message with every other rank."""
    peers = [r for r in range(ep.world_size) if r != ep.rank]
    sends = [ep.isend(torch.zeros(1), p, tag) for p in peers]
    recvs = [ep.irecv(((1,), torch.float32), p, tag) for p in peers]
    ep.wait_all(sends + recvs, timeout=30)


# ------------------------------------------------------------------------------------ basics

def scenario_basics(ep: Endpoint, args, checks: Checks) -> None:
    peer = 1 - ep.rank
    checks.run("transport", lambda: ep.transport(peer))

    def dtypes_roundtrip():
        # Both directions at once: every dtype and shape, eager and rendezvous sizes.
        sends, recvs = [], []
        for i, dtype in enumerate(DTYPES):
            for j, shape in enumerate(SHAPES):
                tag = 100 + i * len(SHAPES) + j
                sends.append(ep.isend(pattern(ep.rank * 10_000 + tag, shape, dtype), peer, tag))
                recvs.append((ep.irecv((shape, dtype), peer, tag), peer * 10_000 + tag, shape, dtype))
        ep.wait_all(sends, timeout=30)
        for handle, seed, shape, dtype in recvs:
            got = handle.wait(30)
            assert same_bits(got, pattern(seed, shape, dtype)), f"{dtype} {shape} differs"
        return f"{len(recvs)} tensors bit-exact"
    checks.run("dtypes_roundtrip", dtypes_roundtrip)
    barrier(ep, 1)

    def out_of_order():
        # Rank 0 sends large, then medium (rendezvous), then small (eager); rank 1 records the
        # order in which its receives complete.
        sizes = {"large": 32 << 20, "medium": 256 << 10, "small": 64}
        tags = {"large": 500, "medium": 501, "small": 502}
        if ep.rank == 0:
            handles = [ep.isend(torch.ones(n // 4), 1, tags[k]) for k, n in sizes.items()]
            ep.wait_all(handles, timeout=30)
            return "sent"
        handles = {ep.irecv(((n // 4,), torch.float32), 0, tags[k]): k for k, n in sizes.items()}
        order = []
        while len(order) < len(handles):
            order += [handles[h] for h in ep.wait_any(timeout=30)]
        # The eager small message must overtake; where the medium one lands depends on when
        # its clear-to-send reaches rank 0 relative to the large stream, so it is only reported.
        assert order.index("small") < order.index("large"), f"completion order {order}"
        return order
    checks.run("out_of_order", out_of_order)
    barrier(ep, 2)

    def mismatch():
        if ep.rank == 0:
            ep.isend(torch.zeros(4, 4), 1, 600).wait(10)  # eager: complete once sent
            big = ep.isend(torch.zeros(1 << 18), 1, 601)
            try:
                big.wait(10)
            except TensorMismatchError as e:
                assert e.peer_rank == 1 and "rank 1 refused" in str(e), str(e)
                return str(e)
            raise AssertionError("the rendezvous send did not fail")
        messages = []
        for tag, spec in ((600, ((4, 4), torch.bfloat16)), (601, ((1 << 17,), torch.float32))):
            try:
                ep.irecv(spec, 0, tag).wait(10)
            except TensorMismatchError as e:
                assert e.peer_rank == 0 and "rank 0" in str(e), str(e)
                messages.append(str(e))
            else:
                raise AssertionError(f"tag {tag}: mismatch not detected")
        assert "torch.bfloat16" in messages[0] and "torch.float32" in messages[0], messages[0]
        return messages
    checks.run("mismatch", mismatch)
    barrier(ep, 3)

    def timeouts():
        if ep.rank == 0:
            started = time.monotonic()
            try:
                ep.isend(torch.zeros(1 << 18), 1, 700, timeout=0.3).wait()
            except TransferTimeout as e:
                assert e.peer_rank == 1 and "rank 1" in str(e), str(e)
                elapsed = time.monotonic() - started
                assert elapsed < 3, elapsed
            else:
                raise AssertionError("send did not time out")
            barrier(ep, 701)
            ep.isend(torch.arange(8.0), 1, 702).wait(10)  # completes rank 1's earlier receive
            return "send timed out"
        waiting = ep.irecv(((8,), torch.float32), 0, 702)
        started = time.monotonic()
        try:
            waiting.wait(0.2)
        except TransferTimeout as e:
            assert e.peer_rank == 0 and "rank 0" in str(e), str(e)
        else:
            raise AssertionError("wait(0.2) did not time out")
        assert time.monotonic() - started < 2
        try:
            ep.irecv(((8,), torch.float32), 0, 703, timeout=0.3).wait()
        except TransferTimeout as e:
            assert "timed out after 0.3 s" in str(e), str(e)
        else:
            raise AssertionError("transfer timeout did not fire")
        barrier(ep, 701)
        # The receive that timed out in wait() kept going and completes now.
        assert torch.equal(waiting.wait(10), torch.arange(8.0))
        return "wait and transfer timeouts raised"
    checks.run("timeouts", timeouts)
    barrier(ep, 4)

    def poll_once():
        n = 20
        if ep.rank == 0:
            handles = [ep.isend(torch.full((1 + 5000 * i,), float(i)), 1, 800 + i) for i in range(n)]
            ep.wait_all(handles, timeout=30)
            return "sent"
        handles = {ep.irecv(((1 + 5000 * i,), torch.float32), 0, 800 + i): i for i in range(n)}
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while len(seen) < n and time.monotonic() < deadline:
            seen += [handles[h] for h in ep.poll()]
            time.sleep(0.001)
        assert sorted(seen) == list(range(n)), seen
        assert ep.poll() == [] and ep.wait_any(timeout=0.05) == []
        for h, i in handles.items():
            assert h.test() and bool((h.tensor == i).all())
        return f"{n} handles each reported once"
    checks.run("poll_once", poll_once)
    barrier(ep, 5)


# ------------------------------------------------------------------------------------ mesh

def mesh_plan(seed: int, world: int, count: int):
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]
    plan = []
    for index in range(count):
        src = rng.randrange(world)
        dst = rng.choice([r for r in range(world) if r != src])
        dtype = rng.choice(dtypes)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = 0 if rng.random() < 0.02 else int(2 ** rng.uniform(0, 20))
        # A small tag space makes many (src, dst, tag) repeats: those must match in order.
        plan.append((index, src, dst, rng.randrange(40), dtype, (nbytes // itemsize,)))
    return plan


def scenario_mesh(ep: Endpoint, args, checks: Checks) -> None:
    def random_transfers():
        plan = mesh_plan(1234, ep.world_size, args.count)
        pending = {}
        for index, src, dst, tag, dtype, shape in plan:
            if src == ep.rank:
                pending[ep.isend(pattern(index, shape, dtype), dst, tag)] = None
            elif dst == ep.rank:
                pending[ep.irecv((shape, dtype), src, tag)] = (index, shape, dtype)
        total, bad = len(pending), []
        while pending:
            finished = ep.wait_any(timeout=60)
            assert finished, f"nothing finished for 60 s; {len(pending)} left"
            for h in finished:
                expect = pending.pop(h)
                if expect is not None and not same_bits(h.tensor, pattern(*expect)):
                    bad.append(expect[0])
        assert not bad, f"transfers {bad[:10]} differ"
        return {"transfers": total, "transports": sorted({ep.transport(r) for r in range(ep.world_size)
                                                          if r != ep.rank})}
    checks.run("random_transfers", random_transfers)


# ------------------------------------------------------------------------------------ peer death

def scenario_dead_peer(ep: Endpoint, args, checks: Checks) -> None:
    out = Path(args.out)
    if ep.rank == 1:
        # Keep a large receive streaming, tell the harness we are mid-transfer, and wait to be
        # killed with SIGKILL.
        ep.irecv(((64 << 20,), torch.uint8), 0, 2)
        ep.irecv(((1,), torch.float32), 0, 3).wait(30)
        (out / "victim.ready").write_text("1")
        time.sleep(60)
        return

    def peer_death():
        incoming = ep.irecv(((1 << 18,), torch.float32), 1, 1)
        outgoing = ep.isend(torch.zeros(64 << 20, dtype=torch.uint8), 1, 2)
        ep.isend(torch.zeros(1), 1, 3).wait(10)
        started = time.monotonic()
        errors = []
        for handle in (incoming, outgoing):
            try:
                handle.wait(30)
            except PeerError as e:
                assert e.peer_rank == 1 and "rank 1" in str(e), str(e)
                errors.append(str(e))
        assert len(errors) == 2, errors
        elapsed = time.monotonic() - started
        late = ep.isend(torch.zeros(4), 1, 4)
        try:
            late.wait(5)
        except PeerError as e:
            errors.append(str(e))
        else:
            raise AssertionError("a send to the dead rank succeeded")
        return {"errors": errors, "detected_after_s": round(elapsed, 3)}
    checks.run("peer_death", peer_death)


# ------------------------------------------------------------------------------------ exchange

def scenario_exchange(ep: Endpoint, args, checks: Checks) -> None:
    """Both ranks send each other a few tensors of every size class (used across hosts)."""
    peer = 1 - ep.rank
    checks.run("transport", lambda: ep.transport(peer))

    def exchange():
        specs = [((), torch.bfloat16), ((0,), torch.float32), ((1000,), torch.int16),
                 ((257, 129), torch.bfloat16), ((2 << 20,), torch.float32)]
        sends = [ep.isend(pattern(ep.rank * 100 + i, s, d), peer, i) for i, (s, d) in enumerate(specs)]
        recvs = [ep.irecv((s, d), peer, i) for i, (s, d) in enumerate(specs)]
        ep.wait_all(sends, timeout=30)
        for i, ((s, d), h) in enumerate(zip(specs, recvs)):
            assert same_bits(h.wait(30), pattern(peer * 100 + i, s, d)), f"spec {i} differs"
        return f"{len(specs)} tensors each way"
    checks.run("exchange", exchange)
    barrier(ep, 99)


def scenario_copy_paths(ep: Endpoint, args, checks: Checks) -> None:
    """How large messages move (single copy, or two through the ring) and that every way is
    bit-exact; the ping-pong fast path wakes no receive thread."""
    peer = 1 - ep.rank
    checks.run("copy_path", lambda: ep.copy_path(peer))
    specs = [((64 << 10,), torch.uint8), ((300, 257), torch.bfloat16), ((3 << 20,), torch.float32),
             ((1 << 18,), torch.int64), ((5000,), torch.complex64), ((700, 700), torch.float16)]
    before = ep.stats()

    def backlog():
        # Rank 0 posts every send at once; rank 1 posts its receives only once all of them
        # arrived unmatched, so each receive but the last finds more messages waiting.
        if ep.rank == 0:
            sends = [ep.isend(pattern(500 + i, s, d), 1, 200 + i) for i, (s, d) in enumerate(specs)]
            ep.wait_all(sends, timeout=30)
            return f"{len(sends)} sent"
        time.sleep(0.5)
        recvs = [ep.irecv((s, d), 0, 200 + i) for i, (s, d) in enumerate(specs)]
        for i, ((s, d), h) in enumerate(zip(specs, recvs)):
            assert same_bits(h.wait(30), pattern(500 + i, s, d)), f"spec {i} differs"
        return f"{len(recvs)} received bit-exact"
    checks.run("backlog", backlog)

    def stream():
        # A windowed stream both ways at once, as a pipeline stage sees it.
        count, window = 40, 8
        sends, recvs, got = [], [], 0
        for i in range(count):
            s, d = specs[i % len(specs)]
            sends.append(ep.isend(pattern(ep.rank * 1000 + i, s, d), peer, 300 + i))
            recvs.append(ep.irecv((s, d), peer, 300 + i))
            if len(recvs) >= window:
                h = recvs.pop(0)
                j = got
                got += 1
                assert same_bits(h.wait(30), pattern(peer * 1000 + j, *specs[j % len(specs)])), f"message {j}"
        for h in recvs:
            assert same_bits(h.wait(30), pattern(peer * 1000 + got, *specs[got % len(specs)])), f"message {got}"
            got += 1
        ep.wait_all(sends, timeout=30)
        return f"{got} received bit-exact"
    checks.run("stream", stream)
    barrier(ep, 98)
    after = ep.stats()
    checks.run("paths", lambda: {k: after[k] - before[k] for k in after})

    def ping_pong():
        # Blocking send/recv of small messages: both sides poll, so no receive thread is woken.
        out, back = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
        start, rounds = ep.stats()["wakeups"], 2000
        for _ in range(rounds):
            if ep.rank == 0:
                ep.send(out, 1, 400)
                ep.recv(back, 1, 400)
            else:
                ep.recv(back, 0, 400)
                ep.send(out, 0, 400)
        return {"rounds": rounds, "wakeups": ep.stats()["wakeups"] - start}
    checks.run("ping_pong", ping_pong)
    barrier(ep, 97)


# ------------------------------------------------------------------------------------ CUDA IPC

def scenario_cuda_ipc(ep: Endpoint, args, checks: Checks) -> None:
    """Two processes on one GPU: CUDA tensors move by IPC handle (no host copy), bit-exact for
    every dtype and size, from views and non-contiguous tensors, into CUDA or host buffers;
    host tensors into CUDA buffers still arrive (staged); a failed copy fails both sides."""
    peer = 1 - ep.rank
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    checks.run("device_path", lambda: ep.device_path(peer))
    cases = [(f"{str(d).split('.')[-1]}-{'x'.join(map(str, s)) or 'scalar'}", s, d)
             for d in DTYPES for s in [(), (7,), (33, 65), (1 << 18,)]]
    before = ep.stats()

    def dtypes_and_sizes():
        for i, (name, shape, dtype) in enumerate(cases):
            want = pattern(700 + i, shape, dtype)
            if ep.rank == 0:
                ep.send(want.to(dev), 1, 1000 + i)
            else:
                got = ep.recv(torch.empty(shape, dtype=dtype, device=dev), 0, 1000 + i)
                assert got.is_cuda and same_bits(got.cpu(), want), name
        return f"{len(cases)} cases"
    checks.run("dtypes_and_sizes", dtypes_and_sizes)

    def views_and_host_buffers():
        big = pattern(1, (3 << 20,), torch.float32)  # 12 MiB: one allocation, parts of it sent
        if ep.rank == 0:
            whole = big.to(dev)
            handles = [ep.isend(whole[1000:2000], 1, 2000),  # a view at an offset into the allocation
                       ep.isend(whole.view(1024, 3072).t(), 1, 2001),  # not contiguous: sent from a copy
                       ep.isend(whole, 1, 2002),  # received into host memory
                       ep.isend(big[:4096], 1, 2003)]  # a host tensor into a CUDA buffer: staged
            ep.wait_all(handles, timeout=60)
            return "sent"
        a = ep.recv(torch.empty(1000, device=dev), 0, 2000)
        b = ep.recv(torch.empty(3072, 1024, device=dev), 0, 2001)
        c = ep.recv(torch.empty(3 << 20), 0, 2002)
        d = ep.recv(torch.empty(4096, device=dev), 0, 2003)
        # Bit comparisons: the pattern holds NaNs, and torch.equal compares a non-contiguous tensor
        # (the transposed view) element by element, where NaN != NaN.
        assert same_bits(a.cpu(), big[1000:2000]) and same_bits(b.cpu(), big.view(1024, 3072).t())
        assert same_bits(c, big) and same_bits(d.cpu(), big[:4096])
        return "view, transposed, into host, from host: exact"
    checks.run("views_and_host_buffers", views_and_host_buffers)

    def reused_and_reallocated():
        # One buffer sent 50 times with new contents (its handle opened once on the receiver),
        # then buffers freed and allocated again (new allocations, new handles).
        rounds = 50
        if ep.rank == 0:
            buf = torch.empty(1 << 20, device=dev)
            for i in range(rounds):
                buf.fill_(float(i))
                ep.send(buf, 1, 3000 + i)
            for i in range(10):
                fresh = torch.full((1 << 20,), float(-i), device=dev)
                ep.send(fresh, 1, 3100 + i)
                del fresh
                torch.cuda.empty_cache()
            return "sent"
        out = torch.empty(1 << 20, device=dev)
        for i in range(rounds):
            assert bool((ep.recv(out, 0, 3000 + i) == float(i)).all()), f"round {i}"
        for i in range(10):
            assert bool((ep.recv(out, 0, 3100 + i) == float(-i)).all()), f"reallocated {i}"
        return f"{rounds} reuses, 10 reallocations"
    checks.run("reused_and_reallocated", reused_and_reallocated)

    def many_in_flight():
        count = 32
        if ep.rank == 0:
            sends = [ep.isend(torch.full((1 << 16,), float(i), device=dev), 1, 4000 + i) for i in range(count)]
            ep.wait_all(sends, timeout=60)
            return "sent"
        recvs = [ep.irecv(((1 << 16,), torch.float32), 0, 4000 + i, device=dev) for i in reversed(range(count))]
        finished = []
        while len(finished) < count:
            finished += ep.wait_any(30)
        for h in recvs:
            assert bool((h.tensor == float(h.tag - 4000)).all()), h
        return f"{count} in flight, taken by wait_any"
    checks.run("many_in_flight", many_in_flight)

    def mismatch():
        if ep.rank == 0:
            try:
                ep.send(torch.ones(10, device=dev), 1, 5000)
            except TensorMismatchError as e:
                return str(e)
            if ep.device_path(1) == "CUDA IPC":  # by handle the send waits for the receiver's verdict
                raise AssertionError("the send did not fail")
            return "staged: 40 bytes go eagerly, so the send finished before the receiver refused it"
        try:
            ep.recv(torch.empty(11, device=dev), 0, 5000)
        except TensorMismatchError as e:
            return str(e)
        raise AssertionError("the receive did not fail")
    checks.run("mismatch", mismatch)
    barrier(ep, 96)
    after = ep.stats()
    checks.run("paths", lambda: {k: after[k] - before[k] for k in after})
    barrier(ep, 95)


def fake_gpu(refuse: bool) -> None:
    """Stands in for the CUDA side of the connect-time IPC agreement on a machine without a GPU:
    every rank offers a probe handle of a made-up GPU, and a refusing rank fails to open peers'."""
    import megatron.shm_tensor_rdma.endpoint as endpoint

    class FakeIpc(endpoint.CudaIpc):
        def probe(self) -> str:
            return "GPU-fake " + "00" * 64 + " 0"

        def try_open(self, descriptor: str) -> str | None:
            assert descriptor == self.probe(), descriptor
            return "cudaIpcOpenMemHandle failed: operation not supported (fake)" if refuse else None

    endpoint.device_key = lambda: "GPU-fake"
    endpoint.CudaIpc = FakeIpc


def scenario_ipc_agreement(ep: Endpoint, args, checks: Checks) -> None:
    """Which peers this rank sends CUDA tensors to by handle, as agreed while connecting; host
    tensors move as ever."""
    for peer in range(ep.world_size):
        if peer != ep.rank:
            checks.run(f"device_path_{peer}", lambda peer=peer: ep.device_path(peer))
    barrier(ep, 90)
    checks.run("stats", ep.stats)


SCENARIOS = {"basics": scenario_basics, "ipc_agreement": scenario_ipc_agreement, "cuda_ipc": scenario_cuda_ipc, "mesh": scenario_mesh, "dead_peer": scenario_dead_peer,
             "exchange": scenario_exchange, "copy_paths": scenario_copy_paths}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--store-port", type=int)
    parser.add_argument("--addresses")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--hosts", type=int, default=0, help="pretend the ranks are spread over this many hosts")
    parser.add_argument("--two-copies", action="store_true", help="single copy off (EndpointConfig.single_copy)")
    parser.add_argument("--no-cuda-ipc", action="store_true", help="EndpointConfig.cuda_ipc=False")
    parser.add_argument("--fake-gpu", action="store_true",
                        help="pretend a GPU, whose probe handle opens everywhere but on --fake-gpu-refuse ranks")
    parser.add_argument("--fake-gpu-refuse", type=int, nargs="*", default=[])
    args = parser.parse_args()
    config = EndpointConfig(transports=tuple(args.transports.split(",")), transfer_timeout=60, connect_timeout=30,
                            single_copy=not args.two_copies, cuda_ipc=not args.no_cuda_ipc)
    if args.hosts:
        # Consecutive ranks share a host key, so they use shared memory; the rest use TCP.
        config.host_key = f"{args.job_id}-host{args.rank * args.hosts // args.world_size}"
    if args.scenario == "cuda_ipc":
        torch.cuda.set_device(0)  # before the endpoint: it offers IPC only once CUDA is initialized
    if args.fake_gpu:
        fake_gpu(refuse=args.rank in args.fake_gpu_refuse)
    if args.addresses:
        ep = Endpoint(args.job_id, args.rank, args.world_size, args.addresses.split(","), config=config)
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False)
        ep = Endpoint.from_store(store, args.job_id, args.rank, args.world_size, host="127.0.0.1", config=config)
    checks = Checks(Path(args.out), args.rank)
    SCENARIOS[args.scenario](ep, args, checks)
    ep.close()
    checks.results["closed"] = {"ok": True, "detail": "closed"}
    checks.save()


if __name__ == "__main__":
    main()
