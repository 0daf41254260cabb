"""Synthetic 3D-parallel jobs made directly as the detectors' input (a `DetectionInput`), with a
known truth, for measuring detection at 64 ... 16,384 ranks: writing and aggregating trace files
(megatron.scan.synthetic) is far too slow at that scale.

The model, with its parameters fitted to real traces (megatron/scan/data/synthetic_calibration.json,
refitted by `python -m megatron.scan.synthetic_job fit DIR...`; see megatron.scan.synthetic_fit):
each forward/backward task of a microbatch takes a base time x a persistent per-rank speed x
per-iteration noise shared by the whole job, by the ranks of one node and per rank x a lognormal
per-task body with occasional Pareto-tail outliers (and, where fitted, whole-iteration outliers
added to one task). Each data-parallel replica runs 1F1B (megatron-core's non-interleaved order),
vectorized over replicas and TP members; TP all-reduces inside every task end when their last
member arrives; a stage posts its receive when it reaches the task that needs it, so a slow stage
makes its neighbours wait; DP gradient all-reduces and the model-parallel grad-norm all-reduce
close the step. Ranks are ordered as megatron-core does (tp fastest, then dp, then pp) and live
on nodes of `ranks_per_node` consecutive ranks.

Over 400 lines: the job model, its calibrations, the synthesizer and the command line that fits
and compares it against real traces are one tool; the fitting statistics live in synthetic_fit."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron.scan.detect.model import DetectionInput, RankRole
from megatron.scan.synthetic_fit import (
    compare_statistics,
    robust_sigma,
    fit_gpu_series,
    fit_parameters,
    format_comparison,
    job_statistics,
)

CALIBRATION_FILE = Path(__file__).resolve().parent / "data" / "synthetic_calibration.json"
GROUP_KINDS = ["DATA_PARALLEL_GROUP", "MODEL_PARALLEL_GROUP", "TENSOR_MODEL_PARALLEL_GROUP"]
_DP_KIND, _MP_KIND, _TP_KIND = range(3)
_MS = 1e6  # ns
FAULT_KINDS = ("slow_rank", "slow_node", "slow_link", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str  # "slow_rank" | "slow_node" | "slow_link" | "hang"
    ranks: tuple[int, ...] = ()  # slow ranks, (src, dst) of a slow link, or (hung rank,)
    node: int = -1  # slow node index (rank // ranks_per_node)
    factor: float = 1.5  # compute (or link transfer) time multiplier
    start_iteration: int = 0  # from the start, or mid-run (a hang: the iteration it stops in)
    bursty: float = 0.0  # 0: every iteration from start_iteration; else the share of them affected


@dataclass(frozen=True)
class JobSpec:
    tp: int
    pp: int
    dp: int
    ranks_per_node: int = 8
    iterations: int = 20
    microbatches: int | None = None  # default 2 * pp
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    calibration: str | dict = "default"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """megatron-core's default order: tp fastest, then dp, then pp."""
        return tp + self.tp * (dp + self.dp * pp)


@dataclass
class Truth:
    slow_ranks: set[int]  # every rank made slow (a slow node's ranks included)
    slow_nodes: set[int]
    slow_links: set[tuple[int, int]]
    hung_rank: int | None
    healthy: bool


def node_of(rank: int, ranks_per_node: int) -> int:
    return int(rank) // int(ranks_per_node)


# ------------------------------------------------------------------------------------ calibration


def load_calibrations(path: Path = CALIBRATION_FILE) -> dict:
    return json.loads(Path(path).read_text())["calibrations"]


