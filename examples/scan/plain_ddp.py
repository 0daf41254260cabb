"""A plain PyTorch DDP training script (nothing from megatron): used to show that
`python -m megatron.scan launch -- torchrun ... plain_ddp.py` traces a job without edits."""
import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="training steps (default %(default)s)")
    parser.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-ms in each step")
    parser.add_argument("--slow-ms", type=float, default=0.0,
                        help="milliseconds --slow-rank sleeps in each step (default %(default)s)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        inputs, targets = torch.randn(16, 32, generator=generator), torch.randn(16, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1e3)  # a slow device: every peer waits for it in the gradient all-reduce
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # an explicit collective, as logging code does
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {reported.item() / world_size:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
