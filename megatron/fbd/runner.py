"""The disaggregated training step: a forward instance runs every microbatch without keeping
activations; its backward instance recomputes from the received stage input and RNG state,
runs backward, syncs gradients, steps the optimizer and sends the new weights back."""
from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING, Any

import torch

from megatron.app.actions import message_tag
from megatron.app.executor import StageContext, activation_shape, microbatch_loss
from megatron.app.model import unwrap_model
from megatron.app.observer import span
from megatron.app.schedule import PipelineLayout
from megatron.app.train import learning_rate, set_learning_rate, sync_grads_and_step
from megatron.app.transport import Message, TorchDistributedTransport
from megatron.fbd.layout import FBDLayout, Instance

if TYPE_CHECKING:
    from megatron.fbd.coordinator import CommunicationCoordinator
    from megatron.fbd.threads import ForwardHost

# What each message carries, as the pipeline IR's one tag function names it: an activation between
# forward instances, a stage input and an RNG state from a forward instance to its backward
# instance, a gradient between backward instances, weights from a backward instance.
_ACTIVATION, _STAGE_INPUT, _RNG, _GRAD, _WEIGHTS = "F", "S", "R", "B", "W"


# --- RNG state: what a forward pass draws from, packed into one byte tensor ----------------------
def _tracker_states() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import random as mc_random

    tracker = mc_random.get_cuda_rng_tracker()
    return tracker.get_states() if getattr(tracker, "is_initialized", lambda: False)() else {}


def rng_snapshot() -> torch.Tensor:
    """CPU generator state, the CUDA one when present, and every RNG tracker stream, as uint8."""
    parts = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(torch.cuda.get_rng_state())
    states = _tracker_states()
    parts += [states[name].cpu() for name in sorted(states)]
    return torch.cat([p.view(torch.uint8).flatten() for p in parts])


def rng_restore(packed: torch.Tensor) -> None:
    """Inverse of rng_snapshot on a process with the same generators."""
    from megatron.core.tensor_parallel import random as mc_random

    offset = 0

    def take(like: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        part = packed[offset: offset + like.numel()].clone()
        offset += like.numel()
        return part

    torch.set_rng_state(take(torch.get_rng_state()))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(take(torch.cuda.get_rng_state()))
    states = _tracker_states()
    if states:
        mc_random.get_cuda_rng_tracker().set_states({name: take(states[name]) for name in sorted(states)})
    if offset != packed.numel():
        raise RuntimeError(f"RNG state of {packed.numel()} bytes does not match this process's {offset}")


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


class _StepBase:
    schedule_name = SCHEDULE_NAME

    def __init__(self, ctx, layout: FBDLayout, me: Instance, chunk: torch.nn.Module | None = None,
                 data=None) -> None:
        self.ctx, self.layout, self.me = ctx, layout, me
        self.data = ctx.data if data is None else data  # this instance's replica's microbatches
        # Model chunks of this stage: one, or one per virtual pipeline stage (chunk c is virtual
        # stage c x pp + stage); a forward host's thread passes its own single chunk.
        self.chunks = list(ctx.chunks) if chunk is None else [chunk]
        self.chunk = self.chunks[0]
        self.num_virtual = len(self.chunks) * layout.pp
        self.transport = ctx.transport or TorchDistributedTransport()
        cfg = ctx.cfg
        self.num_microbatches = cfg.num_microbatches
        self.device = ctx.backend.device
        # The spine's activation spec (shape, dtype, device), as every pipeline engine uses it.
        self.spec = StageContext(layout=PipelineLayout(layout.pp, len(self.chunks), cfg.num_microbatches),
                                 pp_rank=me.stage, pp_global_ranks=[],
                                 activation_shape=activation_shape(cfg), dtype=cfg.model.params_dtype,
                                 device=self.device)
        self.is_last = me.stage == layout.pp - 1
        self.pending: list = []

    def _send(self, peer: int, tag: int, tensor: torch.Tensor, **attrs: Any) -> None:
        with span("send", peer=peer, bytes=tensor.numel() * tensor.element_size(), **attrs):
            self.pending += self.transport.post([Message(peer, tag, tensor)], [])

    def _recv(self, peer: int, tag: int, buffer: torch.Tensor, **attrs: Any) -> torch.Tensor:
        handle = self.transport.post([], [Message(peer, tag, buffer)])[0]
        with span("recv", peer=peer, bytes=buffer.numel() * buffer.element_size(), **attrs):
            handle.wait()
        return buffer

    def _activation(self) -> torch.Tensor:
        return self.spec.empty_activation()

    def _forward(self, batch: dict, stage_input: torch.Tensor | None, chunk: int = 0) -> torch.Tensor:
        model = self.chunks[chunk]
        unwrap_model(model).set_input_tensor(stage_input)
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                     labels=batch["labels"] if self._is_last_virtual(chunk) else None)

    # --- virtual pipeline: chunk c of stage s is virtual stage c x pp + s --------------------------
    def _virtual(self, chunk: int) -> int:
        return chunk * self.layout.pp + self.me.stage

    def _is_last_virtual(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.num_virtual - 1

    def _neighbour(self, chunk: int, step: int) -> tuple[int, int] | None:
        """(stage, chunk) of virtual stage `virtual(chunk) + step` (step +-1), None past either end."""
        v = self._virtual(chunk) + step
        if not 0 <= v < self.num_virtual:
            return None
        return v % self.layout.pp, v // self.layout.pp

    def _tag(self, payload: str, microbatch: int, chunk: int, stage: int | None = None) -> int:
        """The tag of a message for `chunk` of `stage` (this stage by default) on `microbatch`."""
        stage = self.me.stage if stage is None else stage
        return message_tag(payload, chunk * self.layout.pp + stage, microbatch, self.num_microbatches)

    def _weights_tag(self) -> int:
        return message_tag(_WEIGHTS, 0, 0, self.num_microbatches)

    def _log_losses(self, iteration: int, losses: list[float]) -> None:
        """With --fbd-loss-log DIR, the last stage of each role appends every microbatch's loss
        (repr: exact) to DIR/{role}-replica{r}.jsonl, so the forward instance's loss can be compared
        with the backward instance's recomputation."""
        directory = getattr(self.ctx.cfg.args, "fbd_loss_log", None)
        if not directory or not self.is_last or self.me.tp_rank != 0:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.me.role}-replica{self.me.replica}.jsonl")
        with open(path, "a") as f:
            for mb, loss in enumerate(losses):
                f.write(json.dumps({"iteration": iteration, "microbatch": mb, "loss": repr(loss)}) + "\n")

    def _finish(self) -> None:
        for handle in self.pending:
            handle.wait()
        self.pending.clear()


