"""MegaScope overhead: generation through MegaScope with capture off vs a plain greedy loop over
the same megatron-core model, measured in the same run, interleaved so both see the same load.

Plain generation: forward the whole sequence, argmax the last logits, append (no KV cache, as
MegaScope does). MegaScope: Generator.generate with no capture, which also computes the top-k
table and encodes one small step frame per token. Rounds alternate which goes first; the ratio
is the median over rounds of (MegaScope time / plain time), with its interquartile range, for
wall-clock time and for the generating thread's CPU time.
Capture on (every kind, 32 bins) is shown for scale, not as an overhead target.
Usage:
  python benchmarks/scope_overhead.py [--rounds 15] [--new-tokens 64] [--hidden 128] [--layers 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def build(args):
    from megatron.app.config import ModelConfig
    from megatron.app.tokenizer import NullTokenizer
    from megatron.scope.engine import Coordinator, Generator
    from megatron.scope.loading import build_random

    tokenizer = NullTokenizer(4095)  # the demo model's vocabulary size (4096 with eod)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                      seq_length=128, max_position_embeddings=128)
    model = build_random(cfg, tokenizer, seed=1)
    return model, Generator(Coordinator(model.runner), tokenizer, tokenizer.vocab_size)


def plain_generate(module, prompt: list[int], new_tokens: int, vocab: int) -> list[int]:
    from megatron.scope.runner import causal_mask

    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens = torch.tensor([sequence])
            seq = tokens.shape[1]
            logits = module(tokens, torch.arange(seq).unsqueeze(0), causal_mask(seq, tokens.device))
            sequence.append(int(logits[0, -1, :vocab].argmax()))
    return sequence


def scope_generate(generator, prompt: list[int], new_tokens: int, capture: list[str]) -> list[int]:
    from megatron.scope.engine import GenerateRequest

    frames = []
    request = GenerateRequest(prompts=[" ".join(map(str, prompt))], max_new_tokens=new_tokens, capture=capture,
                              bins=32, lens=bool(capture))
    summary = generator.generate(request, lambda kind, payload, droppable: frames.append(payload))
    return [token for token, _ in summary["tokens"][0]]


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds): on a shared machine the CPU time is the steadier
    measure of the work done, the wall time what a user waits."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15,
                        help="timed rounds of plain vs MegaScope generation (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens in the prompt (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the random model (default %(default)s)")
    parser.add_argument("--layers", type=int, default=4,
                        help="transformer layers of the random model (default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, generator = build(args)
    module = model.runner.module
    vocab = model.tokenizer.vocab_size
    prompt = [(7 * i + 3) % 4000 for i in range(args.prompt_tokens)]
    all_kinds = ["qkv", "attention", "fc1", "fc2", "layer"]

    # Same tokens both ways, so both loops do the same model work.
    assert plain_generate(module, prompt, 8, vocab) == scope_generate(generator, prompt, 8, [])
    for _ in range(2):  # warm-up
        plain_generate(module, prompt, args.new_tokens, vocab)
        scope_generate(generator, prompt, args.new_tokens, [])
    plain_times, scope_times, capture_times = [], [], []
    wall_ratios, cpu_ratios = [], []
    for round_index in range(args.rounds):
        runs = [("plain", lambda: plain_generate(module, prompt, args.new_tokens, vocab)),
                ("scope", lambda: scope_generate(generator, prompt, args.new_tokens, []))]
        if round_index % 2:
            runs.reverse()
        measured = {name: timed(fn) for name, fn in runs}
        plain_times.append(measured["plain"][0])
        scope_times.append(measured["scope"][0])
        wall_ratios.append(measured["scope"][0] / measured["plain"][0])
        cpu_ratios.append(measured["scope"][1] / measured["plain"][1])
        if round_index % 5 == 0:
            capture_times.append(timed(lambda: scope_generate(generator, prompt, args.new_tokens, all_kinds))[0])

    def ms_per_token(values: list[float]) -> float:
        return statistics.median(values) / args.new_tokens * 1e3

    print(f"MegaScope overhead: {args.layers} layers, hidden {args.hidden}, vocab {vocab}, prompt {args.prompt_tokens} "
          f"+ {args.new_tokens} new tokens, {args.rounds} interleaved rounds, 1 CPU thread")
    print(f"{'variant':<34}{'ms/token (median)':>20}{'ratio to plain':>18}")
    print(f"{'plain greedy loop':<34}{ms_per_token(plain_times):>20.3f}{1.0:>18.3f}")
    print(f"{'MegaScope, capture off':<34}{ms_per_token(scope_times):>20.3f}{statistics.median(wall_ratios):>18.4f}")
    print(f"{'MegaScope, every capture + lens':<34}{ms_per_token(capture_times):>20.3f}"
          f"{statistics.median(capture_times) / statistics.median(plain_times):>18.3f}")
    for name, ratios in (("wall-clock", wall_ratios), ("thread CPU", cpu_ratios)):
        low, _, high = statistics.quantiles(ratios, n=4)
        print(f"capture-off / plain, {name:<10}: median {statistics.median(ratios):.4f}, "
              f"interquartile range [{low:.4f}, {high:.4f}]  (target <= 1.01)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
