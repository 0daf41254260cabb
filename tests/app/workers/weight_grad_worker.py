"""Worker: a tensor-parallel rank of a GPTModel chunk fed through set_input_tensor (a later pipeline
stage), with megatron/app/weight_grad.py installed. For each case, every microbatch's forward and
unsplit backward, then the same with the backward split into I (all microbatches) and W: the
parameter and stage-input gradients must be bit-identical. Prints one line per case; exits non-zero
on the first difference.

Sequence parallelism is not supported by the CPU backend (megatron-core's sequence-parallel mappings
allocate on torch.cuda.current_device()); for the `sp` case this worker answers that call with the
CPU, so the all-gathers and reduce-scatters run over gloo."""
import argparse
import contextlib
import sys

import torch
import torch.distributed as dist

SEQ, MBS, HIDDEN, VOCAB, MICROBATCHES = 16, 2, 64, 100, 3


def build(backend, tp: int, sequence_parallel: bool, recompute: bool):
    from megatron.core.models.gpt import GPTModel

    from megatron.app.config import ModelConfig, ParallelConfig
    from megatron.app.model import gpt_model_kwargs, init_parallel_invariant, layer_spec, transformer_config

    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    if sequence_parallel:  # megatron-core's torch norms refuse sequence parallelism; the project's own norm does not
        extra["apply_layernorm_1p"] = True
    cfg = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                      max_position_embeddings=SEQ, vocab_size=VOCAB, untie_embeddings_and_output_weights=True, **extra)
    config = transformer_config(cfg, ParallelConfig(tensor_model_parallel_size=tp, world_size=tp), 1)
    config.sequence_parallel = sequence_parallel
    with backend.model_construction():
        chunk = GPTModel(config=config, transformer_layer_spec=layer_spec(cfg, config), pre_process=False,
                         post_process=True, **gpt_model_kwargs(cfg))
    init_parallel_invariant(chunk, 7, cfg)
    return chunk


def iteration(chunk, split: bool, tp: int, tp_rank: int, sequence_parallel: bool):
    from megatron.app.weight_grad import WeightGradWork, deferring

    works = [WeightGradWork(index) for index in range(MICROBATCHES)]
    scope = (lambda index: deferring(works[index])) if split else (lambda index: contextlib.nullcontext())
    forwards = []
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    for index in range(MICROBATCHES):
        generator = torch.Generator().manual_seed(1000 + index)
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
        stage_input = torch.randn(SEQ, MBS, HIDDEN, generator=generator)
        if sequence_parallel:
            stage_input = stage_input.chunk(tp)[tp_rank]
        received = stage_input.contiguous().requires_grad_(True)
        chunk.set_input_tensor(received)
        with scope(index):
            per_token = chunk(tokens[:, :-1], torch.arange(SEQ).expand(MBS, SEQ), mask, labels=tokens[:, 1:])
        forwards.append((per_token.float().mean(), received))
    for index, (loss, _) in enumerate(forwards):
        with scope(index):
            torch.autograd.backward(loss)
    for work in works:
        work.run()
    grads = {name: param.grad.clone() for name, param in chunk.named_parameters()}
    for param in chunk.parameters():
        param.grad = None
    return grads, [received.grad for _, received in forwards]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    from megatron.core import parallel_state

    from megatron.app.device import build_backend
    from megatron.app.weight_grad import install

    backend = build_backend("cpu")
    backend.init_distributed(timeout_s=120)
    backend.init_model_parallel(args.tp, 1, None, seed=7)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for case in ("tp", "tp-recompute", "sp"):
        sequence_parallel = case == "sp"
        if sequence_parallel:
            torch.cuda.current_device = lambda: "cpu"
        chunk = build(backend, args.tp, sequence_parallel, recompute=case.endswith("recompute"))
        qkv = chunk.decoder.layers[0].self_attention.linear_qkv
        assert qkv.sequence_parallel == sequence_parallel and qkv.allreduce_dgrad == (not sequence_parallel)
        deferred = install([chunk])
        assert all(deferred.values()), deferred
        reference, reference_inputs = iteration(chunk, False, args.tp, tp_rank, sequence_parallel)
        grads, inputs = iteration(chunk, True, args.tp, tp_rank, sequence_parallel)
        differ = [name for name in reference if not torch.equal(reference[name], grads[name])]
        differ += [f"stage input {i}" for i, (a, b) in enumerate(zip(reference_inputs, inputs)) if not torch.equal(a, b)]
        if differ:
            print(f"case {case} rank {dist.get_rank()}: not bit-identical: {differ}", flush=True)
            sys.exit(1)
        print(f"case {case} rank {dist.get_rank()}: bit-identical, {len(deferred)} layers deferred", flush=True)
    backend.shutdown()


if __name__ == "__main__":
    main()
