"""The dynamic pipeline executor: every receive of an iteration is posted asynchronously, and at
each step the rank runs the policy's highest-priority task whose input has arrived. Forward and
backward steps, sends and trace spans are the static executor's own (subclass)."""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.app.executor import IterationResult, Microbatch, PipelineExecutor, StageContext
from megatron.app.schedule import Task, TaskKind, format_schedule
from megatron.app.simulator import RankState
from megatron.app.transport import Message, Transport, message_tag

from .policy import DppPolicy

logger = logging.getLogger(__name__)

_KINDS = (TaskKind.FORWARD, TaskKind.BACKWARD)


class DynamicPipelineExecutor(PipelineExecutor):
    """Runs one iteration's tasks in the order the policy picks as inputs arrive.

    With tensor parallelism the first rank of the TP group (the leader) decides and sends each
    decision to the other TP ranks of its stage as a 3-integer P2P message; they run exactly the
    leader's order, so the TP collectives inside each task line up. The `tasks` argument of run()
    only fixes which kinds run (forward_only drops backwards): the order is the policy's.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], stage: StageContext, transport: Transport, *,
                 policy: str, budget: int | None, tp_ranks: Sequence[int] = (), idle_timeout_s: float = 1e-3) -> None:
        super().__init__(chunks, stage, transport)
        self.policy_name = policy
        self.budget = budget
        DppPolicy(policy, stage.layout, budget)  # validates name and budget now, not in iteration 1
        me = dist.get_rank() if dist.is_initialized() else 0
        self.tp_ranks = list(tp_ranks) or [me]
        self.is_leader = self.tp_ranks[0] == me
        self.followers = [rank for rank in self.tp_ranks if rank != me] if self.is_leader else []
        self.idle_timeout_s = idle_timeout_s
        self.last_order: list[Task] = []  # the order of the last iteration, for tests and logs
        self.peak_stored_activations = 0  # over every iteration run so far

    @property
    def schedule_name(self) -> str:
        """What the trainer's start-up line prints as the schedule."""
        return f"dpp-{self.policy_name} (budget {self.budget if self.budget is not None else 'none'})"

    # --- public -----------------------------------------------------------------------
    def run(self, tasks: Sequence[Task], get_microbatch: Callable[[int], Microbatch],
            forward_only: bool = False) -> IterationResult:
        layout, pp_rank = self.stage.layout, self.stage.pp_rank
        work = [task for task in layout.tasks() if task.is_forward or not forward_only]
        self._result = IterationResult()
        self._stored = {}
        self._inbox = {}  # arrived inputs, consumed by the static executor's handlers
        self._outbox = {}
        self._pending_sends = []
        self._forward_only = forward_only
        self._waiting: dict[Task, tuple[torch.Tensor, object, dict]] = {}  # posted, not arrived yet
        self._arrived: set[Task] = set()
        state = RankState(rank=pp_rank, layout=layout, remaining=set(work))
        # Forward-only runs store nothing, so no budget applies.
        everything = layout.num_chunks * layout.num_microbatches
        policy = DppPolicy(self.policy_name, layout, everything if forward_only else self.budget)
        self.last_order = state.executed
        try:
            for task in work:
                if task.is_forward:
                    self._expect(task)
            step = 0
            while state.remaining:
                choice = self._decide(step, state, policy)
                if choice is None:
                    self._idle()
                    continue
                self._start(choice, state)
                self.handlers[choice.kind](choice, get_microbatch, forward_only)
                self._finish(choice, state)
                step += 1
            for handle in self._pending_sends:
                handle.wait()
        except Exception:
            logger.error("rank %d (pp rank %d, dpp policy %s) failed; ran: %s; still to run: %s",
                         dist.get_rank() if dist.is_initialized() else 0, pp_rank, self.policy_name,
                         format_schedule(state.executed), format_schedule(sorted(state.remaining)))
            raise
        finally:
            self._stored.clear()
            self._inbox.clear()
            self._outbox.clear()
            self._waiting.clear()
        self.peak_stored_activations = max(self.peak_stored_activations, state.peak_stored_activations)
        return self._result

    # --- choosing -----------------------------------------------------------------------
    def _decide(self, step: int, state: RankState, policy: DppPolicy) -> Task | None:
        if not self.is_leader:
            return self._decision_from_leader(step)
        self._collect_arrivals()
        ready = sorted(task for task in self._arrived
                       if task.is_forward or Task(TaskKind.FORWARD, task.chunk, task.microbatch) in state.completed)
        choice = policy.choose(state, ready)
        if choice is not None and self.followers:
            code = torch.tensor([_KINDS.index(choice.kind), choice.chunk, choice.microbatch], dtype=torch.int64)
            sends = [Message(peer, self._decision_tag(step), code) for peer in self.followers]
            self._pending_sends.extend(self.transport.post(sends, []))
        return choice

    def _decision_from_leader(self, step: int) -> Task:
        code = torch.empty(3, dtype=torch.int64)
        handle = self.transport.post([], [Message(self.tp_ranks[0], self._decision_tag(step), code)])[-1]
        handle.wait()
        kind, chunk, microbatch = (int(value) for value in code)
        return Task(_KINDS[kind], chunk, microbatch)

    def _decision_tag(self, step: int) -> int:
        # Above every activation/gradient tag of the iteration, one tag per step.
        layout = self.stage.layout
        return 2 * layout.num_virtual_stages * layout.num_microbatches + step

    # --- bookkeeping --------------------------------------------------------------------
    def _start(self, task: Task, state: RankState) -> None:
        state.remaining.discard(task)
        state.executed.append(task)
        self._arrived.discard(task)
        if task in self._waiting:  # a TP follower runs the leader's choice and waits for its input
            self._inbox[task] = self._waiting.pop(task)
        if task.is_forward and not self._forward_only:
            state.stored_activations += 1
            state.peak_stored_activations = max(state.peak_stored_activations, state.stored_activations)

    def _finish(self, task: Task, state: RankState) -> None:
        state.completed.add(task)
        if not task.is_forward:
            state.stored_activations -= 1
        elif not self._forward_only:
            # Its gradient can only come after this forward's output went downstream.
            self._expect(Task(TaskKind.BACKWARD, task.chunk, task.microbatch))
        self._post(task, None)  # the static executor's send of this task's output

    def _expect(self, task: Task) -> None:
        """Post the receive of `task`'s input, or mark it arrived when the input is local."""
        layout, pp_rank = self.stage.layout, self.stage.pp_rank
        source = layout.input_source(pp_rank, task)
        if source is None:
            self._arrived.add(task)
            return
        peer_rank, _ = source
        buffer = torch.empty(self.stage.activation_shape, dtype=self.stage.dtype, device=self.stage.device)
        tag = message_tag(task.kind.value, layout.virtual_stage(pp_rank, task.chunk), task.microbatch,
                          layout.num_microbatches)
        peer = self.stage.pp_global_ranks[peer_rank]
        handle = self.transport.post([], [Message(peer, tag, buffer)])[-1]
        attrs = dict(peer=peer, bytes=buffer.numel() * buffer.element_size(), chunk=task.chunk,
                     microbatch=task.microbatch, direction=task.kind.value)
        self._waiting[task] = (buffer, handle, attrs)

    def _collect_arrivals(self) -> None:
        for task in [task for task, (_, handle, _) in self._waiting.items() if handle.is_completed()]:
            self._inbox[task] = self._waiting.pop(task)
            self._arrived.add(task)

    def _idle(self) -> None:
        """Nothing runnable: sleep until any transfer completes (or a short timeout)."""
        wait_any = getattr(self.transport, "wait_any", None)
        if wait_any is not None:
            wait_any(self.idle_timeout_s)
        else:
            time.sleep(self.idle_timeout_s / 5)
