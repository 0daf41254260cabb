"""Stage 1, peer comparison of compute: ranks of one pipeline stage run the same kernels on the
same shapes, so per task instance each rank's busy time is compared with its peers' (robust
statistics on log time); ranks without peers are compared with their own earlier iterations."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.model import DetectionInput

_MAD = 1.4826  # MAD -> standard deviation for normal noise


@dataclass(kw_only=True)
class ComputeFinding:
    rank: int
    method: str  # "peers" | "history"
    peers: list[int]
    instances: int
    slow_instances: int
    slowdown: float  # median busy time / peers' median busy time (or / own baseline)
    z: float  # median log ratio in standard errors
    flagged: bool
    onset_iteration: int | None = None
    worst_ops: list[dict] = field(default_factory=list)

    @property
    def score(self) -> float:
        return self.slow_instances / self.instances if self.instances else 0.0


@dataclass(kw_only=True)
class ComputeStage:
    findings: dict[int, ComputeFinding]
    noise: float  # robust std of one instance's log busy time
    cannot_compare: list[int]  # ranks with neither peers nor enough history
    notes: list[str] = field(default_factory=list)


def _noise(log_busy: np.ndarray, keys: np.ndarray) -> float:
    """Spread of an instance around its own rank's median of the same (kind, chunk): a constant
    slowdown of a rank shifts its median, not this spread, so the slow rank cannot inflate it."""
    if len(log_busy) < 3:
        return 0.1
    _, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    medians = np.array([np.median(log_busy[inverse == g]) for g in range(inverse.max() + 1)])
    residual = log_busy - medians[inverse]
    return max(_MAD * float(np.median(np.abs(residual))), 0.01)


def peer_comparison(data: DetectionInput, *, z_instance: float = 2.0, z_rank: float = 3.5,
                    min_slowdown: float = 1.1, min_share: float = 0.0) -> ComputeStage:
    """Per task instance (iteration, kind, chunk, microbatch) and stage, each rank's log busy time
    minus the median of its peers'. An instance is slow past `z_instance` noise; a rank is flagged
    when its median ratio is significant (`z_rank` standard errors) and above `min_slowdown`
    (and, optionally, a `min_share` of its instances are slow; on a shared, noisy host single
    instances are too noisy for that to be required). The floor keeps steady sub-percent differences of
    healthy hardware, which many instances make 'significant', from becoming alarms."""
    t = data.compute
    findings: dict[int, ComputeFinding] = {}
    cannot: list[int] = []
    notes: list[str] = []
    if not len(t["rank"]):
        return ComputeStage(findings={}, noise=float("nan"), cannot_compare=data.world,
                            notes=["no forward/backward spans in the trace: compute cannot be compared"])
    log_busy = np.log(np.maximum(t["busy"], 1).astype(np.float64))
    noise = _noise(log_busy, np.stack([t["rank"], t["kind"], t["chunk"]], axis=1))
    pair_noise = noise * np.sqrt(2.0)
    stage_of = np.array([data.roles[int(r)].pp for r in t["rank"]], dtype=np.int64)
    for stage in np.unique(stage_of):
        in_stage = stage_of == stage
        ranks = np.unique(t["rank"][in_stage])
        if len(ranks) < 2:
            continue
        key = np.stack([t["iteration"], t["kind"], t["chunk"], t["microbatch"]], axis=1)[in_stage]
        keys, inverse = np.unique(key, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        col = np.searchsorted(ranks, t["rank"][in_stage])
        matrix = np.full((len(keys), len(ranks)), np.nan)  # [instance, rank]
        matrix[inverse, col] = log_busy[in_stage]
        for j, rank in enumerate(ranks):
            others = np.delete(matrix, j, axis=1)
            valid = ~np.isnan(matrix[:, j]) & (np.sum(~np.isnan(others), axis=1) > 0)
            if not valid.any():
                continue
            reference = np.nanmedian(others[valid], axis=1)
            ratio = matrix[valid, j] - reference
            findings[int(rank)] = _finding(int(rank), "peers", [int(r) for r in ranks if r != rank], ratio, keys[valid],
                                           pair_noise, z_instance, z_rank, min_slowdown, min_share)
    for rank in data.world:
        if rank in findings:
            continue
        mine = t["rank"] == rank
        history = _history(rank, t["iteration"][mine], log_busy[mine], noise, z_rank, min_slowdown)
        if history is None:
            cannot.append(rank)
        else:
            findings[rank] = history
    if cannot:
        notes.append(f"rank(s) {cannot} have no peer of the same stage and too few iterations to compare with "
                     f"their own history: their compute cannot be compared")
    return ComputeStage(findings=findings, noise=noise, cannot_compare=cannot, notes=notes)


def _finding(rank: int, method: str, peers: list[int], ratio: np.ndarray, keys: np.ndarray, pair_noise: float,
             z_instance: float, z_rank: float, min_slowdown: float, min_share: float) -> ComputeFinding:
    median = float(np.median(ratio))
    # The pooled within-rank noise, not this rank's own spread: a slow rank's ratios are wider
    # (its extra work is itself noisy) and would hide it. sqrt(2): two noisy sides per ratio.
    spread = pair_noise
    slow = ratio > max(z_instance * spread, np.log(1.02))
    standard_error = 1.2533 * spread / np.sqrt(len(ratio))
    z = median / standard_error
    # Instances of one iteration share the host's load, so they are not independent: with enough
    # iterations a slow rank must also be slower in most of them, not in one burst of contention.
    iterations = np.unique(keys[:, 0])
    consistent = True
    if len(iterations) >= 4:
        per_iteration = np.array([np.median(ratio[keys[:, 0] == i]) for i in iterations])
        consistent = bool(np.mean(per_iteration > 0) >= 0.75)
    flagged = bool(z > z_rank and np.exp(median) >= min_slowdown and slow.mean() >= min_share and consistent)
    worst = np.argsort(-ratio)[:5]
    worst_ops = [{"iteration": int(keys[i, 0]), "op": "backward" if keys[i, 1] else "forward", "chunk": int(keys[i, 2]),
                  "microbatch": int(keys[i, 3]), "slowdown": round(float(np.exp(ratio[i])), 3)} for i in worst]
    return ComputeFinding(rank=rank, method=method, peers=peers, instances=len(ratio), slow_instances=int(slow.sum()),
                          slowdown=float(np.exp(median)), z=float(z), flagged=flagged, worst_ops=worst_ops)


def _history(rank: int, iteration: np.ndarray, log_busy: np.ndarray, noise: float, z_rank: float,
             min_slowdown: float) -> ComputeFinding | None:
    """A rank without peers against itself: the best split of its iterations into before/after,
    flagged when the later part is significantly and materially slower (an onset)."""
    iterations = np.unique(iteration)
    if len(iterations) < 3:
        return None
    per_iteration = np.array([np.median(log_busy[iteration == i]) for i in iterations])
    counts = np.array([np.sum(iteration == i) for i in iterations])
    best: tuple[float, int] | None = None
    for split in range(1, len(iterations)):
        before, after = per_iteration[:split], per_iteration[split:]
        shift = float(np.median(after) - np.median(before))
        error = 1.2533 * noise * np.sqrt(1 / counts[:split].sum() + 1 / counts[split:].sum())
        z = shift / error
        if best is None or z > best[0]:
            best = (z, split)
    z, split = best
    shift = float(np.median(per_iteration[split:]) - np.median(per_iteration[:split]))
    flagged = bool(z > z_rank and np.exp(shift) >= min_slowdown)
    return ComputeFinding(rank=rank, method="history", peers=[], instances=int(counts[split:].sum()),
                          slow_instances=int(counts[split:].sum()) if flagged else 0, slowdown=float(np.exp(shift)),
                          z=float(z), flagged=flagged, onset_iteration=int(iterations[split]) if flagged else None)