class ForwardStep(_StepBase):
    """One iteration of a forward instance: fresh weights in, stage inputs and RNG states out.
    With a `host` (several forward instances as threads of one process), weights arrive through
    its communication coordinator, the hand-off to the next stage stays in the process, and the
    RNG snapshot, the forward and the data fetch hold the host's lock (one shared generator)."""

    def __init__(self, ctx, layout: FBDLayout, me: Instance, chunk: torch.nn.Module | None = None,
                 host: ForwardHost | None = None, data=None) -> None:
        super().__init__(ctx, layout, me, chunk, data)
        self.host = host

    def __call__(self, ctx, plugins) -> dict[str, Any]:
        iteration, me, host = ctx.iteration, self.me, self.host
        backward_ranks = self.layout.partners(me)
        if host is None:
            self._receive_weights(backward_ranks)
        else:
            host.receive_weights(self)
        for model in self.chunks:
            model.train()  # training-mode dropout, drawn from the RNG state sent along
        compute = host.lock if host is not None else contextlib.nullcontext()
        losses, tokens = [], 0
        # Chunk by chunk, every microbatch: virtual stage v waits only on v - 1, which its rank
        # has finished (or will, in the same order), so the all-forward order cannot deadlock.
        for c in range(len(self.chunks)):
            previous, following = self._neighbour(c, -1), self._neighbour(c, +1)
            for mb in range(self.num_microbatches):
                stage_input = None
                if previous is not None:
                    if host is not None:
                        stage_input = host.take_activation(me, mb)
                    else:
                        peer = self.layout.forward_of(me.replica, previous[0], me.tp_rank)
                        stage_input = self._recv(peer, self._tag(_ACTIVATION, mb, c), self._activation(),
                                                 chunk=c, microbatch=mb, direction="F")
                with compute:
                    batch = self.data.train_microbatch(iteration, mb)
                    rng = rng_snapshot()
                    with span("forward", chunk=c, microbatch=mb), torch.no_grad():
                        output = self._forward(batch, stage_input, c)
                        if following is None:
                            loss, count = microbatch_loss(output, batch)
                            losses.append(float(loss))
                            tokens += count
                if following is not None:
                    if host is not None:
                        host.put_activation(me, mb, output)
                    else:
                        peer = self.layout.forward_of(me.replica, following[0], me.tp_rank)
                        self._send(peer, self._tag(_ACTIVATION, mb, following[1], following[0]), output,
                                   chunk=c, microbatch=mb, direction="F")
                for rank in backward_ranks:
                    self._send(rank, self._tag(_RNG, mb, c), rng, chunk=c, microbatch=mb)
                    if stage_input is not None:
                        self._send(rank, self._tag(_STAGE_INPUT, mb, c), stage_input, chunk=c, microbatch=mb,
                                   direction="F")
        self._finish()
        self._log_losses(iteration, losses)
        return {"lm loss": sum(losses) / len(losses) if losses else None, "grad norm": 0.0,
                "learning rate": _learning_rate(ctx), "updated": True, "num_tokens": tokens}

    def weight_numel(self, tp_size: int = 1) -> int:
        return sum(s.numel() for model in self.chunks for s in shard_shapes(model, tp_size))

    def _receive_weights(self, backward_ranks: list[int]) -> None:
        numel = self.weight_numel(len(backward_ranks))
        dtype = next(self.chunk.parameters()).dtype
        buffers = [torch.empty(numel, dtype=dtype, device=self.device) for _ in backward_ranks]
        handles = self.transport.post([], [Message(r, self._weights_tag(), b) for r, b in zip(backward_ranks, buffers)])
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


