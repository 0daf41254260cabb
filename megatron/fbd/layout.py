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

    @property
    def is_forward(self) -> bool:
        return self.role == FORWARD


@dataclass(frozen=True, slots=True)
class FBDLayout:
    """Backward instances form the training mesh tp x pp x replicas (megatron order: tp fastest,
    then replica, then stage) on ranks [0, tp*pp*replicas); forward instances follow."""

    world_size: int
    tp: int
    pp: int
    replicas: int
    ignore_forward_tp: bool

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
        return base + tp_rank + tp * (replica + self.replicas * stage)

    def instance(self, rank: int) -> Instance:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        role, local, tp = (BACKWARD, rank, self.tp) if rank < self.mesh_size else (
            FORWARD, rank - self.mesh_size, self.forward_tp)
        tp_rank, rest = local % tp, local // tp
        return Instance(rank=rank, role=role, replica=rest % self.replicas, stage=rest // self.replicas,
                        tp_rank=tp_rank, tp_size=tp)

    def instances(self) -> Iterator[Instance]:
        return (self.instance(r) for r in range(self.world_size))

    def backward_of(self, replica: int, stage: int, tp_rank: int) -> int:
        return self._rank(BACKWARD, replica, stage, tp_rank)

    def forward_of(self, replica: int, stage: int, tp_rank: int) -> int:
        """The forward instance holding the weights of backward TP rank `tp_rank`."""
        return self._rank(FORWARD, replica, stage, 0 if self.ignore_forward_tp else tp_rank)

    def partners(self, rank: int) -> list[int]:
        """Backward instance(s) feeding the forward instance `rank` with weights, or the forward
        instance a backward instance receives stage inputs from (a one-element list)."""
        me = self.instance(rank)
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
            lines.append(f"  rank {i.rank:3d}: {i.role} instance of replica {i.replica} stage {i.stage} "
                         f"tp {i.tp_rank}/{i.tp_size}")
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


def build_layout(world_size: int, tp: int, pp: int, ignore_forward_tp: bool) -> FBDLayout:
    """The layout for a physical world; ConfigError naming every factor when it cannot work."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"tp({tp}) and pp({pp}) must be >= 1")
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
