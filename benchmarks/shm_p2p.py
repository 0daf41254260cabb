"""shm_tensor_rdma point-to-point benchmark: bandwidth and latency between two local ranks.

Everything below is measured in one invocation, so the columns compare like with like:

* bandwidth of a windowed one-way stream, 4 KiB .. 64 MiB, by
  - the library driven from C++ (`Engine.stream`: the same loop with no Python in it),
  - the library driven from Python (`Endpoint.isend`/`irecv` handles, what a user's loop gets),
  - Open MPI over its shared-memory path (`--compare-mpi`; benchmarks/mpi_reference.py),
  - a single-thread memcpy of the same size, and gloo send/recv over loopback;
* one-way latency (half a ping-pong) of 8 B, 256 B and 4 KiB by the same parties, the Python
  side both with the blocking `Endpoint.send`/`recv` and with handles.

With --repeat N the whole set is measured N times, alternating ours and Open MPI's runs, and
each cell is the median.

    python benchmarks/shm_p2p.py                           # shared memory, ours vs memcpy and gloo
    python benchmarks/shm_p2p.py --compare-mpi --repeat 3  # plus Open MPI (needs mpicc, mpirun)
    python benchmarks/shm_p2p.py --transport tcp           # our TCP transport instead
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
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
    """The two ways of moving a tensor from Python that are compared: our endpoint and gloo."""

    def __init__(self, endpoint, dist) -> None:
        self.ep, self.dist = endpoint, dist

    def posters(self, kind: str):
        """(isend, irecv) taking (tensor, peer, tag) and returning a handle with wait(): the
        endpoint's own bound methods, so the loops time the library and not a dispatch layer."""
        if kind == "ours":
            return self.ep.isend, self.ep.irecv
        dist = self.dist
        return (lambda t, peer, tag: dist.isend(t, peer, tag=tag)), (lambda t, peer, tag: dist.irecv(t, peer, tag=tag))


def stream(pair: Pair, kind: str, rank: int, size: int, iters: int, tag: int) -> float:
    """Rank 0 streams `iters` messages with a window in flight; returns seconds on rank 0,
    from the first send until rank 1 acknowledged the last receive."""
    import torch

    w = window(size)
    send, recv = pair.posters(kind)
    buffers = [torch.ones(size, dtype=torch.uint8) for _ in range(w)]
    ack = torch.zeros(1)
    pair.dist.barrier()
    started = time.perf_counter()
    in_flight: deque = deque()
    if rank == 0:
        for i in range(iters):
            in_flight.append(send(buffers[i % w], 1, tag))
            if len(in_flight) >= w:
                in_flight.popleft().wait()
        while in_flight:
            in_flight.popleft().wait()
        recv(ack, 1, tag + 1).wait()
    else:
        posted = 0
        while posted < min(w, iters):
            in_flight.append(recv(buffers[posted % w], 0, tag))
            posted += 1
        while in_flight:
            in_flight.popleft().wait()
            if posted < iters:
                in_flight.append(recv(buffers[posted % w], 0, tag))
                posted += 1
        send(ack, 0, tag + 1).wait()
    return time.perf_counter() - started