class BackwardStep(_StepBase):
    """One iteration of a backward instance: weights out, recompute + backward per microbatch,
    gradient sync and optimizer step. With a `coordinator` (its forward instance is a thread of a
    forward host), the weights go out as that coordinator's collective `weight_group`."""

    def __init__(self, ctx, layout: FBDLayout, me: Instance, coordinator: CommunicationCoordinator | None = None,
                 weight_group: int = -1) -> None:
        super().__init__(ctx, layout, me)
        self.coordinator, self.weight_group = coordinator, weight_group

    def __call__(self, ctx, plugins) -> dict[str, Any]:
        iteration, backend, me = ctx.iteration, ctx.backend, self.me
        lr = set_learning_rate(ctx)
        (forward_rank,) = self.layout.partners(me.rank)
        # The forward instance runs this iteration with exactly the weights we hold now.
        if self.coordinator is None:
            self._send(forward_rank, self._weights_tag(), _flat_weights(self.chunks))
        else:
            with span("send", peer=forward_rank, payload="weights"):  # forward side adds zeros: a copy
                self.coordinator.all_reduce(self.weight_group, 0,
                                            weight_contribution(self.layout, me.tp_rank, _flat_weights(self.chunks)))
        backend.zero_grad(ctx.chunks)
        for model in self.chunks:
            model.train()
        rng_buffer = rng_snapshot()
        losses, tokens = [], 0
        # Chunks in reverse, every microbatch: virtual stage v's gradient comes from v + 1, which
        # its rank has finished already (the same order there), so this cannot deadlock either.
        for c in reversed(range(len(self.chunks))):
            previous, following = self._neighbour(c, -1), self._neighbour(c, +1)
            for mb in range(self.num_microbatches):
                batch = self.data.train_microbatch(iteration, mb)
                stage_input = None
                if previous is not None:
                    stage_input = self._recv(forward_rank, self._tag(_STAGE_INPUT, mb, c), self._activation(),
                                             chunk=c, microbatch=mb, direction="F")
                    stage_input.requires_grad_(True)
                rng_restore(self._recv(forward_rank, self._tag(_RNG, mb, c), torch.empty_like(rng_buffer),
                                       chunk=c, microbatch=mb))
                with span("forward", chunk=c, microbatch=mb):  # recomputation
                    output = self._forward(batch, stage_input, c)
                    if following is None:
                        loss, count = microbatch_loss(output, batch)
                        losses.append(float(loss.detach()))
                        tokens += count
                        output = loss / self.num_microbatches
                grad_output = None
                if following is not None:
                    peer = self.layout.backward_of(me.replica, following[0], me.tp_rank)
                    grad_output = self._recv(peer, self._tag(_GRAD, mb, c), self._activation(), chunk=c,
                                             microbatch=mb, direction="B")
                with span("backward", chunk=c, microbatch=mb):
                    torch.autograd.backward(output, grad_tensors=grad_output)
                if previous is not None:
                    peer = self.layout.backward_of(me.replica, previous[0], me.tp_rank)
                    self._send(peer, self._tag(_GRAD, mb, previous[1], previous[0]), stage_input.grad,
                               chunk=c, microbatch=mb, direction="B")
        updated, grad_norm = sync_grads_and_step(ctx, plugins, iteration)
        self._finish()
        self._log_losses(iteration, losses)
        return {"lm loss": sum(losses) / len(losses) if losses else None, "grad norm": grad_norm,
                "learning rate": lr, "updated": updated, "num_tokens": tokens}


def _learning_rate(ctx) -> float:
    return learning_rate(ctx.cfg, ctx.iteration)
