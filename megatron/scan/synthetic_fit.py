"""Fitting the synthetic job model (megatron.scan.synthetic_job) to real traces: the statistics
read off a `DetectionInput` (a real aggregation's or a synthetic job's, read the same way), the
parameters estimated from them, and the real-vs-synthetic comparison (quantiles and a two-sample
Kolmogorov-Smirnov statistic per distribution)."""
from __future__ import annotations

import numpy as np

from megatron.scan.detect.model import DetectionInput

_MAD = 1.4826
_MS = 1e6
QUANTILES = (10, 50, 90, 99)
# The distributions compared (each a sample of ratios, shares or ms; see job_statistics).
FITTED = ("task_busy_ratio", "task_residual", "rank_iteration_level", "iteration_common", "rank_speed",
          "arrival_lateness", "p2p_wait_fraction", "p2p_delivery_ms", "iteration_ms")


def robust_sigma(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(_MAD * np.median(np.abs(x - np.median(x)))) if len(x) else 0.0


def _group_ids(*columns: np.ndarray) -> np.ndarray:
    return np.unique(np.column_stack(columns), axis=0, return_inverse=True)[1].reshape(-1)


def _group_median(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Per row, the median of `values` over the rows of its group."""
    order = np.lexsort((values, groups))
    g, v = groups[order], values[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    counts = np.diff(np.r_[starts, len(g)])
    medians = (v[starts + (counts - 1) // 2] + v[starts + counts // 2]) / 2
    out = np.empty(len(values))
    out[order] = np.repeat(medians, counts)
    return out


def _levels(data: DetectionInput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, iterations, L[rank, iteration]): the median over a rank's tasks of an iteration of
    log(busy / that rank's median busy of the same kind and microbatch); nan where it ran none."""
    c = data.compute
    log_busy = np.log(np.maximum(c["busy"], 1).astype(np.float64))
    relative = log_busy - _group_median(log_busy, _group_ids(c["rank"], c["kind"], c["microbatch"]))
    ranks, r = np.unique(c["rank"], return_inverse=True)
    its, i = np.unique(c["iteration"], return_inverse=True)
    cell = r.reshape(-1) * len(its) + i.reshape(-1)
    level = np.full(len(ranks) * len(its), np.nan)
    medians = _group_median(relative, cell)
    level[cell] = medians
    return ranks, its, level.reshape(len(ranks), len(its))


def job_statistics(data: DetectionInput) -> dict[str, np.ndarray]:
    """Samples of each fitted distribution (FITTED), plus scalars the fit uses (as 1-element arrays):
    task_busy_ratio  busy / the rank's median busy of the same kind and stage-microbatch (all of it)
    task_residual    busy / the median of the rank's tasks of the same kind in the same iteration
    rank_iteration_level  a rank's typical task in an iteration / its typical task (see _levels),
                     the job-wide part (median over ranks per iteration) taken out, iteration 0 left out
    iteration_common the job-wide part: per iteration, the median over ranks of the level
    rank_speed       a rank's median task / the median over its same-stage peers (no peers: none)
    arrival_lateness arrival - first arrival, over the median iteration time, of the non-first
                     members of collectives among ranks of one pipeline stage
    p2p_wait_fraction per receiving rank and iteration, its receives' duration / its iteration time
    p2p_delivery_ms  recv_end - max(send_start, recv_start) per message
    iteration_ms     each rank's iteration spans"""
    c, out = data.compute, {}
    if len(c["rank"]):
        log_busy = np.log(np.maximum(c["busy"], 1).astype(np.float64))
        out["task_busy_ratio"] = np.exp(log_busy - _group_median(log_busy, _group_ids(c["rank"], c["kind"],
                                                                                        c["microbatch"])))
        out["task_residual"] = np.exp(log_busy - _group_median(log_busy, _group_ids(c["rank"], c["iteration"],
                                                                                      c["kind"])))
        ranks, its, level = _levels(data)
        later = level[:, its > its.min()] if len(its) > 2 else level
        common = np.nanmedian(later, axis=0)
        residual = later - common[None, :]
        out["rank_iteration_level"] = np.exp(residual[np.isfinite(residual)])
        out["iteration_common"] = np.exp(common - np.nanmedian(common))
        out["first_iteration"] = np.exp(np.array([np.nanmedian(level[:, 0] - np.nanmedian(later, axis=1))]))
        stages = {}
        stage_of_rank = {r: stages.setdefault(role.stage, len(stages)) for r, role in data.roles.items()}
        stage_id = np.array([stage_of_rank[int(r)] for r in c["rank"]], dtype=np.int64)
        peer_relative = log_busy - _group_median(log_busy, _group_ids(stage_id, c["iteration"], c["kind"],
                                                                      c["microbatch"]))
        per_rank = {int(r): float(np.median(peer_relative[c["rank"] == r])) for r in np.unique(c["rank"])}
        members = np.bincount(list(stage_of_rank.values()))
        has_peers = {r for r, s in stage_of_rank.items() if members[s] >= 2}
        out["rank_speed"] = np.exp(np.array([v for r, v in per_rank.items() if r in has_peers]))
    t = data.collectives
    spans = data.iteration_time
    iteration_ns = float(np.median(spans["end"] - spans["start"])) if len(spans["rank"]) else float("nan")
    if len(t["instance"]):
        stage_of = {r: i for i, r in enumerate(sorted({role.stage for role in data.roles.values()}))}
        st = np.array([stage_of[data.roles[int(r)].stage] for r in t["rank"]])
        inst = np.unique(t["instance"], return_inverse=True)[1].reshape(-1)
        one_stage = np.zeros(inst.max() + 1, dtype=bool)
        low, high = np.full(inst.max() + 1, 10**9), np.full(inst.max() + 1, -1)
        np.minimum.at(low, inst, st)
        np.maximum.at(high, inst, st)
        one_stage = (low == high)[inst]
        first = np.full(inst.max() + 1, np.iinfo(np.int64).max)
        np.minimum.at(first, inst, t["arrive"])
        last = np.full(inst.max() + 1, np.iinfo(np.int64).min)
        np.maximum.at(last, inst, t["arrive"])
        late = (t["arrive"] - first[inst]).astype(np.float64)
        not_first = one_stage & (t["arrive"] > first[inst])
        out["arrival_lateness"] = late[not_first] / iteration_ns
        for k, name in enumerate(data.group_kinds):
            rows = np.flatnonzero(t["kind"] == k)
            if len(rows):
                ids = np.unique(inst[rows])
                end = np.zeros(inst.max() + 1)
                end[inst[rows]] = t["end"][rows]
                out[f"cost_ms:{name}"] = np.maximum(end[ids] - last[ids], 0) / _MS
                out[f"instances:{name}"] = np.array([float(len(ids))])
    p = data.p2p
    if len(p["src"]):
        out["p2p_delivery_ms"] = np.maximum(p["recv_end"] - np.maximum(p["send_start"], p["recv_start"]), 0) / _MS
        out["p2p_send_ms"] = np.maximum(p["send_end"] - p["send_start"], 0) / _MS
        out["p2p_bytes"] = p["bytes"].astype(np.float64)
        if len(spans["rank"]):
            key = spans["rank"] * 1_000_000 + spans["iteration"]
            wait = np.zeros(len(key))
            index = {int(k): j for j, k in enumerate(key)}
            rows = [index.get(int(k), -1) for k in p["dst"] * 1_000_000 + p["iteration"]]
            rows = np.asarray(rows)
            ok = rows >= 0
            np.add.at(wait, rows[ok], (p["recv_end"] - p["recv_start"])[ok].astype(np.float64))
            received = np.isin(spans["rank"], np.unique(p["dst"]))
            out["p2p_wait_fraction"] = (wait / np.maximum(spans["end"] - spans["start"], 1))[received]
    if len(spans["rank"]):
        out["iteration_ms"] = (spans["end"] - spans["start"]) / _MS
        if len(c["rank"]):
            first_start = {}
            for r, i, s in zip(c["rank"].tolist(), c["iteration"].tolist(), c["start"].tolist()):
                first_start[(r, i)] = min(first_start.get((r, i), s), s)
            gaps = [first_start[(r, i)] - s for r, i, s in zip(spans["rank"].tolist(), spans["iteration"].tolist(),
                                                                 spans["start"].tolist()) if (r, i) in first_start]
            out["data_ms"] = np.maximum(np.asarray(gaps, dtype=np.float64), 0) / _MS
        if len(t["instance"]):
            last_end = {}
            for r, i, e in zip(t["rank"].tolist(), t["iteration"].tolist(), t["end"].tolist()):
                last_end[(r, i)] = max(last_end.get((r, i), e), e)
            tails = [e - last_end[(r, i)] for r, i, e in zip(spans["rank"].tolist(), spans["iteration"].tolist(),
                                                            spans["end"].tolist()) if (r, i) in last_end]
            out["optimizer_ms"] = np.maximum(np.asarray(tails, dtype=np.float64), 0) / _MS
    return out


def _pooled(stats: list[dict[str, np.ndarray]], name: str) -> np.ndarray:
    parts = [s[name] for s in stats if name in s and len(s[name])]
    return np.concatenate(parts) if parts else np.zeros(0)


def _median_of(stats, name, default: float) -> float:
    x = _pooled(stats, name)
    return float(np.median(x)) if len(x) else default


def fit_parameters(datas: list[DetectionInput]) -> tuple[dict[str, float], dict[str, str]]:
    """Direct estimates of the model's parameters from real jobs (pooled), and how each was read.
    arrival_jitter_ms is not among them: it is fitted by simulation (synthetic_job.fit)."""
    stats = [job_statistics(d) for d in datas]
    par: dict[str, float] = {}
    how: dict[str, str] = {}
    # Base times: the whole model's forward/backward per microbatch (a stage runs 1/pp of it).
    fwd, bwd, first, lastf = [], [], [], []
    for d in datas:
        c, pp = d.compute, d.sizes["pp"]
        stage = np.array([d.roles[int(r)].pp for r in c["rank"]])
        middle = (stage > 0) & (stage < pp - 1) if pp >= 3 else np.ones(len(stage), dtype=bool)
        for kind, target in ((0, fwd), (1, bwd)):
            target.append(float(np.median(c["busy"][middle & (c["kind"] == kind)])) * pp / _MS)
        if pp >= 3:
            mid = float(np.median(c["busy"][middle]))
            first.append(float(np.median(c["busy"][stage == 0])) / mid)
            lastf.append(float(np.median(c["busy"][stage == pp - 1])) / mid)
    par["forward_ms"], par["backward_ms"] = float(np.median(fwd)), float(np.median(bwd))
    how["forward_ms"] = how["backward_ms"] = ("median forward (backward) busy per microbatch of the middle stages "
                                              "(all stages where pp < 3) x pp, median over the jobs")
    par["first_stage_factor"] = float(np.median(first)) if first else 1.0
    par["last_stage_factor"] = float(np.median(lastf)) if lastf else 1.0
    how["first_stage_factor"] = how["last_stage_factor"] = ("median busy of the first (last) stage / of the middle "
                                                            "stages, jobs with pp >= 3 (1 without)")
    par["first_iteration_factor"] = _median_of(stats, "first_iteration", 1.0)
    how["first_iteration_factor"] = "median over ranks of iteration 0's typical task / the later iterations' (warm-up)"
    # Per-task body: spread within one rank's tasks of one kind in one iteration (groups of
    # `microbatches`, whose median takes out 1 / n of the variance: corrected).
    sigmas, tails = [], []
    for d, s in zip(datas, stats):
        if "task_residual" not in s:
            continue
        n = len(np.unique(d.compute["microbatch"]))
        log_res = np.log(s["task_residual"])
        sigma = robust_sigma(log_res[log_res != 0] if n == 2 else log_res) * np.sqrt(n / max(n - 1, 1))
        sigmas.append(sigma)
        tails.append((log_res, sigma))
    par["task_sigma"] = float(np.median(sigmas)) if sigmas else 0.02
    how["task_sigma"] = ("robust (MAD) sigma of log(busy / median of the same rank, kind and iteration), x sqrt(n/(n-1)) "
                         "for the n microbatches the median is taken over; median over the jobs")
    threshold = 3.0 * par["task_sigma"]
    excess = np.concatenate([lr[lr > threshold] - threshold for lr, _ in tails]) if tails else np.zeros(0)
    total = sum(len(lr) for lr, _ in tails)
    par["task_tail_min"] = float(np.exp(threshold))
    par["task_tail_prob"] = float(len(excess) / total) if total else 0.0
    par["task_tail_alpha"] = float(len(excess) / max(excess.sum(), 1e-9)) if len(excess) else 3.0
    how["task_tail_prob"] = "share of tasks whose log residual (as task_sigma's) exceeds 3 task_sigma"
    how["task_tail_min"] = "exp(3 task_sigma): the Pareto tail's scale"
    how["task_tail_alpha"] = "Hill estimator over those exceedances: n / sum(log(residual / tail_min))"
    # Per-iteration levels: the job-wide part, and each rank's own.
    common = _pooled(stats, "iteration_common")
    rank_level = _pooled(stats, "rank_iteration_level")
    n_tasks = np.median([2 * len(np.unique(d.compute["microbatch"])) for d in datas])
    task_part = (np.pi / 2) * par["task_sigma"] ** 2 / n_tasks  # variance of a median of n_tasks task residuals
    par["iter_common_sigma"] = float(np.sqrt(max(robust_sigma(np.log(common)) ** 2 - task_part / 4, 0.0)))
    par["iter_rank_sigma"] = float(np.sqrt(max(robust_sigma(np.log(rank_level)) ** 2 - task_part, 0.0)))
    how["iter_common_sigma"] = ("robust sigma over iterations of the median over ranks of the per-iteration level "
                                "(iteration 0 left out), less what task noise explains")
    how["iter_rank_sigma"] = ("robust sigma of each rank's per-iteration level less the iteration's median over "
                              "ranks, less the variance of a median of its tasks' noise")
    speeds = _pooled(stats, "rank_speed")
    par["rank_speed_sigma"] = robust_sigma(np.log(speeds)) if len(speeds) >= 3 else 0.0
    how["rank_speed_sigma"] = "robust sigma of log(rank's median task / its same-stage peers'), jobs with peers pooled"
    par["iter_tail_prob"], par["iter_tail_min"], par["iter_tail_alpha"] = 0.0, 1.0, 3.0
    how["iter_tail_prob"] = "0: the CPU runs' outliers are single tasks (task_tail_*)"
    how["iter_tail_min"] = how["iter_tail_alpha"] = "unused (iter_tail_prob 0)"
    # Fixed costs.
    for kind, name in (("TENSOR_MODEL_PARALLEL_GROUP", "tp_allreduce_ms"), ("DATA_PARALLEL_GROUP", "dp_allreduce_ms"),
                       ("MODEL_PARALLEL_GROUP", "mp_allreduce_ms")):
        par[name] = _median_of(stats, f"cost_ms:{kind}", 0.1)
        how[name] = f"median over {kind} instances of end - last arrival"
    costs = [np.log(np.maximum(s[k], 1e-3) / np.median(np.maximum(s[k], 1e-3))) for s in stats for k in s
             if k.startswith("cost_ms:") and len(s[k]) > 3]
    par["collective_cost_sigma"] = robust_sigma(np.concatenate(costs)) if costs else 0.1
    how["collective_cost_sigma"] = "robust sigma of log(cost / its kind's median), all kinds pooled"
    per_task = []
    for d, s in zip(datas, stats):
        if d.sizes["tp"] > 1 and "instances:TENSOR_MODEL_PARALLEL_GROUP" in s:
            groups_tasks = len(d.compute["rank"]) / d.sizes["tp"]
            per_task.append(float(s["instances:TENSOR_MODEL_PARALLEL_GROUP"][0]) / groups_tasks)
    par["tp_collectives_per_task"] = float(np.median(per_task)) if per_task else 2.0
    how["tp_collectives_per_task"] = "TP all-reduce instances / (forward and backward tasks of a TP group)"
    par["p2p_delivery_ms"] = _median_of(stats, "p2p_delivery_ms", 0.05)
    deliveries = _pooled(stats, "p2p_delivery_ms")
    par["p2p_delivery_sigma"] = robust_sigma(np.log(np.maximum(deliveries, 1e-3))) if len(deliveries) else 0.3
    par["p2p_send_ms"] = _median_of(stats, "p2p_send_ms", 0.02)
    par["p2p_bytes"] = _median_of(stats, "p2p_bytes", 4 << 20)
    how["p2p_delivery_ms"] = "median of recv_end - max(send_start, recv_start)"
    how["p2p_delivery_sigma"] = "robust sigma of its log"
    how["p2p_send_ms"] = "median send_end - send_start"
    how["p2p_bytes"] = "median message size"
    par["data_ms"] = _median_of(stats, "data_ms", 0.1)
    par["optimizer_ms"] = _median_of(stats, "optimizer_ms", 1.0)
    data_ms = _pooled(stats, "data_ms")
    par["overhead_sigma"] = robust_sigma(np.log(np.maximum(data_ms, 1e-3))) if len(data_ms) else 0.1
    how["data_ms"] = "median of the first task's start - the iteration's start"
    how["optimizer_ms"] = "median of the iteration's end - the rank's last collective's end"
    how["overhead_sigma"] = "robust sigma of log data_ms"
    return {k: round(float(v), 6) for k, v in par.items()}, how


def fit_gpu_series(busy_ms: list[float], *, skip_first: int = 1) -> tuple[dict[str, float], dict[str, str]]:
    """Per-iteration noise from one rank's per-iteration busy times (a healthy stretch): a
    lognormal body (robust sigma of log busy) and Pareto-tail outlier iterations beyond 4 sigma."""
    x = np.log(np.asarray(busy_ms[skip_first:], dtype=np.float64))
    body = x - np.median(x)
    sigma = robust_sigma(body)
    threshold = 4.0 * sigma
    excess = body[body > threshold] - threshold
    par = {"iter_rank_sigma": sigma, "iter_tail_prob": len(excess) / len(body),
           "iter_tail_min": float(np.exp(threshold)),
           "iter_tail_alpha": float(len(excess) / max(excess.sum(), 1e-9)) if len(excess) else 3.0,
           "first_iteration_factor": float(np.exp(np.log(busy_ms[0]) - np.median(x))) if skip_first else 1.0}
    how = {"iter_rank_sigma": "robust (MAD) sigma of log per-iteration busy",
           "iter_tail_prob": "share of iterations more than 4 sigma above the median",
           "iter_tail_min": "exp(4 sigma)", "iter_tail_alpha": "Hill estimator over those iterations",
           "first_iteration_factor": "iteration 0 / the median iteration"}
    return {k: round(float(v), 6) for k, v in par.items()}, how


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    if not len(a) or not len(b):
        return float("nan")
    points = np.concatenate([a, b])
    return float(np.max(np.abs(np.searchsorted(a, points, "right") / len(a)
                               - np.searchsorted(b, points, "right") / len(b))))


def compare_statistics(real: dict[str, np.ndarray], synthetic: dict[str, np.ndarray]) -> list[dict]:
    """Per fitted distribution present in both: quantiles (QUANTILES) of each and their KS statistic."""
    rows = []
    for name in FITTED:
        a, b = real.get(name, np.zeros(0)), synthetic.get(name, np.zeros(0))
        if not len(a) or not len(b):
            continue
        rows.append({"statistic": name, "real_n": len(a), "synthetic_n": len(b),
                     "real": [float(v) for v in np.percentile(a, QUANTILES)],
                     "synthetic": [float(v) for v in np.percentile(b, QUANTILES)], "ks": ks_statistic(a, b)})
    return rows


def format_comparison(rows: list[dict], title: str = "") -> str:
    head = "/".join(f"p{q}" for q in QUANTILES)
    lines = [title] if title else []
    lines.append(f"{'statistic':<22} {'real ' + head:<40} {'synthetic ' + head:<40} {'KS':>5}")
    for row in rows:
        real = " ".join(f"{v:.3g}" for v in row["real"])
        synthetic = " ".join(f"{v:.3g}" for v in row["synthetic"])
        lines.append(f"{row['statistic']:<22} {real:<40} {synthetic:<40} {row['ks']:5.2f}")
    return "\n".join(lines)