def calibration_parameters(calibration: str | dict = "default", path: Path = CALIBRATION_FILE) -> dict[str, float]:
    """The model's parameters: a named calibration of the JSON (its `base` resolved), or a dict
    of parameters laid over "default" (a partial dict overrides only what it names)."""
    table = load_calibrations(path)
    if isinstance(calibration, dict):
        return {**calibration_parameters("default", path), **calibration}
    if calibration not in table:
        raise KeyError(f"no calibration {calibration!r} (known: {sorted(table)})")
    entry = table[calibration]
    base = calibration_parameters(entry["base"], path) if entry.get("base") else {}
    return {**base, **entry["parameters"]}


# ------------------------------------------------------------------------------------- the model


def one_f_one_b(pp: int, microbatches: int) -> list[tuple[int, int, int]]:
    """(stage, kind 0 F / 1 B, microbatch) of every task of one iteration in an order where each
    task comes after the tasks it depends on: each stage's own 1F1B order, the forward of a
    microbatch after its previous stage's, the backward after its next stage's."""
    orders = []
    for p in range(pp):
        warmup = min(pp - p - 1, microbatches)
        order = [(0, m) for m in range(warmup)]
        for i in range(microbatches - warmup):
            order += [(0, warmup + i), (1, i)]
        order += [(1, m) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    done, position, sequence = set(), [0] * pp, []
    while len(sequence) < 2 * pp * microbatches:
        progressed = False
        for p in range(pp):
            while position[p] < len(orders[p]):
                kind, m = orders[p][position[p]]
                need = (p - 1, 0, m) if kind == 0 and p > 0 else (p + 1, 1, m) if kind == 1 and p < pp - 1 else None
                if need is not None and need not in done:
                    break
                done.add((p, kind, m))
                sequence.append((p, kind, m))
                position[p] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B order has a cycle")
    return sequence


def _affected_iterations(fault: Fault, iterations: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean per iteration: where the fault acts (bursty: a seeded subset of the later ones)."""
    on = np.arange(iterations) >= fault.start_iteration
    if fault.bursty and on.any():
        later = np.flatnonzero(on)
        keep = rng.choice(later, size=max(1, int(round(fault.bursty * len(later)))), replace=False)
        on = np.zeros(iterations, dtype=bool)
        on[keep] = True
    return on


def _pareto(rng: np.random.Generator, size: int, minimum: float, alpha: float) -> np.ndarray:
    return minimum * (1.0 - rng.random(size)) ** (-1.0 / max(alpha, 1.01))


def _compute_times(spec: JobSpec, par: dict, m: int, rng: np.random.Generator,
                   fault_rngs: list[np.random.Generator]) -> np.ndarray:
    """Compute ns of every task: shape (iterations, 2, microbatches, world), rank-ordered."""
    world, iterations = spec.world_size, spec.iterations
    nodes = np.arange(world) // spec.ranks_per_node
    stage = np.arange(world) // (spec.tp * spec.dp)
    speed = np.exp(rng.normal(0.0, par["rank_speed_sigma"], world))
    stage_factor = np.ones(spec.pp)
    if spec.pp > 1:
        stage_factor[0] *= par["first_stage_factor"]
        stage_factor[-1] *= par["last_stage_factor"]
    level = (rng.normal(0.0, par["iter_job_sigma"], iterations)[:, None]
             + rng.normal(0.0, par["iter_node_sigma"], (nodes.max() + 1, iterations)).T[:, nodes]
             + rng.normal(0.0, par["iter_rank_sigma"], (iterations, world)))
    level = np.exp(level) * speed * stage_factor[stage]
    level[0] *= par["first_iteration_factor"]
    base = np.array([par["forward_ms"], par["backward_ms"]]) * _MS / spec.pp  # the model's layers split over the stages
    times = rng.normal(0.0, par["task_sigma"], (iterations, 2, m, world))
    np.exp(times, out=times)
    times *= base[None, :, None, None]
    times *= level[:, None, None, :]
    flat = times.reshape(-1)
    tail = np.flatnonzero(rng.random(flat.size) < par["task_tail_prob"])
    flat[tail] *= _pareto(rng, len(tail), par["task_tail_min"], par["task_tail_alpha"])
    if par["iter_tail_prob"] > 0:  # a whole-iteration outlier, spent in one of its tasks
        it, r = np.nonzero(rng.random((iterations, world)) < par["iter_tail_prob"])
        extra = (_pareto(rng, len(it), par["iter_tail_min"], par["iter_tail_alpha"]) - 1.0) * times[it, :, :, r].sum(axis=(1, 2))
        times[it, rng.integers(0, 2, len(it)), rng.integers(0, m, len(it)), r] += extra
    for fault, frng in zip(spec.faults, fault_rngs):
        if fault.kind in ("slow_rank", "slow_node"):
            ranks = (np.asarray(fault.ranks, dtype=np.int64) if fault.kind == "slow_rank"
                     else np.flatnonzero(nodes == fault.node))
            on = _affected_iterations(fault, iterations, frng)
            times[np.ix_(np.flatnonzero(on), [0, 1], np.arange(m), ranks)] *= fault.factor
        elif fault.kind == "hang":
            times[fault.start_iteration:, :, :, fault.ranks[0]] = np.inf
    return times


class _Rows:
    """Column chunks appended per step, concatenated once."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names, self.chunks = names, {n: [] for n in names}

    def add(self, **columns) -> None:
        size = max(np.size(v) for v in columns.values())
        for n in self.names:
            # copies: the caller goes on updating its arrays in place
            self.chunks[n].append(np.full(size, columns[n]) if np.ndim(columns[n]) == 0
                                  else np.array(columns[n]).reshape(-1))

    def table(self) -> dict[str, np.ndarray]:
        out = {}
        for n in self.names:  # chunks freed column by column
            chunks = self.chunks.pop(n)
            out[n] = np.concatenate(chunks) if chunks else np.zeros(0)
            del chunks
        return out


def _validate(spec: JobSpec) -> None:
    for f in spec.faults:
        if f.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {f.kind!r} (one of {FAULT_KINDS})")
        if f.kind in ("slow_link", "hang", "slow_rank") and not f.ranks:
            raise ValueError(f"a {f.kind} fault needs ranks")
        if f.kind == "slow_link":
            src, dst = f.ranks
            ps, pd = src // (spec.tp * spec.dp), dst // (spec.tp * spec.dp)
            if abs(ps - pd) != 1 or src % (spec.tp * spec.dp) != dst % (spec.tp * spec.dp):
                raise ValueError(f"ranks {src} and {dst} exchange no pipeline messages")
        if any(not 0 <= r < spec.world_size for r in f.ranks):
            raise ValueError(f"fault ranks {f.ranks} outside the {spec.world_size}-rank world")


def truth_of(spec: JobSpec) -> Truth:
    slow_ranks, slow_nodes, slow_links, hung = set(), set(), set(), None
    for f in spec.faults:
        if f.kind == "slow_rank":
            slow_ranks.update(int(r) for r in f.ranks)
        elif f.kind == "slow_node":
            slow_nodes.add(int(f.node))
            slow_ranks.update(r for r in range(spec.world_size) if node_of(r, spec.ranks_per_node) == f.node)
        elif f.kind == "slow_link":
            slow_links.add((int(f.ranks[0]), int(f.ranks[1])))
        else:
            hung = int(f.ranks[0])
    return Truth(slow_ranks=slow_ranks, slow_nodes=slow_nodes, slow_links=slow_links, hung_rank=hung,
                 healthy=not spec.faults)


def synthesize(spec: JobSpec) -> tuple[DetectionInput, Truth]:
    """The detectors' input for one synthetic job, and what is wrong with it."""
    _validate(spec)
    par = calibration_parameters(spec.calibration)
    TP, PP, DP, I = spec.tp, spec.pp, spec.dp, spec.iterations
    m = spec.microbatches or 2 * PP
    world = spec.world_size
    rng = np.random.default_rng(spec.seed)
    fault_rngs = [np.random.default_rng([spec.seed, 7919, i]) for i in range(len(spec.faults))]
    times = _compute_times(spec, par, m, rng, fault_rngs).reshape(I, 2, m, PP, DP, TP)
    ranks = np.arange(world, dtype=np.int64).reshape(PP, DP, TP)
    link_factor = np.ones((PP, DP, TP, 2))  # per sender lane, per direction (0: to the next stage, 1: to the previous)
    for f in spec.faults:
        if f.kind == "slow_link":
            src, dst = f.ranks
            p, d, t = np.unravel_index(src, (PP, DP, TP))
            link_factor[p, d, t, 0 if dst > src else 1] *= f.factor
    k = max(int(round(par["tp_collectives_per_task"])), 1) if TP > 1 else 0
    order = one_f_one_b(PP, m)
    compute, coll = _Rows(("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy")), \
        _Rows(("instance", "rank", "arrive", "end", "group_size", "kind", "iteration"))
    p2p = _Rows(("src", "dst", "iteration", "backward", "send_start", "send_end", "recv_start", "recv_end", "bytes"))
    iters = _Rows(("rank", "iteration", "start", "end"))
    instance = 0
    free = np.zeros((PP, DP, TP))
    jitter = par["arrival_jitter_ms"] * _MS

    def lognormal(mean_ms: float, sigma: float, shape) -> np.ndarray:
        return mean_ms * _MS * np.exp(rng.normal(0.0, sigma, shape))

    for it in range(I):
        if not np.isfinite(free).any():
            break
        iteration_start = free.copy()
        free = free + lognormal(par["data_ms"], par["overhead_sigma"], (PP, DP, TP))
        sent = np.full((2, PP, m, DP, TP), np.nan)  # send_start of each task's output
        sent_end = np.full((2, PP, m, DP, TP), np.nan)
        for p, kind, mb in order:
            c = times[it, kind, mb, p]
            start = free[p].copy()
            source = p - 1 if kind == 0 else p + 1
            if 0 <= source < PP and not (kind == 1 and p == PP - 1):
                send_start, send_end = sent[kind, source, mb], sent_end[kind, source, mb]
                delivery = lognormal(par["p2p_delivery_ms"], par["p2p_delivery_sigma"], (DP, TP))
                delivery = delivery * link_factor[source, :, :, kind]
                recv_end = np.maximum(send_start, start) + delivery
                p2p.add(src=ranks[source], dst=ranks[p], iteration=it, backward=kind, send_start=send_start,
                        send_end=send_end, recv_start=start, recv_end=recv_end, bytes=int(par["p2p_bytes"]))
                start = recv_end
            if k:
                cursor = start
                for _ in range(k):
                    arrive = cursor + c / k + rng.exponential(jitter, (DP, TP)) if jitter > 0 else cursor + c / k
                    end = arrive.max(axis=1, keepdims=True) + lognormal(par["tp_allreduce_ms"],
                                                                        par["collective_cost_sigma"], (DP, 1))
                    coll.add(instance=instance + np.arange(DP)[:, None] + 0 * ranks[p], rank=ranks[p], arrive=arrive,
                             end=np.broadcast_to(end, (DP, TP)), group_size=TP, kind=_TP_KIND, iteration=it)
                    instance += DP
                    cursor = np.broadcast_to(end, (DP, TP))
                end = cursor
            else:
                end = start + c
            compute.add(rank=ranks[p], iteration=it, kind=kind, chunk=0, microbatch=mb, start=start, busy=c)
            destination = p + 1 if kind == 0 else p - 1
            if 0 <= destination < PP and not (kind == 0 and p == PP - 1):
                sent[kind, p, mb] = end
                sent_end[kind, p, mb] = end + lognormal(par["p2p_send_ms"], par["p2p_delivery_sigma"], (DP, TP))
                free[p] = sent_end[kind, p, mb]
            else:
                free[p] = end
        if DP > 1:  # gradient all-reduce of each (stage, TP index) over the replicas
            arrive = free + (rng.exponential(jitter, free.shape) if jitter > 0 else 0.0)
            end = arrive.max(axis=1, keepdims=True) + lognormal(par["dp_allreduce_ms"], par["collective_cost_sigma"],
                                                               (PP, 1, TP))
            ids = instance + np.arange(PP * TP).reshape(PP, 1, TP)
            coll.add(instance=ids + 0 * ranks, rank=ranks, arrive=arrive, end=np.broadcast_to(end, ranks.shape),
                     group_size=DP, kind=_DP_KIND, iteration=it)
            instance += PP * TP
            free = np.broadcast_to(end, ranks.shape).copy()
        if PP * TP > 1:  # grad-norm all-reduce over each replica's model-parallel group
            arrive = free + (rng.exponential(jitter, free.shape) if jitter > 0 else 0.0)
            end = arrive.max(axis=(0, 2), keepdims=True) + lognormal(par["mp_allreduce_ms"],
                                                                    par["collective_cost_sigma"], (1, DP, 1))
            coll.add(instance=instance + np.arange(DP).reshape(1, DP, 1) + 0 * ranks, rank=ranks, arrive=arrive,
                     end=np.broadcast_to(end, ranks.shape), group_size=PP * TP, kind=_MP_KIND, iteration=it)
            instance += DP
            free = np.broadcast_to(end, ranks.shape).copy()
        free = free + lognormal(par["optimizer_ms"], par["overhead_sigma"], free.shape)
        iters.add(rank=ranks, iteration=it, start=iteration_start, end=free)
    data = _finish(spec, compute.table(), coll.table(), p2p.table(), iters.table())
    return data, truth_of(spec)


def _finish(spec: JobSpec, compute: dict, coll: dict, p2p: dict, iters: dict) -> DetectionInput:
    """Rows a hang left unfinished dropped (or, for a collective the others wait in, ended at the
    window's end); times as int64 ns like model.from_aggregation's."""
    finite = [np.max(v[np.isfinite(v)]) for v in (compute["start"], coll["end"], iters["end"]) if np.isfinite(v).any()]
    last = max(finite) if finite else 0.0
    span = iters["end"] - iters["start"]
    typical = float(np.median(span[np.isfinite(span)])) if np.isfinite(span).any() else 0.0
    window_end = last + 2 * typical

    def ints(table: dict, keep: np.ndarray, times: tuple[str, ...]) -> dict[str, np.ndarray]:
        out = {}
        everything = bool(keep.all())
        for n in list(table):  # column by column, each float column freed once converted
            v = table.pop(n)
            v = v if everything else v[keep]
            out[n] = (np.round(v) if n in times else v).astype(np.int64)
            del v
        return out

    keep = np.isfinite(compute["start"]) & np.isfinite(compute["busy"])
    compute = ints(compute, keep, ("start", "busy"))
    compute["busy"] = np.maximum(compute["busy"], 1)
    coll["end"] = np.where(np.isfinite(coll["end"]), coll["end"], window_end)
    coll = ints(coll, np.isfinite(coll["arrive"]), ("arrive", "end"))
    keep = np.isfinite(p2p["send_start"]) & np.isfinite(p2p["recv_end"]) & np.isfinite(p2p["recv_start"])
    p2p = ints(p2p, keep, ("send_start", "send_end", "recv_start", "recv_end"))
    iters = ints(iters, np.isfinite(iters["end"]) & np.isfinite(iters["start"]), ("start", "end"))
    roles = {}
    for r in range(spec.world_size):
        pp, rest = divmod(r, spec.tp * spec.dp)
        dp, tp = divmod(rest, spec.tp)
        roles[r] = RankRole(rank=r, dp=dp, pp=pp, tp=tp, host=f"node{node_of(r, spec.ranks_per_node)}")
    return DetectionInput(roles=roles, sizes={"dp": spec.dp, "pp": spec.pp, "tp": spec.tp}, compute=compute,
                          collectives=coll, group_kinds=list(GROUP_KINDS), p2p=p2p, iteration_time=iters)


# --------------------------------------------------------------------------- fitting and comparing


def load_real(directory: str) -> DetectionInput:
    from megatron.scan.aggregate import aggregate
    from megatron.scan.detect.model import from_aggregation

    return from_aggregation(aggregate(directory, None))


def spec_like(data: DetectionInput, calibration: str | dict, seed: int = 0) -> JobSpec:
    """A healthy synthetic job of a real job's layout, iterations and microbatches, on one node."""
    c = data.compute
    return JobSpec(tp=data.sizes["tp"], pp=data.sizes["pp"], dp=data.sizes["dp"], ranks_per_node=len(data.world),
                   iterations=len(np.unique(c["iteration"])), microbatches=len(np.unique(c["microbatch"])),
                   seed=seed, calibration=calibration)


def compare(real: DetectionInput, calibration: str | dict = "cpu-gloo", seed: int = 0) -> list[dict]:
    """Real vs synthetic quantiles and KS statistic of each fitted distribution, the synthetic job
    of the real one's layout (spec_like)."""
    synthetic, _ = synthesize(spec_like(real, calibration, seed))
    return compare_statistics(job_statistics(real), job_statistics(synthetic))


def fit_jitter(datas: list[DetectionInput], parameters: dict, candidates=None) -> float:
    """arrival_jitter_ms by simulation: the candidate whose synthetic jobs (the real layouts) come
    closest to the real median arrival lateness (log distance, summed over the jobs)."""
    candidates = candidates if candidates is not None else [0.0, *np.geomspace(0.01, 20.0, 16)]
    real = [np.median(job_statistics(d).get("arrival_lateness", [np.nan])) for d in datas]
    best, best_score = 0.0, np.inf
    for jitter in candidates:
        score = 0.0
        for d, target in zip(datas, real):
            if not np.isfinite(target):
                continue
            synthetic, _ = synthesize(spec_like(d, {**parameters, "arrival_jitter_ms": float(jitter)}))
            got = np.median(job_statistics(synthetic).get("arrival_lateness", [np.nan]))
            score += abs(np.log(max(got, 1e-6) / target)) if np.isfinite(got) else 10.0
        if score < best_score:
            best, best_score = float(jitter), score
    return best


def _synthetic_sigma(datas: list[DetectionInput], parameters: dict, statistic: str) -> float:
    """Median over the real layouts of the robust sigma of log `statistic` in their synthetic jobs."""
    sigmas = []
    for d in datas:
        synthetic, _ = synthesize(spec_like(d, parameters))
        values = job_statistics(synthetic).get(statistic)
        if values is not None and len(values):
            sigmas.append(robust_sigma(np.log(values)))
    return float(np.median(sigmas)) if sigmas else 0.0


def _fit_by_simulation(datas: list[DetectionInput], parameters: dict, how: dict) -> None:
    """The parameters read best by simulating the real layouts: the per-iteration sigmas (what the
    task noise already puts into a rank's typical task taken off), the arrival jitter, and the
    untraced time of an iteration (added to optimizer_ms)."""
    stats = [job_statistics(d) for d in datas]
    for name, statistic in (("iter_rank_sigma", "rank_iteration_level"), ("iter_node_sigma", "iteration_common")):
        real = float(np.median([robust_sigma(np.log(s[statistic])) for s in stats if statistic in s]))
        floor = _synthetic_sigma(datas, {**parameters, name: 0.0}, statistic)
        parameters[name] = round(float(np.sqrt(max(real ** 2 - floor ** 2, 0.0))), 6)
        how[name] = (f"sqrt(real^2 - synthetic^2) of the robust sigma of log {statistic} (median over the jobs), "
                     f"the synthetic jobs of the real layouts made with {name} = 0: real {real:.4f}, from task "
                     f"noise alone {floor:.4f}" + (" (all ranks on one host: put on the node)"
                                                   if name == "iter_node_sigma" else ""))
    parameters["arrival_jitter_ms"] = round(fit_jitter(datas, parameters), 6)
    how["arrival_jitter_ms"] = ("mean of the exponential delay added to each collective arrival: the candidate "
                                "(0, 0.01-20 ms) whose synthetic jobs of the real layouts match the real median "
                                "arrival lateness best")
    gaps = []
    for d, s in zip(datas, stats):
        synthetic, _ = synthesize(spec_like(d, parameters))
        gaps.append(float(np.median(s["iteration_ms"]) - np.median(job_statistics(synthetic)["iteration_ms"])))
    parameters["optimizer_ms"] = round(parameters["optimizer_ms"] + max(float(np.median(gaps)), 0.0), 6)
    how["optimizer_ms"] += (f", plus the median over the jobs of the real median iteration less the synthetic "
                            f"one (time the trace does not attribute: {', '.join(f'{g:.1f}' for g in gaps)} ms)")


def fit(directories: list[str], name: str, path: Path = CALIBRATION_FILE) -> dict:
    """Fit the model to the real trace directories and store it under `name` in the JSON."""
    datas = [load_real(d) for d in directories]
    parameters, how = fit_parameters(datas)
    # One host: the job-wide and the node-wide per-iteration parts are one; it is put on the node.
    parameters.pop("iter_common_sigma")
    how.pop("iter_common_sigma")
    parameters["iter_job_sigma"] = 0.0
    how["iter_job_sigma"] = "0: one host cannot tell a job-wide part from the node's"
    parameters["arrival_jitter_ms"] = 0.0
    _fit_by_simulation(datas, parameters, how)
    document = json.loads(path.read_text()) if path.exists() else {"calibrations": {}}
    document["calibrations"][name] = {"source": [str(d) for d in directories], "parameters": parameters,
                                      "obtained": how}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return parameters


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron.scan.synthetic_job", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit the model to real trace directories and store the calibration")
    f.add_argument("directories", nargs="+", help="trace directories of real runs (--trace or launch)")
    f.add_argument("--name", required=True, help="calibration name in the JSON (e.g. cpu-gloo)")
    f.add_argument("--calibration-file", default=str(CALIBRATION_FILE),
                   help="the calibrations JSON to update (default: the one shipped with the package)")
    c = sub.add_parser("compare", help="real vs synthetic quantiles and KS of each fitted distribution")
    c.add_argument("directory", help="trace directory of a real run to compare a synthetic job of its layout with")
    c.add_argument("--calibration", default="cpu-gloo", help="calibration to synthesize with (default %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="seed of the synthetic job (default %(default)s)")
    g = sub.add_parser("fit-gpu", help="fit the per-iteration noise of one rank's busy times (ms, one per line)")
    g.add_argument("file", help="text file: one rank's busy time per iteration in ms, one per line")
    g.add_argument("--name", default="gpu", help="calibration name to store the fit under (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "fit":
        parameters = fit(args.directories, args.name, Path(args.calibration_file))
        print(json.dumps(parameters, indent=1))
    elif args.command == "compare":
        real = load_real(args.directory)
        spec = spec_like(real, args.calibration, args.seed)
        title = (f"{args.directory}: TP={spec.tp} PP={spec.pp} DP={spec.dp}, {spec.iterations} iterations, "
                 f"{spec.microbatches} microbatches; calibration {args.calibration!r}")
        print(format_comparison(compare(real, args.calibration, args.seed), title))
    else:
        values = [float(line) for line in Path(args.file).read_text().split() if line.strip()]
        print(json.dumps(fit_gpu_series(values), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
