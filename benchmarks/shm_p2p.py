"""shm_tensor_rdma point-to-point benchmark: bandwidth and latency between two local ranks.

Prints, all measured in one run: bandwidth of a windowed one-way stream for 4 KiB .. 64 MiB
against a single-thread memcpy of the same size (ratio) and against gloo send/recv over
loopback (ratio), then ping-pong latency of small messages against gloo.

    python benchmarks/shm_p2p.py                 # shared memory (the default transport)
    python benchmarks/shm_p2p.py --transport tcp # our TCP transport instead
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
LATENCY_SIZES = [8, 256, 4 * KIB]


def iterations(size: int, budget_bytes: int) -> int:
    return max(8, min(4000, budget_bytes // size))


def window(size: int) -> int:
    return 16 if size <= 256 * KIB else 4


class Pair:
    """The two ways of moving a tensor that are compared: our endpoint and gloo."""

    def __init__(self, endpoint, dist) -> None:
        self.ep, self.dist = endpoint, dist

    def send(self, kind: str, tensor, peer: int, tag: int):
        return self.ep.isend(tensor, peer, tag) if kind == "ours" else self.dist.isend(tensor, peer, tag=tag)

    def recv(self, kind: str, tensor, peer: int, tag: int):
        return self.ep.irecv(tensor, peer, tag) if kind == "ours" else self.dist.irecv(tensor, peer, tag=tag)


def stream(pair: Pair, kind: str, rank: int, size: int, iters: int, tag: int) -> float:
    """Rank 0 streams `iters` messages with a window in flight; returns seconds on rank 0,
    from the first send until rank 1 acknowledged the last receive."""
    import torch

    w = window(size)
    buffers = [torch.ones(size, dtype=torch.uint8) for _ in range(w)]
    ack = torch.zeros(1)
    pair.dist.barrier()
    started = time.perf_counter()
    in_flight: deque = deque()
    if rank == 0:
        for i in range(iters):
            in_flight.append(pair.send(kind, buffers[i % w], 1, tag))
            if len(in_flight) >= w:
                in_flight.popleft().wait()
        while in_flight:
            in_flight.popleft().wait()
        pair.recv(kind, ack, 1, tag + 1).wait()
    else:
        posted = 0
        while posted < min(w, iters):
            in_flight.append(pair.recv(kind, buffers[posted % w], 0, tag))
            posted += 1
        while in_flight:
            in_flight.popleft().wait()
            if posted < iters:
                in_flight.append(pair.recv(kind, buffers[posted % w], 0, tag))
                posted += 1
        pair.send(kind, ack, 0, tag + 1).wait()
    return time.perf_counter() - started


def ping_pong(pair: Pair, kind: str, rank: int, size: int, iters: int, tag: int) -> float:
    """Seconds per one-way message (half a round trip), measured on rank 0."""
    import torch

    out, back = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    pair.dist.barrier()
    for warm in (True, False):
        count = max(10, iters // 10) if warm else iters
        started = time.perf_counter()
        for _ in range(count):
            if rank == 0:
                pair.send(kind, out, 1, tag).wait()
                pair.recv(kind, back, 1, tag).wait()
            else:
                pair.recv(kind, back, 0, tag).wait()
                pair.send(kind, out, 0, tag).wait()
        elapsed = time.perf_counter() - started
    return elapsed / (2 * iters)


def memcpy_seconds(size: int, iters: int, buffers: int) -> float:
    """One thread, libc memmove between touched buffers, cycling through `buffers` sources and
    destinations. With 1 the copy stays cache-hot once it fits in cache; with the stream's
    window it touches as much memory as the stream does, which is the like-for-like baseline."""
    import torch

    srcs = [torch.ones(size, dtype=torch.uint8) for _ in range(buffers)]
    dsts = [torch.zeros(size, dtype=torch.uint8) for _ in range(buffers)]
    for i in range(2 * buffers):
        ctypes.memmove(dsts[i % buffers].data_ptr(), srcs[i % buffers].data_ptr(), size)
    started = time.perf_counter()
    for i in range(iters):
        ctypes.memmove(dsts[i % buffers].data_ptr(), srcs[i % buffers].data_ptr(), size)
    return (time.perf_counter() - started) / iters


def worker(rank: int, port: int, args, results) -> None:
    import torch
    import torch.distributed as dist

    from megatron.shm_tensor_rdma import Endpoint, EndpointConfig

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    transports = ("shm", "tcp") if args.transport == "shm" else ("tcp",)
    threads = args.threads or None
    config = EndpointConfig(transports=transports, send_threads=threads, recv_threads=threads,
                            workload_bytes=args.workload_kib * KIB, spin_us=args.spin_us)
    ep = Endpoint.from_process_group(job_id=f"bench-{os.getppid()}", host="127.0.0.1", config=config)
    pair = Pair(ep, dist)
    rows, latency = [], []
    budget = args.budget_mib * MIB
    for index, size in enumerate(SIZES):
        iters = iterations(size, budget)
        stream(pair, "ours", rank, size, max(2, iters // 8), 10 * index)  # warm-up: fault in the rings
        ours = stream(pair, "ours", rank, size, iters, 10 * index + 2)
        gloo = stream(pair, "gloo", rank, size, iters, 10 * index + 4)
        hot = memcpy_seconds(size, iters, 1) if rank == 0 else 0.0
        same_set = memcpy_seconds(size, iters, window(size)) if rank == 0 else 0.0
        rows.append((size, iters, ours / iters, gloo / iters, hot, same_set))
    for index, size in enumerate(LATENCY_SIZES):
        ours = ping_pong(pair, "ours", rank, size, args.latency_iters, 1000 + 10 * index)
        gloo = ping_pong(pair, "gloo", rank, size, args.latency_iters, 1000 + 10 * index + 2)
        latency.append((size, ours, gloo))
    if rank == 0:
        results.put((rows, latency, ep.transport(1), config.resolved_threads()[0]))
    ep.close()
    dist.destroy_process_group()


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else (f"{size // KIB} KiB" if size >= KIB else f"{size} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=["shm", "tcp"], default="shm",
                        help="shm: shared memory (TCP as fallback); tcp: the TCP transport only (default %(default)s)")
    parser.add_argument("--threads", type=int, default=0,
                        help="send and receive threads per rank (default: chosen by CPU count)")
    parser.add_argument("--workload-kib", type=int, default=256, help="chunk size (KiB)")
    parser.add_argument("--spin-us", type=int, default=50,
                        help="receive threads poll this many microseconds before sleeping (default %(default)s)")
    parser.add_argument("--budget-mib", type=int, default=1024, help="bytes streamed per size and transport")
    parser.add_argument("--latency-iters", type=int, default=2000,
                        help="ping-pong round trips per latency message size (default %(default)s)")
    args = parser.parse_args()

    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, args, results)) for rank in range(2)]
    for p in procs:
        p.start()
    rows, latency, transport, threads = results.get(timeout=900)
    for p in procs:
        p.join(60)

    gb = 1e9
    print(f"shm_tensor_rdma P2P, 2 ranks on one host, transport={transport}, threads={threads}, "
          f"workload={args.workload_kib} KiB, cpus={os.cpu_count()}")
    print()
    print("memcpy: single-thread memmove of the same size; 'hot' reuses one buffer pair (cache-resident")
    print("up to L3 size), 'set' cycles through as many buffers as the stream keeps in flight.")
    print(f"{'size':>8} {'iters':>6} {'ours GB/s':>10} {'memcpy hot':>11} {'ours/hot':>9} {'memcpy set':>11} "
          f"{'ours/set':>9} {'gloo GB/s':>10} {'ours/gloo':>10}")
    for size, iters, ours, gloo, hot, same_set in rows:
        print(f"{human(size):>8} {iters:>6} {size / ours / gb:>10.2f} {size / hot / gb:>11.2f} {hot / ours:>9.2f} "
              f"{size / same_set / gb:>11.2f} {same_set / ours:>9.2f} {size / gloo / gb:>10.2f} "
              f"{gloo / ours:>10.2f}")
    print()
    print(f"{'size':>8} {'ours us':>10} {'gloo us':>10} {'gloo/ours':>10}   (one-way latency, half a ping-pong)")
    for size, ours, gloo in latency:
        print(f"{human(size):>8} {ours * 1e6:>10.1f} {gloo * 1e6:>10.1f} {gloo / ours:>10.2f}")


if __name__ == "__main__":
    main()
