"""The disaggregated training step: a forward instance runs every microbatch without keeping
activations; its backward instance recomputes from the received stage input and RNG state,
runs backward, syncs gradients, steps the optimizer and sends the new weights back. Both roles
are action lists (megatron.fbd.roles) run by the spine's one executor; this module supplies what
is particular to them: the weight hand-off and the step runners."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from megatron.app.actions import Action, Op, message_tag
from megatron.app.executor import ActionList, IterationSteps, PipelineExecutor, StageContext, activation_shape
from megatron.app.model import unwrap_model
from megatron.app.observer import span
from megatron.app.rng import rng_snapshot
from megatron.app.schedule import PipelineLayout
from megatron.app.learning_rate import learning_rate, set_learning_rate
from megatron.app.train import optimizer_step, reduce_grads
from megatron.app.transport import Message, TorchDistributedTransport
from megatron.fbd.layout import FBDLayout, Instance
from megatron.fbd.roles import backward_role, forward_role

if TYPE_CHECKING:
    from megatron.fbd.coordinator import CommunicationCoordinator


# --- weights ----------------------------------------------------------------------------------
def shard_shapes(chunk: torch.nn.Module, tp_size: int) -> list[torch.Size]:
    """Shapes of one backward TP rank's parameters, from a full (TP=1) forward chunk."""
    shapes = []
    for param in chunk.parameters():
        shape = list(param.shape)
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            if shape[dim] % tp_size:
                raise RuntimeError(f"parameter of shape {tuple(param.shape)} cannot be split {tp_size} ways on dim {dim}")
            shape[dim] //= tp_size
        shapes.append(torch.Size(shape))
    return shapes


@torch.no_grad()
def load_weights(chunk: torch.nn.Module, flats: list[torch.Tensor], tp_size: int) -> None:
    """Copy the flat weight buffers of `tp_size` backward TP ranks into a forward chunk:
    TP-partitioned parameters are concatenated along their partition dim, others taken from rank 0."""
    shapes = shard_shapes(chunk, tp_size)
    per_rank = []
    for flat in flats:
        pieces, offset = [], 0
        for shape in shapes:
            pieces.append(flat[offset: offset + shape.numel()].view(shape))
            offset += shape.numel()
        per_rank.append(pieces)
    for index, param in enumerate(chunk.parameters()):
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            param.copy_(torch.cat([pieces[index] for pieces in per_rank], dim=param.partition_dim))
        else:
            param.copy_(per_rank[0][index])


def weight_contribution(layout: FBDLayout, tp_rank: int, flat: torch.Tensor) -> torch.Tensor:
    """A backward instance's part of the weight hand-off all-reduce: its flat weights at its TP
    rank's offset in a buffer of tp x its size (zeros elsewhere), so the sum over the group is
    every TP shard side by side, as a merged forward instance loads them."""
    if layout.tp == 1:
        return flat
    buffer = torch.zeros(layout.tp * flat.numel(), dtype=flat.dtype, device=flat.device)
    buffer[tp_rank * flat.numel(): (tp_rank + 1) * flat.numel()] = flat
    return buffer


def _flat_weights(chunks: list[torch.nn.Module]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for chunk in chunks for p in chunk.parameters()])


SCHEDULE_NAME = "forward-backward disaggregated (forward instances without activations, backward recomputes)"


class _Role:
    """One instance's step runner: its action list on an executor over its model chunks (one, or
    one per virtual pipeline stage: chunk c of stage s is virtual stage c x pp + s; a forward
    host's thread passes its own single chunk). Peers in the lists are global ranks."""

    schedule_name = SCHEDULE_NAME

    def __init__(self, ctx, layout: FBDLayout, me: Instance, chunk: torch.nn.Module | None = None,
                 data=None, transport=None, **executor_options) -> None:
        """`executor_options`: what the role adds to the executor (PipelineExecutor's keyword
        arguments: `hand_off`, `compute_guard`)."""
        self.ctx, self.layout, self.me = ctx, layout, me
        self.data = ctx.data if data is None else data  # this instance's replica's microbatches
        self.chunks = list(ctx.chunks) if chunk is None else [chunk]
        self.chunk = self.chunks[0]
        self.device = ctx.backend.device
        cfg = ctx.cfg
        self.num_microbatches = cfg.num_microbatches
        self.is_last = me.stage == layout.pp - 1
        stage = StageContext(layout=PipelineLayout(layout.pp, len(self.chunks), cfg.num_microbatches),
                             pp_rank=me.stage, pp_global_ranks=list(range(layout.world_size)),
                             activation_shape=activation_shape(cfg), dtype=cfg.model.params_dtype, device=self.device)
        self.actions = self.role_actions()
        self.rng_bytes = rng_snapshot().numel()  # the generators (and tracker streams) exist by now
        self.executor = PipelineExecutor(
            self.chunks, stage, transport or ctx.transport or TorchDistributedTransport(),
            order=ActionList(self.actions, SCHEDULE_NAME), loss=ctx.loss, handlers={Op.WEIGHTS: self._weights},
            buffers={"R": lambda: torch.empty(self.rng_bytes, dtype=torch.uint8)}, **executor_options)

    def role_actions(self) -> list[Action]:
        raise NotImplementedError

    def _weights(self, action: Action, get_microbatch) -> None:
        raise NotImplementedError

    def _weights_tag(self) -> int:
        return message_tag("W", 0, 0, self.num_microbatches)

    def _log_losses(self, iteration: int, losses: list[float]) -> None:
        """With --fbd-loss-log DIR, the last stage of each role appends every microbatch's loss
        (repr: exact) to DIR/{role}-replica{r}.jsonl, so the forward instance's loss can be compared
        with the backward instance's recomputation."""
        directory = self.ctx.cfg.args.fbd_loss_log
        if not directory or not self.is_last or self.me.tp_rank != 0:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.me.role}-replica{self.me.replica}.jsonl")
        with open(path, "a") as f:
            for mb, loss in enumerate(losses):
                f.write(json.dumps({"iteration": iteration, "microbatch": mb, "loss": repr(loss)}) + "\n")


