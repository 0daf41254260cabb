"""Communication coordinator: lets several threads of one process (forward instances sharing a
device) issue collectives over overlapping groups without deadlock.

Each thread registers the collective it wants by setting its bit in its group's bit-vector.
Once per round, the coordinators of all processes OR-all-reduce the flattened table; a group's
collective is ready when its vector is complete, and ready collectives run in ascending group
order, so every process runs the same collectives in the same order.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

Member = tuple[int, int]  # (process rank, thread slot)


@dataclass(slots=True)
class _Request:
    tensor: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    result: torch.Tensor | None = None
    error: BaseException | None = None


class CoordinatorError(RuntimeError):
    """A collective was issued that the coordinator cannot run (wrong group or thread)."""


class CommunicationCoordinator:
    """One per process. `groups[g]` lists the (rank, thread slot) members of group g; the same list
    on every process. Threads call `all_reduce(g, slot, tensor)`; a background thread runs rounds
    until `close()` has been called on every process."""

    def __init__(self, groups: Sequence[Sequence[Member]], process_group=None, idle_sleep_s: float = 2e-4) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size(process_group)
        self.process_group = process_group
        self.groups = [tuple(sorted(set(g))) for g in groups]
        self.idle_sleep_s = idle_sleep_s
        # Bit offsets: group g's vector is table[offsets[g] : offsets[g] + len(groups[g])];
        # the last `world` entries say which processes still run rounds.
        self.offsets, offset = [], 0
        for members in self.groups:
            self.offsets.append(offset)
            offset += len(members)
        self.alive_offset = offset
        self.table_size = offset + self.world
        self.local_bits = torch.zeros(self.table_size, dtype=torch.uint8)
        self.requests: dict[tuple[int, Member], _Request] = {}
        self.lock = threading.Lock()
        self.closing = False
        self.rounds = 0
        self.executed: list[int] = []  # group ids in the order their collectives ran here
        # One torch.distributed group per distinct set of processes hosting a group's members.
        self.process_groups: dict[tuple[int, ...], object] = {}
        for members in self.groups:
            ranks = tuple(sorted({r for r, _ in members}))
            if len(ranks) > 1 and ranks not in self.process_groups:
                self.process_groups[ranks] = dist.new_group(list(ranks))
        self.local_bits[self.alive_offset + self._process_index()] = 1
        self.thread = threading.Thread(target=self._run, name="fbd-coordinator", daemon=True)
        self.thread.start()

    def _process_index(self) -> int:
        if self.process_group is None:
            return self.rank
        return dist.get_process_group_ranks(self.process_group).index(self.rank)

    # --- thread API ------------------------------------------------------------------------
    def all_reduce(self, group: int, slot: int, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over every member of `group`; blocks the calling thread until it ran."""
        member = (self.rank, slot)
        if not 0 <= group < len(self.groups) or member not in self.groups[group]:
            raise CoordinatorError(f"thread slot {slot} of rank {self.rank} is not a member of group {group}")
        request = _Request(tensor)
        with self.lock:
            if self.closing:
                raise CoordinatorError("the coordinator is closed")
            if (group, member) in self.requests:
                raise CoordinatorError(f"slot {slot} already waits on group {group}")
            self.requests[(group, member)] = request
            self.local_bits[self.offsets[group] + self.groups[group].index(member)] = 1
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.result

    def close(self, timeout: float | None = None) -> None:
        """Stop taking part in rounds once every process has closed too."""
        with self.lock:
            self.closing = True
        self.thread.join(timeout)

    # --- coordinator thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.closing and not self.requests:
                        self.local_bits[self.alive_offset + self._process_index()] = 0
                    table = self.local_bits.clone()
                # The OR over processes of 0/1 entries (MAX is OR on bits; every backend has it).
                dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.process_group)
                self.rounds += 1
                if not table[self.alive_offset:].any():
                    return
                ready = [g for g, members in enumerate(self.groups)
                         if bool(table[self.offsets[g]: self.offsets[g] + len(members)].all())]
                for group in ready:  # ascending group order on every process
                    self._execute(group)
                if not ready:
                    time.sleep(self.idle_sleep_s)
        except BaseException as exc:  # wake every waiting thread with the failure
            with self.lock:
                for request in self.requests.values():
                    request.error = exc
                    request.done.set()
                self.requests.clear()

    def _execute(self, group: int) -> None:
        members = self.groups[group]
        with self.lock:
            local = [(m, self.requests.pop((group, m))) for m in members if m[0] == self.rank]
            for m, _ in local:
                self.local_bits[self.offsets[group] + members.index(m)] = 0
        if not local:
            return
        total = local[0][1].tensor.clone()
        for _, request in local[1:]:
            total += request.tensor
        ranks = tuple(sorted({r for r, _ in members}))
        if len(ranks) > 1:
            dist.all_reduce(total, group=self.process_groups[ranks])
        self.executed.append(group)
        for _, request in local:
            request.result = total.clone()
            request.done.set()
