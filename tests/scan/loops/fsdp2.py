"""Baseline loop: FSDP2 (`torch.distributed.fsdp.fully_shard`) the way its users write it: each
residual block sharded, then the root; gradient accumulation with gradient reduction switched off
for every microbatch but the last (`set_requires_gradient_sync`). Parameters are all-gathered per
block in forward and backward, gradients reduce-scattered. Nothing in it knows about MegaScan.

    torchrun --nproc-per-node 2 tests/scan/loops/fsdp2.py --steps 6"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and data (default %(default)s)")
    parser.add_argument("--accum", type=int, default=2, help="microbatches per optimizer step (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="samples per microbatch and rank (default %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="residual blocks (default %(default)s)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = Model(args.width, args.layers)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for step in range(args.steps):
        for micro in range(args.accum):
            model.set_requires_gradient_sync(micro == args.accum - 1)
            inputs = torch.randn(args.batch, args.width, generator=generator)
            targets = torch.randn(args.batch, 1, generator=generator)
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