class ForwardStep(_Role):
    """One iteration of a forward instance: fresh weights in, stage inputs and RNG states out.
    With a `host` (several forward instances as threads of one process), weights arrive through
    its communication coordinator, the activations between its stages stay in the process (the
    host's transport), and the RNG snapshot with the forward, and the data fetch, hold the host's
    lock (one shared generator)."""

    def __init__(self, ctx, layout: FBDLayout, me: Instance, chunk: torch.nn.Module | None = None,
                 host=None, data=None) -> None:
        self.host = host
        super().__init__(ctx, layout, me, chunk, data, transport=host.transport(me) if host is not None else None,
                         hand_off=True, **({"compute_guard": lambda: host.lock} if host is not None else {}))

    def role_actions(self) -> list[Action]:
        return forward_role(self.layout, self.me, len(self.chunks), self.num_microbatches)

    def __call__(self, ctx, plugins) -> dict[str, Any]:
        iteration, host = ctx.iteration, self.host
        for model in self.chunks:
            model.train()  # training-mode dropout, drawn from the RNG state sent along

        def microbatch(mb: int):
            if host is None:
                return self.data.train_microbatch(iteration, mb)
            with host.lock:
                return self.data.train_microbatch(iteration, mb)

        result = self.executor.run([], microbatch, forward_only=True)
        self._log_losses(iteration, result.losses)
        return {"lm loss": result.mean_loss, "grad norm": 0.0, "learning rate": learning_rate(ctx.cfg, iteration),
                "updated": True, "num_tokens": result.num_tokens}

    def weight_numel(self, tp_size: int = 1) -> int:
        return sum(s.numel() for model in self.chunks for s in shard_shapes(model, tp_size))

    def _weights(self, action: Action, get_microbatch) -> None:
        """The WEIGHTS action of a forward instance: the backward instances' weights in, loaded."""
        if self.host is not None:
            self.host.receive_weights(self)
            return
        backward_ranks = self.layout.partners(self.me)
        numel = self.weight_numel(len(backward_ranks))
        dtype = next(self.chunk.parameters()).dtype
        buffers = [torch.empty(numel, dtype=dtype, device=self.device) for _ in backward_ranks]
        tag = self._weights_tag()
        handles = self.executor.transport.post([], [Message(r, tag, b) for r, b in zip(backward_ranks, buffers)])
        with span("recv", peer=backward_ranks[0], bytes=numel * buffers[0].element_size() * len(buffers)):
            for handle in handles:
                handle.wait()
        with span("load_weights"):
            load_chunk_weights(self.chunks, buffers, len(backward_ranks))


def load_chunk_weights(chunks: list[torch.nn.Module], flats: list[torch.Tensor], tp_size: int) -> None:
    """Each backward TP rank's flat weights hold its chunks one after the other: split them per
    chunk and load each chunk's TP shards (load_weights)."""
    sizes = [sum(s.numel() for s in shard_shapes(model, tp_size)) for model in chunks]
    per_chunk = zip(*(flat.split(sizes) for flat in flats))
    for model, pieces in zip(chunks, per_chunk):
        load_weights(unwrap_model(model), list(pieces), tp_size)


class BackwardStep(_Role):
    """One iteration of a backward instance: weights out, recompute + backward per microbatch,
    gradient sync and optimizer step. With a `coordinator` (its forward instance is a thread of a
    forward host), the weights go out as that coordinator's collective `weight_group`."""

    def __init__(self, ctx, layout: FBDLayout, me: Instance, coordinator: CommunicationCoordinator | None = None,
                 weight_group: int = -1) -> None:
        self.coordinator, self.weight_group = coordinator, weight_group
        super().__init__(ctx, layout, me)

    def role_actions(self) -> list[Action]:
        return backward_role(self.layout, self.me, len(self.chunks), self.num_microbatches)

    def __call__(self, ctx, plugins) -> dict[str, Any]:
        iteration = ctx.iteration
        lr = set_learning_rate(ctx)
        ctx.backend.zero_grad(ctx.chunks)
        for model in self.chunks:
            model.train()
        steps = IterationSteps(reduce_grads=lambda result: reduce_grads(ctx, iteration),
                               optimizer_step=lambda result: optimizer_step(ctx, plugins, iteration))
        result = self.executor.run([], lambda mb: self.data.train_microbatch(iteration, mb), steps=steps)
        self._log_losses(iteration, result.losses)
        return {"lm loss": result.mean_loss, "grad norm": result.grad_norm, "learning rate": lr,
                "updated": result.updated, "num_tokens": result.num_tokens}

    def _weights(self, action: Action, get_microbatch) -> None:
        """The WEIGHTS action of a backward instance: the forward instance runs this iteration with
        exactly the weights held now."""
        (forward_rank,) = self.layout.partners(self.me.rank)
        flat = _flat_weights(self.chunks)
        if self.coordinator is None:
            with span("send", peer=forward_rank, bytes=flat.numel() * flat.element_size()):
                self.executor.defer(self.executor.transport.post([Message(forward_rank, self._weights_tag(), flat)], []))
        else:
            with span("send", peer=forward_rank, payload="weights"):  # forward side adds zeros: a copy
                self.coordinator.all_reduce(self.weight_group, 0, weight_contribution(self.layout, self.me.tp_rank, flat))
