"""Role layout of forward-backward disaggregation: which physical rank runs the forward or the
backward instance of which logical (virtual) rank, and the process groups each role needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from megatron.app.config import ConfigError

FORWARD = "fwd"
BACKWARD = "bwd"


@dataclass(frozen=True, slots=True)
class Instance:
    """One half of a logical rank: its role, model replica, pipeline stage and TP rank.
    A merged forward instance (--ignore-forward-tensor-parallel) has tp_rank 0 of tp_size 1."""

    rank: int  # physical (global) rank
    role: str
    replica: int  # data-parallel index among the DP/2 training replicas
    stage: int
    tp_rank: int
    tp_size: int
    slot: int = 0  # thread slot in its process (--forward-instances-per-process > 1), else 0

    @property
    def is_forward(self) -> bool:
        return self.role == FORWARD


@dataclass(frozen=True, slots=True)
class FBDLayout:
    """Backward instances form the training mesh tp x pp x replicas (megatron order: tp fastest,
    then replica, then stage) on ranks [0, tp*pp*replicas); forward instances follow. With
    `forward_per_process` = k x pp (> 1; forward TP=1), each forward process (a "host") runs the
    forward instances of k whole replicas as threads (thread slot = local replica x pp + stage)."""

    world_size: int
    tp: int
    pp: int
    replicas: int
    ignore_forward_tp: bool
    forward_per_process: int = 1

    @property
    def threaded(self) -> bool:
        return self.forward_per_process > 1

    @property
    def replicas_per_host(self) -> int:
        return self.forward_per_process // self.pp if self.threaded else 1

    @property
    def hosts(self) -> int:
        """Forward processes of a threaded layout."""
        return self.replicas // self.replicas_per_host

    @property
    def forward_tp(self) -> int:
        return 1 if self.ignore_forward_tp else self.tp

    @property
    def mesh_size(self) -> int:
        """Ranks holding backward instances (the training world)."""
        return self.tp * self.pp * self.replicas

    def _rank(self, role: str, replica: int, stage: int, tp_rank: int) -> int:
        tp = self.tp if role == BACKWARD else self.forward_tp
        base = 0 if role == BACKWARD else self.mesh_size
        if role == FORWARD and self.threaded:
            return base + replica // self.replicas_per_host
        return base + tp_rank + tp * (replica + self.replicas * stage)

    def instance(self, rank: int) -> Instance:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        return self.hosted(rank)[0]

    def hosted(self, rank: int) -> list[Instance]:
        """Every instance process `rank` runs: one, or one per thread slot of a threaded forward host."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        if self.threaded and rank >= self.mesh_size:
            k = self.replicas_per_host
            first = (rank - self.mesh_size) * k
            return [Instance(rank=rank, role=FORWARD, replica=first + r, stage=s, tp_rank=0, tp_size=1,
                             slot=r * self.pp + s)
                    for r in range(k) for s in range(self.pp)]
        role, local, tp = (BACKWARD, rank, self.tp) if rank < self.mesh_size else (
            FORWARD, rank - self.mesh_size, self.forward_tp)
        tp_rank, rest = local % tp, local // tp
        return [Instance(rank=rank, role=role, replica=rest % self.replicas, stage=rest // self.replicas,
                         tp_rank=tp_rank, tp_size=tp)]

    def instances(self) -> Iterator[Instance]:
        return (i for r in range(self.world_size) for i in self.hosted(r))

    def backward_of(self, replica: int, stage: int, tp_rank: int) -> int:
        return self._rank(BACKWARD, replica, stage, tp_rank)

    def forward_of(self, replica: int, stage: int, tp_rank: int) -> int:
        """The forward instance holding the weights of backward TP rank `tp_rank`."""
        return self._rank(FORWARD, replica, stage, 0 if self.ignore_forward_tp else tp_rank)

    def forward_slot(self, replica: int, stage: int) -> int:
        """Thread slot of a forward instance in its process."""
        return (replica % self.replicas_per_host) * self.pp + stage if self.threaded else 0

    def partners(self, rank: int | Instance) -> list[int]:
        """Backward instance(s) feeding forward instance `rank` with weights, or the forward
        instance a backward instance receives stage inputs from (a one-element list)."""
        me = self.instance(rank) if isinstance(rank, int) else rank
        if me.is_forward:
            tps = range(self.tp) if self.ignore_forward_tp else [me.tp_rank]
            return [self.backward_of(me.replica, me.stage, t) for t in tps]
        return [self.forward_of(me.replica, me.stage, me.tp_rank)]

    # --- process groups, as lists of global ranks, in one order every rank agrees on ----------
    def groups(self) -> dict[str, list[list[int]]]:
        """Per kind, every group of both roles. Kinds follow megatron-core's parallel_state."""
        result: dict[str, list[list[int]]] = {k: [] for k in ("tp", "pp", "dp", "mp", "tp_dp", "embedding",
                                                                "position_embedding", "self")}
        for role, tp in ((BACKWARD, self.tp), (FORWARD, self.forward_tp)):
            if role == FORWARD and self.threaded:
                # A host holds every stage of its replicas: its pipeline, model-parallel and
                # embedding groups are itself; its DP group is all forward hosts.
                hosts = [self.mesh_size + h for h in range(self.hosts)]
                for kind in ("mp", "tp", "pp", "embedding", "position_embedding"):
                    result[kind] += [[h] for h in hosts]
                result["dp"].append(hosts)
                result["tp_dp"].append(hosts)
                continue
            r = lambda replica, stage, t: self._rank(role, replica, stage, t)  # noqa: E731
            for replica in range(self.replicas):
                result["mp"].append([r(replica, s, t) for s in range(self.pp) for t in range(tp)])
                for s in range(self.pp):
                    result["tp"].append([r(replica, s, t) for t in range(tp)])
                for t in range(tp):
                    pipeline = [r(replica, s, t) for s in range(self.pp)]
                    result["pp"].append(pipeline)
                    ends = [pipeline[0], pipeline[-1]] if self.pp > 1 else [pipeline[0]]
                    result["embedding"].append(ends)
                    result["position_embedding"].append([pipeline[0]])
            for s in range(self.pp):
                result["tp_dp"].append([r(rep, s, t) for rep in range(self.replicas) for t in range(tp)])
                for t in range(tp):
                    result["dp"].append([r(rep, s, t) for rep in range(self.replicas)])
        result["self"] = [[rank] for rank in range(self.world_size)]
        return result

    def group_of(self, kind: str, rank: int) -> list[int]:
        for group in self.groups()[kind]:
            if rank in group:
                return group
        raise KeyError(f"rank {rank} is in no {kind} group")

    # --- start-up maps --------------------------------------------------------------------
    def physical_map(self) -> str:
        """One line per physical rank: what it runs."""
        lines = [f"FBD physical rank map ({self.world_size} ranks):"]
        for i in self.instances():
            thread = f" (thread {i.slot})" if self.threaded and i.is_forward else ""
            lines.append(f"  rank {i.rank:3d}: {i.role} instance of replica {i.replica} stage {i.stage} "
                         f"tp {i.tp_rank}/{i.tp_size}{thread}")
        return "\n".join(lines)

    def virtual_map(self) -> str:
        """One line per logical rank (dp, pp, tp of the training mesh): its forward and backward rank."""
        lines = [f"FBD virtual rank map (tp={self.tp} pp={self.pp} dp={self.replicas}; "
                 f"forward tp={self.forward_tp}):"]
        for stage in range(self.pp):
            for replica in range(self.replicas):
                for t in range(self.tp):
                    lines.append(f"  dp {replica} pp {stage} tp {t}: fwd rank {self.forward_of(replica, stage, t)}, "
                                 f"bwd rank {self.backward_of(replica, stage, t)}")
        return "\n".join(lines)


