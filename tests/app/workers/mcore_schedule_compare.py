"""Worker (CUDA): train a few iterations with megatron-core's DDP and optimizer, driving the
pipeline either with this project's executor (`--mode ours`) or with megatron-core's own
schedule from `get_forward_backward_func()` (`--mode mcore`). Saves per-iteration losses, grad
norms and the final weights so the two modes can be compared exactly."""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_grads import synthetic_microbatch  # noqa: E402

from megatron.app.config import ModelConfig, OptimizerConfig, ParallelConfig  # noqa: E402
from megatron.app.device import build_backend  # noqa: E402
from megatron.app.executor import PipelineExecutor, StageContext, microbatch_loss  # noqa: E402
from megatron.app.model import build_model_chunks, global_parameter_name, unwrap_model  # noqa: E402
from megatron.app.schedule import PipelineLayout, build_schedule  # noqa: E402

import time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ours", "mcore"], required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    # Model size (the defaults are the small exactness test; benchmarks/cuda_training.py times larger ones)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=100)
    parser.add_argument("--skip-weights", action="store_true", help="save losses and timings only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    SEQ, MBS, HIDDEN, VOCAB = args.seq, args.mbs, args.hidden, args.vocab
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = ParallelConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=args.pp, world_size=world)
    model = ModelConfig(num_layers=args.layers, hidden_size=HIDDEN, num_attention_heads=args.heads, seq_length=SEQ,
                        max_position_embeddings=SEQ, vocab_size=VOCAB, bf16=args.bf16)
    backend = build_backend("cuda")
    backend.init_distributed(timeout_s=120)
    backend.init_model_parallel(1, args.pp, None, seed=7)
    chunks = build_model_chunks(model, parallel, 1, 7, backend.model_construction)
    chunks = backend.wrap_model(chunks, None)
    optimizer = backend.build_optimizer(chunks, OptimizerConfig(lr=1e-3, bf16=args.bf16, clip_grad=1.0))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp = parallel.data_parallel_size
    per_dp = args.microbatches // dp
    dp_rank = parallel_state.get_data_parallel_rank()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    layout = PipelineLayout(pp_size=args.pp, num_chunks=1, num_microbatches=per_dp)
    stage = StageContext(layout=layout, pp_rank=pp_rank,
                         pp_global_ranks=dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
                         activation_shape=(SEQ, MBS, HIDDEN), dtype=dtype, device=backend.device)
    executor = PipelineExecutor(chunks, stage)
    schedule = build_schedule("1f1b", layout, pp_rank)

    def batch(iteration: int, mb: int) -> dict:
        index = iteration * args.microbatches + dp_rank * per_dp + mb
        return {k: v.to(backend.device) for k, v in synthetic_microbatch(index, MBS, SEQ, VOCAB).items()}

    def mcore_forward_step(data_iterator, chunk):
        data = next(data_iterator)
        output = chunk(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"])

        def loss_func(output_tensor):
            loss, _ = microbatch_loss(output_tensor, data)
            # megatron-core divides the returned loss by the microbatch count in place: report a copy
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    batches = {(i, mb): batch(i, mb) for i in range(args.iters) for mb in range(per_dp)}
    losses, norms, seconds = [], [], []
    for iteration in range(args.iters):
        torch.cuda.synchronize()
        started = time.perf_counter()
        backend.zero_grad(chunks)  # what the trainer does
        if args.mode == "mcore":
            optimizer.optimizer.zero_grad()  # the optimizer's own reset as well, as Megatron-LM's loop does
        if args.mode == "ours":
            result = executor.run(schedule, lambda mb: batches[(iteration, mb)])
            iteration_losses = result.losses
        else:
            forward_backward = get_forward_backward_func()
            stored = forward_backward(
                forward_step_func=mcore_forward_step,
                data_iterator=iter([batches[(iteration, mb)] for mb in range(per_dp)]),
                model=chunks, num_microbatches=per_dp, seq_length=SEQ, micro_batch_size=MBS,
                forward_only=False,
            )
            iteration_losses = [float(s["lm loss"]) for s in stored]
        finalize_model_grads(list(chunks))
        updated, norm = optimizer.step()
        assert updated
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        losses.append(iteration_losses)
        norms.append(norm)
    weights = {}
    for chunk in [] if args.skip_weights else chunks:
        inner = unwrap_model(chunk)
        for local, param in inner.named_parameters():
            weights[global_parameter_name(inner, local)] = param.detach().float().cpu().clone()
    torch.save({"losses": losses, "norms": norms, "seconds": seconds, "weights": weights, "pp_rank": pp_rank},
               f"{args.out}/rank{dist.get_rank()}.pt")
    backend.shutdown()


if __name__ == "__main__":
    sys.exit(main())
