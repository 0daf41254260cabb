"""Worker: one training iteration on synthetic microbatches; saves loss and per-parameter
gradients (by global name, with TP shard info) for comparison with an unpipelined run."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from megatron.app.config import ModelConfig, ParallelConfig, parse_layer_split
from megatron.app.device import build_backend
from megatron.app.executor import LossOptions, PipelineExecutor, StageContext
from megatron.app.model import build_model_chunks, global_parameter_name
from megatron.app.schedule import PipelineLayout, build_schedule


def synthetic_microbatch(index: int, mbs: int, seq: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=generator)
    loss_mask = torch.ones(mbs, seq)
    loss_mask[:, : index % 3] = 0.0  # uneven masks make the loss normalisation matter
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq).expand(mbs, seq).contiguous(),
        "attention_mask": torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp-layers", type=int, default=None)
    parser.add_argument("--split", type=parse_layer_split, default=None, help="--pipeline-layer-split")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--untie", action="store_true")
    parser.add_argument("--per-token", action="store_true", help="--calculate-per-token-loss")
    parser.add_argument("--swiglu", action="store_true", help="a Llama-style model (SwiGLU, RMSNorm, RoPE, GQA, no "
                        "biases, zero-centred norms)")
    parser.add_argument("--schedule", choices=["ours", "megatron-core", "both"], default="ours",
                        help="both: run ours, then megatron-core's get_forward_backward_func() on the same "
                             "model and microbatches, and save both results")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                              num_layers_per_virtual_pipeline_stage=args.vpp_layers, pipeline_layer_split=args.split,
                              world_size=world)
    model = ModelConfig(num_layers=args.layers, hidden_size=64, num_attention_heads=4, seq_length=16,
                        max_position_embeddings=16, vocab_size=100,
                        untie_embeddings_and_output_weights=args.untie, calculate_per_token_loss=args.per_token,
                        **(dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                                num_query_groups=2, add_bias_linear=False, apply_layernorm_1p=True,
                                ffn_hidden_size=96) if args.swiglu else {}))
    chunks_n = parallel.virtual_chunks(model.num_layers)
    backend = build_backend("cpu")
    backend.init_distributed(timeout_s=120)
    backend.init_model_parallel(args.tp, args.pp, chunks_n if chunks_n > 1 else None, seed=7)
    chunks = build_model_chunks(model, parallel, chunks_n, 7, backend.model_construction)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp = parallel.data_parallel_size
    layout = PipelineLayout(pp_size=args.pp, num_chunks=chunks_n, num_microbatches=args.microbatches // dp)
    stage = StageContext(layout=layout, pp_rank=pp_rank,
                         pp_global_ranks=dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
                         activation_shape=(16, 2, 64), dtype=torch.float32, device=torch.device("cpu"))
    name = "interleaved" if chunks_n > 1 else "1f1b"
    dp_rank = parallel_state.get_data_parallel_rank()
    per_dp = args.microbatches // dp
    schedules = ["ours", "megatron-core"] if args.schedule == "both" else [args.schedule]
    saved = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "dp_rank": dp_rank, "pp_rank": pp_rank,
             "tp_size": args.tp, "swiglu": args.swiglu}
    for which in schedules:
        backend.zero_grad(chunks)
        if which == "ours":
            executor = PipelineExecutor(chunks, stage, loss=LossOptions(per_token=args.per_token))
        else:
            from megatron.app.mcore_schedule import MegatronCoreSchedule

            executor = MegatronCoreSchedule(chunks, stage)
        result = executor.run(build_schedule(name, layout, pp_rank),
                              lambda mb: synthetic_microbatch(dp_rank * per_dp + mb, 2, 16, 100))
        backend.finalize_grads(chunks)
        if args.per_token:
            from megatron.app.train import divide_by_global_batch_tokens

            counted = pp_rank == args.pp - 1 and saved["tp_rank"] == 0
            divide_by_global_batch_tokens(backend, chunks, result.num_tokens if counted else 0, dp)
        grads = {}
        for chunk in chunks:
            for local, param in chunk.named_parameters():
                grads[global_parameter_name(chunk, local) + ("@output" if local.startswith("output_layer") else "")] = (
                    param.grad.clone(),
                    getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None,
                )
        saved[which] = {"losses": result.losses, "grads": grads, "num_tokens": result.num_tokens}
    # The single-schedule form keeps the layout the unpipelined comparison reads.
    saved.update(saved[schedules[0]])
    torch.save(saved, f"{args.out}/rank{dist.get_rank()}.pt")
    backend.shutdown()


if __name__ == "__main__":
    sys.exit(main())
