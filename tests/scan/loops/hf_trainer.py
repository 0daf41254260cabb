"""Hugging Face `transformers.Trainer` training a tiny GPT-2 built locally from a config (random
weights, random tokens, nothing downloaded) on CPU. Under torchrun the Trainer (through
accelerate) sets up DDP over gloo itself; gradient accumulation is the Trainer's. Nothing in it
knows about MegaScan; faults come from outside.

    torchrun --nproc-per-node 2 tests/scan/loops/hf_trainer.py --steps 6"""
import argparse
import os
import tempfile

import torch


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (samples, seq_length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps (default %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size (default %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="n_embd (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="n_layer (default %(default)s)")
    parser.add_argument("--seq-length", type=int, default=32, help="tokens per sample (default %(default)s)")
    args = parser.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    set_seed(args.seed)
    config = GPT2Config(vocab_size=256, n_positions=args.seq_length, n_embd=args.width, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    samples = args.steps * args.accum * args.batch * world_size
    with tempfile.TemporaryDirectory(prefix="hf_trainer_") as output_dir:  # nothing is saved into it
        training = TrainingArguments(
            output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
            max_steps=args.steps, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
            learning_rate=1e-3, logging_steps=5, disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
            dataloader_pin_memory=False, ddp_find_unused_parameters=False)
        trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(samples, args.seq_length, 256,
                                                                                 args.seed))
        result = trainer.train()
        if trainer.is_world_process_zero():
            print(f"done: {result.global_step} steps, loss {result.training_loss:.4f}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
