"""pytorch-ignite's built-in supervised loop (`create_supervised_trainer`, with its
`gradient_accumulation_steps`) run by `ignite.distributed.Parallel` over gloo, which joins the
torchrun job; `idist.auto_model` wraps the tiny MLP in DDP and `idist.auto_dataloader` shards the
random data. Ignite's accumulation calls backward on every microbatch without `no_sync`, so DDP
all-reduces the gradients of each microbatch. Nothing in it knows about MegaScan; faults come
from outside.

    torchrun --nproc-per-node 2 tests/scan/loops/ignite_trainer.py --steps 6"""
import argparse

import torch


def training(local_rank: int, args: argparse.Namespace) -> None:
    import ignite.distributed as idist
    from ignite.engine import Events, create_supervised_trainer
    from ignite.utils import manual_seed

    manual_seed(args.seed)
    rank, world_size = idist.get_rank(), idist.get_world_size()
    blocks = []
    for _ in range(args.layers):
        blocks += [torch.nn.Linear(args.width, 4 * args.width), torch.nn.GELU(),
                   torch.nn.Linear(4 * args.width, args.width)]
    model = idist.auto_model(torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, 1)))
    optimizer = idist.auto_optim(torch.optim.AdamW(model.parameters(), lr=1e-3))
    samples = args.steps * args.accum * args.batch * world_size
    generator = torch.Generator().manual_seed(args.seed)
    data = torch.utils.data.TensorDataset(torch.randn(samples, args.width, generator=generator),
                                          torch.randn(samples, 1, generator=generator))
    # auto_dataloader takes the batch size of the whole job and gives each rank its share.
    loader = idist.auto_dataloader(data, batch_size=args.batch * world_size, shuffle=True, num_workers=0,
                                   drop_last=True)
    trainer = create_supervised_trainer(model, optimizer, torch.nn.functional.mse_loss, device=idist.device(),
                                        gradient_accumulation_steps=args.accum)

    @trainer.on(Events.ITERATION_COMPLETED(every=5 * args.accum))
    def log(engine) -> None:
        if rank == 0:
            print(f"microbatch {engine.state.iteration} loss {engine.state.output:.4f}", flush=True)

    trainer.run(loader, max_epochs=1, epoch_length=args.steps * args.accum)
    if rank == 0:
        print(f"done: {trainer.state.iteration // args.accum} steps", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="samples per microbatch and rank (default %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="MLP blocks (default %(default)s)")
    args = parser.parse_args()

    import ignite.distributed as idist

    with idist.Parallel(backend="gloo") as parallel:  # under torchrun: joins its process group
        parallel.run(training, args)


if __name__ == "__main__":
    main()
