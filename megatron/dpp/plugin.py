"""The MegaDPP plugin: `--use-dpp` swaps the static pipeline order for the dynamic executor and
brings its own P2P transport (shm_tensor_rdma by default, or torch.distributed)."""
from __future__ import annotations

import argparse

import torch.distributed as dist

from megatron.app.config import ConfigError
from megatron.app.plugins import Plugin, register_plugin
from megatron.app.schedule import PipelineLayout

from .config import DppConfig, activation_bytes, check_policy, check_transport, parse_budget, parse_quantity
from .order import dpp_executor
from .transport import TorchP2PTransport, make_shm_transport


def _size(text: str) -> int:
    """--workload: bytes, or a size with a K/M/G (KiB/MiB/GiB) suffix."""
    try:
        value, unit_bytes = parse_quantity(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes such as 262144 or 256K, got {text!r}") from None
    return int(value * (unit_bytes or 1))


@register_plugin
class DppPlugin(Plugin):
    name = "dpp"
    flag = "--use-dpp"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("MegaDPP dynamic pipeline")
        g.add_argument("--use-dpp", action="store_true",
                       help="run each rank's pipeline tasks in the order inputs arrive (dynamic schedule)")
        g.add_argument("--dpp-policy", default="adaptive",
                       help="adaptive (default): breadth-first under the memory budget, depth-first at it; "
                            "dfc: depth-first (lowest memory); bfc: breadth-first")
        g.add_argument("--dpp-memory-budget", default=None, metavar="N|SIZE",
                       help="stored activations per rank: a count (e.g. 4) or a size (e.g. 64MB); "
                            "default: 2x static 1F1B's for adaptive, unbounded for dfc/bfc")
        g.add_argument("--dpp-split-backward", action="store_true",
                       help="split each backward into the input gradient (I, sent upstream at once) and the "
                            "weight gradients (W), and run a pending W whenever no forward or I is ready, within "
                            "the memory budget (an activation is held until its W); every W runs before the "
                            "optimizer step")
        g.add_argument("--dpp-transport", default="shm",
                       help="shm: shm_tensor_rdma (shared memory; verbs/TCP across hosts with --multi-node); "
                            "torch: torch.distributed isend/irecv (gloo)")
        g.add_argument("--workload", type=_size, default=256 << 10,
                       help="bytes per transfer-thread chunk of shm_tensor_rdma (e.g. 256K)")
        g.add_argument("--num-gpus", type=int, default=None, help="ranks per node (to place ranks on --node-ips)")
        g.add_argument("--node-ips", nargs="*", default=[], help="one address per node, in node-rank order")
        g.add_argument("--multi-node", action="store_true",
                       help="allow verbs/TCP between hosts (default: shared memory on one host only)")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(args.use_dpp)

    def configure(self, cfg) -> None:
        args = cfg.args
        check_policy(args.dpp_policy)
        device = cfg.training.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        check_transport(args.dpp_transport, device)
        if args.workload <= 0:
            raise ConfigError(f"--workload must be a positive number of bytes, got {args.workload}")
        if args.num_gpus is not None and args.num_gpus < 1:
            raise ConfigError(f"--num-gpus must be >= 1, got {args.num_gpus}")
        if args.node_ips and not args.multi_node:
            raise ConfigError("--node-ips places ranks on several hosts: add --multi-node")
        layout = PipelineLayout(pp_size=cfg.parallel.pipeline_model_parallel_size, num_chunks=cfg.num_chunks,
                                num_microbatches=max(1, cfg.num_microbatches))
        m, p = cfg.model, cfg.parallel
        per_activation = activation_bytes(
            seq_length=m.seq_length, micro_batch_size=cfg.training.micro_batch_size, hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            layers_per_chunk=max(1, max(max(sizes) for sizes in p.layers_per_chunk(m.num_layers))),  # the largest
            element_size=2 if m.bf16 else 4, tensor_parallel=p.tensor_model_parallel_size)
        self.config = DppConfig(
            policy=args.dpp_policy,
            budget=parse_budget(args.dpp_memory_budget, policy=args.dpp_policy, layout=layout,
                                bytes_per_activation=per_activation),
            transport=args.dpp_transport, workload_bytes=args.workload, num_gpus=args.num_gpus,
            node_ips=tuple(args.node_ips), multi_node=args.multi_node)

    def split_backward(self, cfg) -> bool:
        return bool(cfg.args.dpp_split_backward)

    def make_transport(self, ctx):
        c = self.config
        if c.transport == "torch":
            self.transport = TorchP2PTransport()
        else:
            self.transport = make_shm_transport(workload_bytes=c.workload_bytes, multi_node=c.multi_node,
                                                node_ips=c.node_ips, ranks_per_node=c.num_gpus)
        return self.transport

    def make_executor(self, ctx):
        from megatron.core import parallel_state

        tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
        return dpp_executor(ctx.chunks, ctx.stage, ctx.transport, policy=self.config.policy,
                            budget=self.config.budget, tp_ranks=tp_ranks, loss=ctx.loss,
                            measure_memory=ctx.cfg.training.report_activation_memory)

    def setup(self, ctx) -> None:
        budget = self.config.budget
        if ctx.rank == 0:
            print(f"[dpp] policy {self.config.policy}"
                  f"{', split backward (W fills idle time)' if ctx.layout.split_backward else ''}, memory budget "
                  f"{budget if budget is not None else 'unbounded'} activations per rank, "
                  f"transport {ctx.executor.transport.name}", flush=True)

    def shutdown(self, ctx) -> None:
        peak = getattr(ctx.executor, "peak_stored_activations", None) if ctx is not None else None
        if peak is not None:
            print(f"[dpp] rank {ctx.rank}: peak stored activations {peak}", flush=True)
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()

