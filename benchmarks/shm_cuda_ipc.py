"""CUDA tensors between two processes on one GPU: shm_tensor_rdma by CUDA IPC handle, the same
library staging through host memory (`EndpointConfig(cuda_ipc=False)`), and a device-to-device
`Tensor.copy_` inside one process (the ceiling: what the copy engine does with no IPC at all).

Everything is measured in one invocation. For each size the sender keeps `window` messages in
flight from as many preallocated CUDA buffers (reused, as a pipeline's activations are), the
receiver receives into its own; the time runs on the sender from its first post to the
receiver's acknowledgement. Latency is half a ping-pong of blocking send/recv.

    python benchmarks/shm_cuda_ipc.py                      # needs one CUDA GPU
    python benchmarks/shm_cuda_ipc.py --json out.json --max-size-mib 64
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KIB, MIB = 1 << 10, 1 << 20
SIZES = [64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
LATENCY_SIZES = [4 * KIB, 1 * MIB]
WINDOW = 4


def iterations(size: int, budget: int) -> int:
    return max(10, min(1000, budget // size))


def worker(rank: int, port: int, args, results) -> None:
    import torch
    import torch.distributed as dist

    from megatron.shm_tensor_rdma import Endpoint, EndpointConfig

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    peer, out = 1 - rank, {}
    for mode in ("ipc", "staged"):
        config = EndpointConfig(cuda_ipc=(mode == "ipc"), transfer_timeout=120)
        ep = Endpoint.from_store(store, f"cuda-bench-{port}-{mode}", rank, 2, host="127.0.0.1", config=config)
        rows, latency = [], []
        for index, size in enumerate(s for s in SIZES if s <= args.max_size_mib * MIB):
            n = size // 4
            buffers = [torch.full((n,), float(i) if rank == 0 else -1.0, device=dev) for i in range(WINDOW)]
            iters = iterations(size, args.budget_mib * MIB)
            for attempt, count in ((0, max(2, iters // 10)), (1, iters)):  # warm-up, then timed
                tag = 100_000 * index + 10_000 * attempt
                torch.cuda.synchronize()
                started = time.perf_counter()
                handles = []
                for i in range(count):
                    if len(handles) == WINDOW:
                        handles.pop(0).wait(120)
                    if rank == 0:
                        handles.append(ep.isend(buffers[i % WINDOW], peer, tag + i))
                    else:
                        handles.append(ep.irecv(buffers[i % WINDOW], peer, tag + i))
                for h in handles:
                    h.wait(120)
                if rank == 0:
                    ep.recv(torch.empty(1), peer, tag + 9999)
                else:
                    ep.send(torch.ones(1), peer, tag + 9999)
                seconds = time.perf_counter() - started
            if rank == 1:  # every slot received the sender's slot of the same index
                assert all(bool((b == float(i)).all()) for i, b in enumerate(buffers)), f"{mode} {size}: data differ"
            rows.append(dict(size=size, iters=iters, seconds=seconds / iters))
        for index, size in enumerate(LATENCY_SIZES):
            a = torch.ones(size // 4, device=dev)
            b = torch.empty(size // 4, device=dev)
            for attempt, count in ((0, 20), (1, args.latency_iters)):
                tag = 900_000 + 10_000 * index + 5_000 * attempt
                started = time.perf_counter()
                for i in range(count):
                    if rank == 0:
                        ep.send(a, peer, tag + i)
                        ep.recv(b, peer, tag + i)
                    else:
                        ep.recv(b, peer, tag + i)
                        ep.send(a, peer, tag + i)
                seconds = time.perf_counter() - started
            latency.append(dict(size=size, seconds=seconds / (2 * count)))
        out[mode] = dict(stream=rows, latency=latency, path=ep.device_path(peer), stats=ep.stats())
        ep.close()
        del buffers
        torch.cuda.empty_cache()
    if rank == 0:
        results.put(out)


def device_copy_seconds(size: int, iters: int) -> float:
    """A device-to-device copy_ of `size` bytes in one process, per copy."""
    import torch

    src = torch.ones(size // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=int, default=8192, help="bytes streamed per size and mode (MiB)")
    parser.add_argument("--max-size-mib", type=int, default=256, help="largest message (MiB)")
    parser.add_argument("--latency-iters", type=int, default=500, help="round trips per latency figure")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("shm_cuda_ipc.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, args, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        figures = results.get(timeout=1200)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for row in figures["ipc"]["stream"]:
        row["d2d"] = device_copy_seconds(row["size"], min(200, row["iters"]))
    figures["device"] = torch.cuda.get_device_name(0)
    print(f"{figures['device']}; IPC path: {figures['ipc']['path']}; staged: {figures['staged']['path']}")
    print(f"receiver stats (ipc run): {figures['ipc']['stats']}")
    print("\nbandwidth, GB/s (window of 4 messages):")
    print("| size | CUDA IPC | host staging | D2D copy_ (one process) | IPC / D2D | IPC / staging |")
    print("|---|---|---|---|---|---|")
    for ipc, staged in zip(figures["ipc"]["stream"], figures["staged"]["stream"]):
        size = ipc["size"]
        gb = [size / s / 1e9 for s in (ipc["seconds"], staged["seconds"], ipc["d2d"])]
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        print(f"| {label} | {gb[0]:.1f} | {gb[1]:.1f} | {gb[2]:.1f} | {gb[0] / gb[2]:.2f} | {gb[0] / gb[1]:.1f} |")
    print("\none-way latency of blocking send/recv, us:")
    print("| size | CUDA IPC | host staging |")
    print("|---|---|---|")
    for ipc, staged in zip(figures["ipc"]["latency"], figures["staged"]["latency"]):
        label = f"{ipc['size'] // MIB} MiB" if ipc["size"] >= MIB else f"{ipc['size'] // KIB} KiB"
        print(f"| {label} | {ipc['seconds'] * 1e6:.1f} | {staged['seconds'] * 1e6:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
