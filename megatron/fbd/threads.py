"""Several forward instances in one process, one thread each (`--forward-instances-per-process`).

A forward host is one process running the forward instances of all pipeline stages of k replicas
as threads (forward TP=1: plain, or merged with --ignore-forward-tensor-parallel). Collectives a
thread takes part in (each iteration's weight hand-off from its backward instance(s)) go through the `CommunicationCoordinator`: the thread sets its bit in the group's
bit-vector, the coordinators of all processes OR-all-reduce the table on their own process group,
and a complete group's collective runs, ready groups in ascending order, so threads never take a
communicator another thread is waiting in. Stage-to-stage activations stay in the process.
The CPU generator and the RNG tracker are process-wide, so a thread holds the host's lock from its
RNG snapshot to the end of its forward; the backward instance restores exactly that snapshot.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist

from megatron.app.model import build_model_chunks
from megatron.fbd.coordinator import CommunicationCoordinator
from megatron.fbd.layout import FBDLayout, Instance
from megatron.app.transport import Message, TorchDistributedTransport
from megatron.fbd.runner import SCHEDULE_NAME, ForwardStep, load_chunk_weights

# The host waits at most this long for one iteration of its threads (a peer failing is reported
# by the coordinator or the transport well before).
_THREAD_TIMEOUT_S = 600.0


class _StageView:
    """What megatron-core asks of a pipeline group while building and running a chunk (its rank
    and size), for a stage hosted as a thread: every stage of the pipeline lives in this process."""

    def __init__(self, stage: int, size: int) -> None:
        self._stage, self._size = stage, size

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._size


def weight_group(layout: FBDLayout, replica: int, stage: int) -> int:
    """Coordinator group id of the weight hand-off of (replica, stage)."""
    return replica * layout.pp + stage


def coordinator_groups(layout: FBDLayout) -> list[list[tuple[int, int]]]:
    """Group g = weight_group(r, s): the backward instance(s) of (r, s) (one per TP rank, each its
    process's only thread, slot 0) and the forward thread of (r, s) in its host."""
    groups = []
    for replica in range(layout.replicas):
        for stage in range(layout.pp):
            groups.append([*((layout.backward_of(replica, stage, t), 0) for t in range(layout.tp)),
                           (layout.forward_of(replica, stage, 0), layout.forward_slot(replica, stage))])
    return groups


def make_coordinator(layout: FBDLayout) -> CommunicationCoordinator:
    """Collective over the world: the coordinator's rounds get their own process group, so they
    never interleave with the trainer's collectives on the default group."""
    rounds = dist.new_group(list(range(layout.world_size)))
    return CommunicationCoordinator(coordinator_groups(layout), process_group=rounds, idle_sleep_s=2e-3)


class ForwardHost:
    """Step runner of a forward host: one ForwardStep per hosted instance (stage of a replica), each
    iteration run as threads; each replica's threads read that replica's data."""

    schedule_name = SCHEDULE_NAME

    def __init__(self, ctx, layout: FBDLayout, coordinator: CommunicationCoordinator) -> None:
        self.ctx, self.layout, self.coordinator = ctx, layout, coordinator
        self.lock = threading.Lock()
        instances = layout.hosted(ctx.rank)
        chunks = [ctx.chunks[0]] + [self._build_chunk(i.stage) for i in instances[1:]]
        data = {r: dataclasses.replace(ctx.data, dp_rank=r, _cache={}) for r in sorted({i.replica for i in instances})}
        # (replica, tag) -> the activation one stage's thread hands to the next, in the process.
        self.mailbox: dict[tuple[int, int], queue.Queue] = {}
        self.mailbox_lock = threading.Lock()
        self.inner = ctx.transport or TorchDistributedTransport()
        self.steps = [ForwardStep(ctx, layout, i, chunk, host=self, data=data[i.replica])
                      for i, chunk in zip(instances, chunks)]

    def _build_chunk(self, stage: int) -> torch.nn.Module:
        """The model chunk of another stage, through the trainer's model builder. megatron-core reads
        the stage from the pipeline group it is given (`group.rank()`: layer offset, first/last
        stage), so the chunk gets a `_StageView` of this host's pipeline, and no embedding group:
        its tied output weight is overwritten by the backward instance's weights before the first
        forward anyway."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        cfg = self.ctx.cfg
        groups = ProcessGroupCollection.use_mpu_process_groups()
        groups.pp, groups.embd = _StageView(stage, self.layout.pp), None
        (chunk,) = build_model_chunks(cfg.model, cfg.parallel, 1, cfg.training.seed,
                                      self.ctx.backend.model_construction, pg_collection=groups)
        return chunk.to(self.ctx.backend.device)

    # --- called by the ForwardStep threads ---------------------------------------------------
    def receive_weights(self, step: ForwardStep) -> None:
        me, tp = step.me, self.layout.tp
        shard = step.weight_numel(tp)
        zeros = torch.zeros(tp * shard, dtype=next(step.chunk.parameters()).dtype)
        flat = self.coordinator.all_reduce(weight_group(self.layout, me.replica, me.stage), me.slot, zeros)
        load_chunk_weights(step.chunks, list(flat.to(step.device).split(shard)), tp)

    def transport(self, me: Instance) -> "_ThreadTransport":
        """The transport of `me`'s executor: messages to this process's rank stay in the process."""
        return _ThreadTransport(self, me.replica, dist.get_rank())

    def _queue(self, replica: int, tag: int) -> queue.Queue:
        with self.mailbox_lock:
            return self.mailbox.setdefault((replica, tag), queue.Queue())

    # --- one iteration ------------------------------------------------------------------------
    def __call__(self, ctx, plugins) -> dict[str, Any]:
        results: list[dict[str, Any] | None] = [None] * len(self.steps)
        errors: list[BaseException] = []

        def run(index: int) -> None:
            try:
                results[index] = self.steps[index](ctx, plugins)
            except BaseException as exc:  # reported by the host thread below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), name=f"fbd-forward-r{s.me.replica}-s{s.me.stage}")
                   for i, s in enumerate(self.steps)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_THREAD_TIMEOUT_S)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"a forward thread did not finish iteration {ctx.iteration}")
        last = results[-1]
        return {**last, "num_tokens": sum(r["num_tokens"] for r in results)}

    def close(self) -> None:
        self.coordinator.close(timeout=60)


class _LocalSend:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _LocalReceive:
    def __init__(self, box: queue.Queue, buffer: torch.Tensor) -> None:
        self.box, self.buffer, self.done = box, buffer, False

    def wait(self) -> None:
        if not self.done:
            self.buffer.copy_(self.box.get(timeout=_THREAD_TIMEOUT_S))
            self.done = True

    def is_completed(self) -> bool:
        return self.done or not self.box.empty()


class _ThreadTransport:
    """A hosted forward instance's transport: a message to or from this process's own rank (the
    activation between two stages of one replica, both threads here) goes through the host's
    mailbox, keyed by replica and tag; the others (stage inputs and RNG states to the backward
    instances) over the job's transport."""

    name = "threads"

    def __init__(self, host: ForwardHost, replica: int, rank: int) -> None:
        self.host, self.replica, self.rank = host, replica, rank

    def post(self, sends: list[Message], recvs: list[Message]) -> list:
        remote_sends = [m for m in sends if m.peer != self.rank]
        remote_recvs = [m for m in recvs if m.peer != self.rank]
        remote = iter(self.host.inner.post(remote_sends, remote_recvs) if remote_sends or remote_recvs else [])
        handles = []
        for message in sends:
            if message.peer == self.rank:
                self.host._queue(self.replica, message.tag).put(message.tensor)
                handles.append(_LocalSend())
            else:
                handles.append(next(remote))
        for message in recvs:
            if message.peer == self.rank:
                handles.append(_LocalReceive(self.host._queue(self.replica, message.tag), message.tensor))
            else:
                handles.append(next(remote))
        return handles

    def close(self) -> None:
        return None
