"""PyTorch Lightning's `Trainer` with its DDP strategy on CPU (gloo), training a tiny MLP on
random data. Under torchrun Lightning detects the torchelastic environment and joins its process
group; the loop, gradient accumulation (`accumulate_grad_batches`, with DDP's `no_sync` on the
microbatches before the last) and the optimizer steps are Lightning's. Nothing in it knows about
MegaScan; faults come from outside.

    torchrun --nproc-per-node 2 tests/scan/loops/lightning_ddp.py --steps 6"""
import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accum", type=int, default=2, help="accumulate_grad_batches (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="samples per microbatch and rank (default %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="MLP blocks (default %(default)s)")
    args = parser.parse_args()

    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            blocks = []
            for _ in range(args.layers):
                blocks += [torch.nn.Linear(args.width, 4 * args.width), torch.nn.GELU(),
                           torch.nn.Linear(4 * args.width, args.width)]
            self.net = torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, 1))

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    L.seed_everything(args.seed, verbose=False)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    samples = args.steps * args.accum * args.batch * world_size
    generator = torch.Generator().manual_seed(args.seed)
    data = torch.utils.data.TensorDataset(torch.randn(samples, args.width, generator=generator),
                                          torch.randn(samples, 1, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)  # Lightning adds the sampler
    trainer = L.Trainer(accelerator="cpu", devices=local_world_size, num_nodes=world_size // local_world_size,
                        strategy="ddp", max_steps=args.steps, accumulate_grad_batches=args.accum, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=5, default_root_dir=None)
    trainer.fit(Regression(), loader)
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
