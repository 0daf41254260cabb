"""A training loop written directly against megatron-core, the way its own simple-loop example
writes one: GPTModel, `get_forward_backward_func()`, synthetic data, a torch optimizer, and
gradients synced by megatron-core's DistributedDataParallel and `finalize_model_grads`. Nothing
here comes from this project except one call, `run_megatron_core_on_cpu(seed)`, that lets the same
script run on CPU ranks (gloo); on GPUs it calls megatron-core's `model_parallel_cuda_manual_seed(seed)`.

    torchrun --nproc-per-node 4 examples/megatron_core/train_loop.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Trace it without editing it:

    python -m megatron.scan launch --trace-dir trace -- \\
        torchrun --nproc-per-node 4 examples/megatron_core/train_loop.py --pipeline-model-parallel-size 2
    python scripts/aggregate.py -b trace -d
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks per model")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        help="layers per model chunk for the interleaved schedule (default: no chunks)")
    parser.add_argument("--train-iters", type=int, default=20, help="optimizer steps")
    parser.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    parser.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq-length", type=int, default=64, help="tokens per sample")
    parser.add_argument("--vocab-size", type=int, default=256, help="vocabulary of the synthetic data")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="samples per microbatch")
    parser.add_argument("--num-microbatches", type=int, default=4, help="microbatches per step and data-parallel rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=1234, help="model and data seed")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA when available, else CPU ranks over gloo")
    return parser.parse_args()


def initialize(args: argparse.Namespace) -> torch.device:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    chunks = None
    if args.num_layers_per_virtual_pipeline_stage:
        chunks = args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=chunks,
    )
    torch.manual_seed(args.seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
        return torch.device("cuda", torch.cuda.current_device())
    from megatron.app.cpu_stand_ins import run_megatron_core_on_cpu

    run_megatron_core_on_cpu(args.seed)  # the only line that differs on CPU
    return torch.device("cpu")


def build_model(args: argparse.Namespace, device: torch.device) -> list[GPTModel]:
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        overlap_p2p_comm=chunks > 1, batch_p2p_comm=chunks == 1,
    )
    model = []
    for chunk in range(chunks):
        vp_stage = chunk if chunks > 1 else None
        model.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
            max_sequence_length=args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        ).to(device))
    return model


def synthetic_batches(args: argparse.Namespace, step: int, device: torch.device):
    """This data-parallel rank's microbatches of step `step`: random tokens, next-token labels."""
    dp_rank, seq = parallel_state.get_data_parallel_rank(), args.seq_length
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
    positions = torch.arange(seq, device=device).expand(args.micro_batch_size, seq)
    for microbatch in range(args.num_microbatches):
        generator = torch.Generator().manual_seed(args.seed + 1_000_003 * step + 1009 * dp_rank + microbatch)
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, seq + 1), generator=generator).to(device)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions, "attention_mask": mask}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def wrap_for_data_parallel(model: list[GPTModel]) -> list[DistributedDataParallel]:
    """megatron-core's DDP: gradients accumulate in per-bucket buffers (`param.main_grad`) and are
    all-reduced over the data-parallel group by `finalize_model_grads`, which the schedule calls
    at the end of each forward-backward (with the tied embedding's all-reduce)."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=index > 0) for index, chunk in enumerate(model)]
    wrapped[0].config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def main() -> None:
    args = parse_args()
    device = initialize(args)
    model = wrap_for_data_parallel(build_model(args, device))
    params = [p for chunk in model for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    forward_backward = get_forward_backward_func()
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    for step in range(args.train_iters):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # param.grad must not alias main_grad during backward
        for chunk in model:
            chunk.zero_grad_buffer()
        data = [synthetic_batches(args, step, device) for _ in model]
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=data if len(model) > 1 else data[0],
            model=model if len(model) > 1 else model[0], num_microbatches=args.num_microbatches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
        for param in params:
            param.grad = param.main_grad  # the synced gradient, for the torch optimizer
        optimizer.step()
        if last_stage and parallel_state.get_tensor_model_parallel_rank() == 0 \
                and parallel_state.get_data_parallel_rank() == 0:
            loss = sum(float(entry["lm loss"]) for entry in losses) / len(losses)
            print(f" iteration {step + 1:8d}/{args.train_iters:8d} | lm loss: {loss:.6E} | "
                  f"elapsed time per iteration (ms): {(time.perf_counter() - started) * 1e3:.1f}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
