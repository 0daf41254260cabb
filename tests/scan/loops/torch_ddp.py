"""Baseline loop: plain PyTorch DDP with gradient accumulation, the way its users write it (the
microbatches before the last one run under `no_sync()`, so one gradient all-reduce per step).
Nothing in it knows about MegaScan; faults come from outside.

    torchrun --nproc-per-node 2 tests/scan/loops/torch_ddp.py --steps 6"""
import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def make_model(width: int, layers: int) -> torch.nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accum", type=int, default=2, help="microbatches per optimizer step (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="samples per microbatch and rank (default %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="MLP blocks (default %(default)s)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(make_model(args.width, args.layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for step in range(args.steps):
        for micro in range(args.accum):
            inputs = torch.randn(args.batch, args.width, generator=generator)
            targets = torch.randn(args.batch, 1, generator=generator)
            sync = micro == args.accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(inputs), targets) / args.accum
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == args.steps - 1:
            reported = loss.detach() * args.accum
            dist.all_reduce(reported)
            if rank == 0:
                print(f"step {step} loss {reported.item() / world_size:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
