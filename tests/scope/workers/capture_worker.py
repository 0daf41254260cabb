"""Generate with every capture on under torchrun (or one plain process) and save what rank 0
received, so a test can compare TP x PP layouts with the one-rank run."""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--load", default=None, help="serve this pretrain_gpt.py checkpoint instead of a random model")
    args = parser.parse_args()

    from megatron.app.config import ModelConfig
    from megatron.app.tokenizer import ByteLevelTokenizer
    from megatron.scope.codec import decode_frame, encode_frame
    from megatron.scope.engine import Coordinator, GenerateRequest, Generator, leave_process_group
    from megatron.scope.loading import build_random, load_checkpoint
    from megatron.scope.perturb import Perturbation

    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                      init_method_std=0.3)  # peaked logits: no near-ties to reorder top-k
    if args.load:
        model = load_checkpoint(args.load, tp=args.tp, pp=args.pp)
    else:
        model = build_random(cfg, ByteLevelTokenizer(), tp=args.tp, pp=args.pp, seed=77)
    coordinator = Coordinator(model.runner)
    if dist.get_rank() != 0:
        coordinator.follow()
        leave_process_group()
        return 0
    generator = Generator(coordinator, model.tokenizer, model.tokenizer.vocab_size)
    saved = {}
    for name, perturbations in (
        ("clean", []),
        ("perturbed", [Perturbation(kind="storage", type="gaussian", intensity=0.02, layers=[1, 2], seed=3),
                       Perturbation(kind="calculation", type="uniform", intensity=0.2, heads=[1, 3], seed=4),
                       Perturbation(kind="system", type="gaussian", intensity=0.1, layers=[2], tokens=[1, 4])]),
    ):
        frames = []
        request = GenerateRequest(prompts=["Tensor", "pipe"], max_new_tokens=3, bins=0, lens=True, top_k=4,
                                  capture=["qkv", "attention", "fc1", "fc2", "layer"], perturbations=perturbations)
        summary = generator.generate(request, lambda kind, payload, drop: frames.append((kind, payload)))
        steps = [decode_frame(encode_frame(*p)) for kind, p in frames if kind == "frame"]
        saved[name] = {"texts": summary["texts"],
                       "arrays": [{k: torch.from_numpy(v.copy()) for k, v in a.items()} for _, a in steps],
                       "topk": [[s["topk"] for s in h["samples"]] for h, _ in steps]}
    coordinator.send("exit")
    torch.save(saved, args.out)
    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