def ping_pong(pair: Pair, kind: str, rank: int, size: int, iters: int, tag: int) -> float:
    """Seconds per one-way message (half a round trip), measured on rank 0. `kind`: "ours"
    (handles), "blocking" (Endpoint.send/recv) or "gloo"."""
    import torch

    out, back = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    ep = pair.ep
    send, recv = pair.posters("ours" if kind == "blocking" else kind)
    pair.dist.barrier()
    for warm in (True, False):
        count = max(10, iters // 10) if warm else iters
        started = time.perf_counter()
        if kind == "blocking":
            for _ in range(count):
                if rank == 0:
                    ep.send(out, 1, tag)
                    ep.recv(back, 1, tag)
                else:
                    ep.recv(back, 0, tag)
                    ep.send(out, 0, tag)
        else:
            for _ in range(count):
                if rank == 0:
                    send(out, 1, tag).wait()
                    recv(back, 1, tag).wait()
                else:
                    recv(back, 0, tag).wait()
                    send(out, 0, tag).wait()
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
                            workload_bytes=args.workload_kib * KIB, spin_us=args.spin_us,
                            single_copy=not args.two_copies)
    ep = Endpoint.from_process_group(job_id=f"bench-{os.getppid()}-{port}", host="127.0.0.1", config=config)
    engine, peer = ep._engine, 1 - rank
    pair = Pair(ep, dist)
    rows, latency = [], []
    budget = args.budget_mib * MIB
    for index, size in enumerate(s for s in SIZES if s <= args.max_size_mib * MIB):
        iters, w, tag = iterations(size, budget), window(size), 100 * index
        engine.stream(peer, size, max(2, iters // 8), w, rank == 0, tag)  # warm-up: fault in buffers, rings
        dist.barrier()
        cpp = engine.stream(peer, size, iters, w, rank == 0, tag + 10)
        stream(pair, "ours", rank, size, max(2, iters // 8), tag + 20)
        ours = stream(pair, "ours", rank, size, iters, tag + 30)
        gloo = stream(pair, "gloo", rank, size, iters, tag + 40)
        hot = memcpy_seconds(size, iters, 1) if rank == 0 else 0.0
        same_set = memcpy_seconds(size, iters, w) if rank == 0 else 0.0
        rows.append(dict(size=size, iters=iters, window=w, cpp=cpp / iters, ours=ours / iters, gloo=gloo / iters,
                         memcpy_hot=hot, memcpy_set=same_set))
    for index, size in enumerate(LATENCY_SIZES):
        tag = 5000 + 100 * index
        dist.barrier()
        engine.ping_pong(peer, size, max(10, args.latency_iters // 10), rank == 0, tag)
        cpp = engine.ping_pong(peer, size, args.latency_iters, rank == 0, tag + 10)
        blocking = ping_pong(pair, "blocking", rank, size, args.latency_iters, tag + 20)
        ours = ping_pong(pair, "ours", rank, size, args.latency_iters, tag + 30)
        gloo = ping_pong(pair, "gloo", rank, size, args.latency_iters, tag + 40)
        latency.append(dict(size=size, cpp=cpp, blocking=blocking, ours=ours, gloo=gloo))
    if rank == 0:
        results.put(dict(stream=rows, latency=latency, transport=ep.transport(1), copy_path=ep.copy_path(1),
                         threads=config.resolved_threads()[0]))
    ep.close()
    dist.destroy_process_group()


def measure_ours(args) -> dict:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, args, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def measure_mpi(args, exe) -> tuple[dict | None, str]:
    from mpi_reference import run

    budget = args.budget_mib * MIB
    stream_plan = [(s, iterations(s, budget), window(s)) for s in SIZES if s <= args.max_size_mib * MIB]
    return run(exe, stream_plan, [(s, args.latency_iters) for s in LATENCY_SIZES])


def median_rows(runs: list[list[dict]], key: str) -> list[dict]:
    """Cell-wise median over runs of rows matched by key."""
    out = []
    for i, first in enumerate(runs[0]):
        row = {}
        for field, value in first.items():
            values = [run[i][field] for run in runs]
            row[field] = statistics.median(values) if isinstance(value, float) else value
        out.append(row)
    return out


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else (f"{size // KIB} KiB" if size >= KIB else f"{size} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=["shm", "tcp"], default="shm",
                        help="shm: shared memory (TCP as fallback); tcp: the TCP transport only (default %(default)s)")
    parser.add_argument("--compare-mpi", action="store_true",
                        help="also measure Open MPI's shared-memory path (builds benchmarks/mpi_p2p.c with mpicc; "
                             "the column is skipped, with the reason, where Open MPI is not installed)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure everything this many times (ours and Open MPI alternating); cells are medians")
    parser.add_argument("--two-copies", action="store_true",
                        help="turn single copy (cross-memory attach) off: large messages go through the ring")
    parser.add_argument("--threads", type=int, default=0,
                        help="send and receive threads per rank (default: chosen by CPU count)")
    parser.add_argument("--workload-kib", type=int, default=256, help="chunk size (KiB)")
    parser.add_argument("--spin-us", type=int, default=50,
                        help="a waiting caller polls this many microseconds before sleeping (default %(default)s)")
    parser.add_argument("--budget-mib", type=int, default=1024, help="bytes streamed per size and party")
    parser.add_argument("--max-size-mib", type=int, default=64, help="largest streamed message (MiB)")
    parser.add_argument("--latency-iters", type=int, default=2000,
                        help="ping-pong round trips per latency message size (default %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's figures to this file")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    exe, mpi_skip = None, "not requested (--compare-mpi)"
    if args.compare_mpi:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from mpi_reference import find_or_build

        exe, mpi_skip = find_or_build()
    ours_runs, mpi_runs = [], []
    for r in range(args.repeat):
        print(f"[shm_p2p] run {r + 1}/{args.repeat}: ours ...", file=sys.stderr, flush=True)
        ours_runs.append(measure_ours(args))
        if exe is not None:
            print(f"[shm_p2p] run {r + 1}/{args.repeat}: Open MPI ...", file=sys.stderr, flush=True)
            result, why = measure_mpi(args, exe)
            if result is None:
                exe, mpi_skip = None, why
            else:
                mpi_runs.append(result)
    if args.json:
        args.json.write_text(json.dumps(dict(ours=ours_runs, mpi=mpi_runs, args=vars(args)), default=str, indent=1))
    first = ours_runs[0]
    rows = median_rows([o["stream"] for o in ours_runs], "size")
    latency = median_rows([o["latency"] for o in ours_runs], "size")
    mpi_bw = {row["size"]: statistics.median(m["stream"][i]["seconds_per_message"] for m in mpi_runs)
              for i, row in enumerate(mpi_runs[0]["stream"])} if mpi_runs else {}
    mpi_lat = {row["size"]: statistics.median(m["latency"][i]["one_way_seconds"] for m in mpi_runs)
               for i, row in enumerate(mpi_runs[0]["latency"])} if mpi_runs else {}

    gb = 1e9
    print(f"shm_tensor_rdma P2P, 2 ranks on one host, transport={first['transport']} ({first['copy_path']}), "
          f"threads={first['threads']}, workload={args.workload_kib} KiB, cpus={os.cpu_count()}, "
          f"median of {args.repeat} run(s)")
    if mpi_runs:
        m = mpi_runs[0]
        print(f"Open MPI: {m['mpi_version']}, pml ob1 + btl vader, single copy: {m['single_copy']}")
    else:
        print(f"Open MPI: column skipped: {mpi_skip}")
    print()
    print("GB/s of a windowed stream. C++: the library's own loop (Engine.stream); Python: Endpoint handles.")
    print("memcpy: single-thread memmove cycling through as many buffers as the stream keeps in flight.")
    mpi_head = f" {'Open MPI':>9} {'C++/MPI':>8} {'Py/MPI':>7}" if mpi_runs else ""
    print(f"{'size':>8} {'C++':>7} {'Python':>7}{mpi_head} {'memcpy':>7} {'C++/memcpy':>10} {'gloo':>6} "
          f"{'Py/gloo':>8}")
    for row in rows:
        size = row["size"]
        cells = f"{human(size):>8} {size / row['cpp'] / gb:>7.2f} {size / row['ours'] / gb:>7.2f}"
        if mpi_runs:
            mpi = mpi_bw[size]
            cells += f" {size / mpi / gb:>9.2f} {mpi / row['cpp']:>8.2f} {mpi / row['ours']:>7.2f}"
        cells += (f" {size / row['memcpy_set'] / gb:>7.2f} {row['memcpy_set'] / row['cpp']:>10.2f} "
                  f"{size / row['gloo'] / gb:>6.2f} {row['gloo'] / row['ours']:>8.2f}")
        print(cells)
    print()
    print("One-way latency in us (half a ping-pong). C++: Engine.ping_pong; send/recv: the blocking Python")
    print("calls; handles: isend/irecv + wait.")
    mpi_head = f" {'Open MPI':>9}" if mpi_runs else ""
    print(f"{'size':>8} {'C++':>7} {'send/recv':>10} {'handles':>8}{mpi_head} {'gloo':>7} {'gloo/handles':>13}")
    for row in latency:
        size = row["size"]
        cells = f"{human(size):>8} {row['cpp'] * 1e6:>7.2f} {row['blocking'] * 1e6:>10.2f} {row['ours'] * 1e6:>8.2f}"
        if mpi_runs:
            cells += f" {mpi_lat[size] * 1e6:>9.2f}"
        cells += f" {row['gloo'] * 1e6:>7.1f} {row['gloo'] / row['ours']:>13.1f}"
        print(cells)


if __name__ == "__main__":
    main()