def build_layout(world_size: int, tp: int, pp: int, ignore_forward_tp: bool,
                 forward_per_process: int = 1) -> FBDLayout:
    """The layout for a physical world; ConfigError naming every factor when it cannot work."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"tp({tp}) and pp({pp}) must be >= 1")
    if forward_per_process != 1:
        return _threaded_layout(world_size, tp, pp, ignore_forward_tp, forward_per_process)
    if ignore_forward_tp:
        per_replica = pp * (tp + 1)  # tp backward ranks + 1 merged forward rank per stage
        if world_size % per_replica != 0:
            raise ConfigError(
                f"--forward-backward-disaggregating --ignore-forward-tensor-parallel needs world_size to be a "
                f"multiple of pp({pp}) x (tp({tp}) + 1) = {per_replica} (tp backward ranks and one merged forward "
                f"rank per stage and replica), got world_size({world_size}); use {per_replica} x replicas ranks"
            )
        return FBDLayout(world_size=world_size, tp=tp, pp=pp, replicas=world_size // per_replica,
                         ignore_forward_tp=True)
    if world_size % (tp * pp) != 0:
        dp_guess = max(1, world_size // (tp * pp))
        raise ConfigError(
            f"tp({tp}) x pp({pp}) x dp({dp_guess}) = {tp * pp * dp_guess} != world_size({world_size}): "
            f"world size must be a multiple of tp x pp = {tp * pp}"
        )
    dp = world_size // (tp * pp)
    if dp % 2 != 0:
        raise ConfigError(
            f"--forward-backward-disaggregating splits each logical rank into a forward and a backward instance, "
            f"so data-parallel size must be even: world_size({world_size}) / (tp({tp}) x pp({pp})) = dp({dp}) is odd; "
            f"launch {2 * tp * pp * ((dp + 1) // 2)} ranks (dp {dp + 1}) or drop the flag"
        )
    return FBDLayout(world_size=world_size, tp=tp, pp=pp, replicas=dp // 2, ignore_forward_tp=False)


def _threaded_layout(world_size: int, tp: int, pp: int, ignore_forward_tp: bool, n: int) -> FBDLayout:
    """--forward-instances-per-process n: each forward process hosts n = k x pp forward instances as
    threads, all stages of k replicas, so every forward-to-forward hand-off stays in the process. The
    forward side must be TP=1 (threads of one process cannot run tensor-parallel collectives inside
    the layers): TP=1, or --ignore-forward-tensor-parallel."""
    if n < 1:
        raise ConfigError(f"--forward-instances-per-process must be >= 1, got {n}")
    if tp != 1 and not ignore_forward_tp:
        raise ConfigError(
            f"--forward-instances-per-process {n} with tp({tp}) needs --ignore-forward-tensor-parallel: threads "
            f"sharing a process cannot run tensor-parallel collectives inside the layers, so each forward "
            f"instance must hold its whole stage (or use tp(1))")
    if n % pp != 0:
        raise ConfigError(
            f"--forward-instances-per-process {n} must be a multiple of pp({pp}): a forward process hosts all "
            f"stages of whole replicas (n = replicas per process x pp)")
    k = n // pp
    per_host = k * pp * tp + 1
    if world_size % per_host != 0:
        raise ConfigError(
            f"--forward-instances-per-process {n} needs world_size to be a multiple of {k} replica(s) x pp({pp}) x "
            f"tp({tp}) + 1 = {per_host} (the backward ranks of {k} replica(s) and their one forward process), "
            f"got world_size({world_size}); use {per_host} x forward processes ranks")
    return FBDLayout(world_size=world_size, tp=tp, pp=pp, replicas=k * (world_size // per_host),
                     ignore_forward_tp=ignore_forward_tp, forward_per_process=n)
