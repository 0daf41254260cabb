"""The combiner: the three stages' findings become one ranked list of suspects (slow ranks and
slow links), each with a confidence and the evidence behind it; victims are explained, not named."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from megatron.scan.detect.collective import ArrivalStage, arrival_order
from megatron.scan.detect.compute import ComputeStage, peer_comparison
from megatron.scan.detect.host import HostStage, host_starvation
from megatron.scan.detect.model import DetectionInput
from megatron.scan.detect.nodes import name_slow_nodes
from megatron.scan.detect.p2p import PipelineStage, pipeline_analysis
from megatron.scan.detect.power import Power, compute_power, leading_candidate
from megatron.scan.detect.suspect import Suspect, one_entry_per_suspect, peer_list


@dataclass(kw_only=True)
class Detection:
    data: DetectionInput
    compute: ComputeStage
    arrival: ArrivalStage
    pipeline: PipelineStage
    host: HostStage
    suspects: list[Suspect]
    # "suspects" | "healthy" (a rank POWER_SLOWDOWN slower would have been named) | "inconclusive"
    # (no suspect, but one could have been missed: see `power`, `leading`, the notes) | "cannot compare"
    verdict: str
    notes: list[str] = field(default_factory=list)
    power: Power | None = None  # what the compute comparison could have seen
    leading: dict | None = None  # the rank that looks slowest short of being named (inconclusive)


Analyzer = Callable[[DetectionInput], Any]


def _add_gpu_readings(data: DetectionInput, suspects: list) -> None:
    """Each suspect rank with NVML readings carries them: why its GPU may be slow (clock against its
    maximum, power against its limit, temperature, the throttle reasons seen, new ECC errors)."""
    from megatron.scan.gpu_counters import explain

    for suspect in suspects:
        summary = data.gpu.get(suspect.ranks[0]) if suspect.kind == "rank" else None
        if summary:
            suspect.evidence.append(explain(summary))
            suspect.details["gpu"] = summary

# A rank starved from an onset on (a change point found among many candidate splits, so more
# often chance than starvation over the whole run) is named by it only if its compute falls
# behind its peers' over the same iterations: STARVED_SLOWER times theirs (median per-iteration
# ratio) and STARVED_SLOWER_Z standard errors clear. A healthy PP=2 x DP=2 run on a loaded 2-core
# CI host had a rank starved from iteration 7 on (5.5x its peers' run-queue wait) whose compute
# stayed at 1.01x its peer's over the run (0.1 standard errors), costing the job nothing; "not
# faster than its peers" named it. Over 84 kept benchmark runs (3 per scenario), the healthy ranks
# starved from an onset stood at 0.97x (-0.25 standard errors) and 1.14x (0.8) from it, the
# throttled ones at 1.25x (1.4) and 1.35x (1.5). A rank starved over the whole run keeps the
# plain rule: a megatron-core PP=2 x DP=2 run's rank throttled from outside (13.7 standard errors
# of starvation) computed 1.11x its peer, 0.5 standard errors of a noise its peers' 2.6x
# imbalance had inflated.
STARVED_SLOWER = 1.1
STARVED_SLOWER_Z = 1.0


def detect(data: DetectionInput, *, compute: Analyzer = peer_comparison, arrival: Analyzer = arrival_order,
           pipeline: Analyzer = pipeline_analysis, host: Analyzer = host_starvation, progress=None) -> Detection:
    """Run the four analyzers (each swappable) and combine their evidence. `progress`: a
    megatron.app.progress.Reporter that counts the analyzers run (default: silent)."""
    if progress is None:
        stage1, stage2, stage3, stage4 = compute(data), arrival(data), pipeline(data), host(data)
    else:
        stages = [analyzer(data) for analyzer in progress.iterate(
            f"analyzing {len(data.world)} ranks (compute, collectives, pipeline, host)",
            [compute, arrival, pipeline, host])]
        stage1, stage2, stage3, stage4 = stages
    notes = [*data.warnings, *stage1.notes, *stage2.notes, *stage3.notes, *stage4.notes]
    suspects: list[Suspect] = []
    starved_ranks = {rank for rank, f in stage4.findings.items() if f.flagged}
    for rank in data.world:
        finding, arrival_finding = stage1.findings.get(rank), stage2.findings.get(rank)
        starved = stage4.findings.get(rank)
        compute_named = finding is not None and finding.flagged
        # CPU starvation names a rank whose compute is not faster than its peers' (a starved rank
        # that nonetheless keeps pace is not what slows the job), that has no peer to compare, or
        # whose peers are all starved too (keeping pace with them clears nobody: two throttled
        # ranks of one stage). Starved only from an onset on, its compute must fall behind from
        # then on (see STARVED_SLOWER).
        host_named = (starved is not None and starved.flagged
                      and (finding is None or finding.method == "history"
                           or all(peer in starved_ranks for peer in finding.peers)
                           or (finding.slowdown >= 1.0 if starved.onset_iteration is None
                               else _falls_behind(finding, starved.onset_iteration))))
        if not (compute_named or host_named):
            continue
        evidence = []
        if finding is not None and finding.method != "history" and finding.onset_iteration is not None:
            evidence.append(f"from iteration {finding.onset_iteration} on, compute {finding.slowdown:.2f}x its earlier "
                            f"standing against its {'peers' if finding.method == 'peers' else 'TP-index peers'} "
                            f"{peer_list(finding.peers)} ({finding.z:.1f} standard errors, slower in every later iteration)")
        elif finding is not None and finding.measure == "typical":
            peers = (f"its peers {peer_list(finding.peers)}" if finding.method == "peers"
                     else f"the other ranks of its TP index {peer_list(finding.peers)} (no same-stage peer)")
            call = "transformer-layer call" if stage1.layer_typical else "forward/backward task"
            evidence.append(f"compute {finding.slowdown:.2f}x {peers} in its typical {call} (median over "
                            f"{finding.iterations} iterations of the median call, {finding.z:.1f} standard errors, "
                            f"slower in {finding.typical_slower_iterations} of {finding.iterations}): slower in "
                            f"every call, as a slower device is; its busy total read "
                            f"{_busy_total_ratio(finding):.2f}x")
        elif finding is not None and finding.method == "peers":
            odds = (f", a median this high by chance {finding.chance:.1g} per job" if finding.chance == finding.chance
                    else "")
            evidence.append(f"compute {finding.slowdown:.2f}x its peers {peer_list(finding.peers)} (median over "
                            f"{finding.iterations} iterations of the busy total, {finding.z:.1f} standard errors{odds}, "
                            f"slower in {finding.slower_iterations} of {finding.iterations}; median task "
                            f"{finding.task_slowdown:.2f}x, {finding.slow_instances} of {finding.instances} tasks "
                            f"individually slow)")
            ops = ", ".join(f"{o['op'][0].upper()}{o['chunk']}.{o['microbatch']}@it{o['iteration']} x{o['slowdown']}"
                            for o in finding.worst_ops[:3])
            evidence.append(f"slowest tasks: {ops}")
        elif finding is not None and finding.method == "layers":
            evidence.append(f"per-layer compute {finding.slowdown:.2f}x the other ranks of its TP index "
                            f"{peer_list(finding.peers)} (no same-stage peer; median over {finding.iterations} iterations of the "
                            f"mean transformer-layer busy time, {finding.z:.1f} standard errors, slower in "
                            f"{finding.slower_iterations} of {finding.iterations})")
        elif finding is not None and finding.onset_iteration is not None:
            evidence.append(f"compute {finding.slowdown:.2f}x its own earlier iterations from iteration "
                            f"{finding.onset_iteration} on ({finding.z:.1f} standard errors; no peer to compare with)")
        if starved is not None and starved.flagged:
            since = f" from iteration {starved.onset_iteration} on" if starved.onset_iteration is not None else ""
            measure = ("its training thread's wait for a CPU per CPU second (as a stretch of its compute)"
                       if starved.training_thread else "all its threads' run-queue wait per CPU second")
            # Named by starvation alone: that line first (the compute comparison only describes).
            evidence.insert(0 if host_named and not compute_named else len(evidence),
                            f"starved of CPU{since}: {starved.ratio:.1f}x {measure} of the other "
                            f"ranks on its host in {starved.starved_iterations} of {starved.iterations} iterations "
                            f"({100 * starved.wait_share:.0f}% of its runnable time spent waiting for a CPU)")
        corroborated = 0.0
        if arrival_finding is not None and arrival_finding.last > arrival_finding.expected_last:
            evidence.append(f"arrived last at {arrival_finding.last} of {arrival_finding.instances} collectives "
                            f"(chance: {arrival_finding.expected_last:.1f}; {arrival_finding.z:.1f} standard errors over "
                            f"{arrival_finding.iterations} iterations); peers waited {arrival_finding.waited_on_ms:.1f} ms "
                            f"in all, {_share(arrival_finding.cost_share)} of an iteration, groups {arrival_finding.groups}")
            corroborated = 1.0 if arrival_finding.flagged else 0.5
        waited = stage3.producer_wait_ms.get(rank)
        if waited:
            evidence.append(f"pipeline neighbours waited {waited:.1f} ms for its messages")
        compute_strength = 1.0 - np.exp(-max(finding.z, 0.0) / 6.0) if compute_named else 0.0
        host_strength = 1.0 - np.exp(-max(starved.z, 0.0) / 6.0) if host_named else 0.0
        confidence = 1.0 - (1.0 - 0.75 * compute_strength) * (1.0 - 0.6 * host_strength) * (1.0 - 0.25 * corroborated)
        slowdown = finding.slowdown if finding is not None and (compute_named or finding.method != "history") else float("nan")
        named_by = [name for name, named in (("compute", compute_named), ("host", host_named),
                                             ("arrival", arrival_finding is not None and arrival_finding.flagged))
                    if named]
        suspects.append(Suspect(kind="rank", ranks=[rank], confidence=round(float(confidence), 3),
                                slowdown=round(slowdown, 3), evidence=evidence, named_by=named_by,
                                details={"compute": json_friendly(finding),
                                         "arrival": json_friendly(arrival_finding),
                                         "host": json_friendly(starved)}))
    # A rank no analyzer could compare, arriving last far more than chance while not waiting on
    # its pipeline producers, is named with low confidence rather than silently missed.
    named = {s.ranks[0] for s in suspects}
    for rank in stage1.cannot_compare:
        arrival_finding = stage2.findings.get(rank)
        if rank in named or arrival_finding is None or not arrival_finding.flagged:
            continue
        if stage3.receive_wait_ms.get(rank, 0.0) > 0.5 * arrival_finding.waited_on_ms:
            continue  # its lateness is explained by waiting for its neighbour
        suspects.append(Suspect(kind="rank", ranks=[rank], confidence=0.35, slowdown=float("nan"),
                                evidence=[f"arrived last at {arrival_finding.last} of {arrival_finding.instances} "
                                          f"collectives (chance {arrival_finding.expected_last:.1f}, "
                                          f"{arrival_finding.z:.1f} standard errors over {arrival_finding.iterations} "
                                          f"iterations; its peers waited {_share(arrival_finding.cost_share)} of an "
                                          f"iteration for it); compute not comparable"],
                                named_by=["arrival"],
                                details={"arrival": json_friendly(arrival_finding)}))
    for (src, dst), link in stage3.links.items():
        if not link.flagged:
            continue
        suspects.append(Suspect(kind="link", ranks=[src, dst],
                                confidence=round(float(1.0 - np.exp(-link.z / 6.0)), 3),
                                slowdown=round(link.delivery_ms / max(link.baseline_ms, 0.05), 3),
                                evidence=[f"messages {src}->{dst} delivered in {link.delivery_ms:.2f} ms (median of "
                                          f"{link.messages}) vs {link.baseline_ms:.2f} ms on other links "
                                          f"({link.bandwidth_gbps:.3f} GB/s effective), {link.z:.1f} standard errors"],
                                named_by=["pipeline"],
                                details={"link": json_friendly(link)}))
    suspects = one_entry_per_suspect(suspects)
    # A slow node first: its ranks are TP peers and pipeline neighbours of each other, and the
    # victim rules below would otherwise keep only some of them, as if each were alone.
    suspects = name_slow_nodes(data, suspects)
    suspects = _drop_tensor_parallel_victims(data, stage2, suspects, notes)
    suspects = _drop_pipeline_victims(data, stage2, stage3, stage4, suspects, notes)
    suspects = _drop_ranks_the_pipeline_does_not_wait_for(data, stage1, stage3, suspects, notes)
    suspects.sort(key=lambda s: (-s.confidence, s.ranks))
    _add_gpu_readings(data, suspects)
    comparable = (any(f.method != "history" for f in stage1.findings.values()) or stage2.instances > 0
                  or len(stage3.links) > 0)
    power = compute_power(stage1)
    leading = None
    if suspects:
        verdict = "suspects"
    elif not comparable:
        verdict = "cannot compare"
    else:
        # No suspect. `healthy` says a rank of the slowdown that matters would have been named;
        # anything short of that is `inconclusive`, with what was missing and the leading candidate.
        unseen = []
        history_only = [r for r, f in stage1.findings.items() if f.method == "history"]
        if history_only:
            unseen.append(f"rank(s) {sorted(history_only)} have no peer and were compared only with their own "
                          f"earlier iterations: a slowdown present from the first traced iteration cannot be seen")
        if stage1.cannot_compare:
            unseen.append(f"the compute of rank(s) {sorted(stage1.cannot_compare)} was compared with nothing")
        trend = job_slowdown_onset(data)
        if trend is not None:
            unseen.append(f"the job slowed {trend[1]:.2f}x from iteration {trend[0]} on (median iteration time), "
                          f"but no rank or link could be named as its source")
        if power is None:
            unseen.append("no rank's compute was compared with a peer's: the slowdown that matters could not be "
                          "measured")
        verdict = "inconclusive" if unseen or power is None or not power.enough else "healthy"
        if verdict == "inconclusive":
            leading = leading_candidate(stage1, stage2)
        notes.extend(unseen)
    if verdict == "cannot compare":
        notes.append("cannot compare: no rank has a peer, a collective partner, a pipeline link or enough history "
                     "(a single rank, DP=TP=PP=1, or traces without compute spans and collectives)")
    return Detection(data=data, compute=stage1, arrival=stage2, pipeline=stage3, host=stage4, suspects=suspects,
                     verdict=verdict, notes=notes, power=power, leading=leading)


def job_slowdown_onset(data: DetectionInput, *, min_slowdown: float = 1.2, z_min: float = 4.0,
                       min_side: int = 3) -> tuple[int, float] | None:
    """(first slow iteration, factor) when the job's iteration time steps up materially and
    significantly within the traced iterations; None otherwise (or too few iterations)."""
    t = data.iteration_time
    if not len(t["rank"]):
        return None
    iterations = np.unique(t["iteration"])
    if len(iterations) < 2 * min_side:
        return None
    duration = (t["end"] - t["start"]).astype(np.float64)
    # The job's time per iteration: the slowest rank's iteration span (everybody waits for it).
    per_iteration = np.log(np.array([max(duration[t["iteration"] == i].max(), 1.0) for i in iterations]))
    noise = max(1.4826 * float(np.median(np.abs(np.diff(per_iteration)))) / np.sqrt(2.0), 0.02)
    best = None
    for split in range(min_side, len(iterations) - min_side + 1):
        shift = float(np.median(per_iteration[split:]) - np.median(per_iteration[:split]))
        z = shift / (1.2533 * noise * np.sqrt(1 / split + 1 / (len(iterations) - split)))
        if best is None or z > best[0]:
            best = (z, split, shift)
    z, split, shift = best
    if z > z_min and np.exp(shift) >= min_slowdown:
        return int(iterations[split]), float(np.exp(shift))
    return None


def _drop_tensor_parallel_victims(data: DetectionInput, stage2: ArrivalStage, suspects: list[Suspect],
                                  notes: list[str]) -> list[Suspect]:
    """A TP peer of a slow rank waits in collectives the tracer cannot time (async all-reduces
    waited on later, shared-host contention), so it can look slower than its other peers too. It
    is a victim when a slower member of its TP group is the one arriving last while it is not."""
    def arrival_z(rank: int) -> float:
        finding = stage2.findings.get(rank)
        return finding.z if finding is not None else 0.0

    kept = []
    for suspect in suspects:
        if suspect.kind == "rank":
            me = data.roles[suspect.ranks[0]]
            culprit = next((other for other in suspects if other.kind == "rank" and other is not suspect
                            and data.roles[other.ranks[0]].dp == me.dp and data.roles[other.ranks[0]].stage == me.stage
                            and other.slowdown > suspect.slowdown and arrival_z(other.ranks[0]) > 1.0
                            and arrival_z(suspect.ranks[0]) <= 1.0), None)
            if culprit is not None:
                notes.append(f"{data.label(suspect.ranks[0])} computes {suspect.slowdown:.2f}x its peers but arrives "
                             f"early at collectives while its TP peer {culprit.ranks[0]} ({culprit.slowdown:.2f}x) "
                             f"arrives last: counted as waiting for it, not named")
                continue
        kept.append(suspect)
    return kept


def _drop_pipeline_victims(data: DetectionInput, stage2: ArrivalStage, stage3: PipelineStage, stage4: HostStage,
                           suspects: list[Suspect], notes: list[str], *, margin: float = 1.5) -> list[Suspect]:
    """A pipeline neighbour of a much slower rank (same DP replica, another stage) runs its work in
    bursts, as the slow rank's messages arrive, and so at the moments it competes hardest for the
    host's CPUs (or, on a GPU, behind receive kernels spinning on its stream): its compute can look
    somewhat slower than its same-stage peers' although nothing is wrong with it. It is a victim
    when the other is `margin` times slower or more, the neighbours waited longer for the other's
    messages than for its own, and it has no evidence of its own (not starved of CPU, not arriving
    last at collectives more than chance allows). Two ranks slow at once in one pipeline are both
    kept when the weaker one has evidence of its own."""
    def own_evidence(rank: int) -> bool:
        # Late at collectives as the arrival analyzer judges it (flagged), not merely more often
        # than even: a rank computing 1.2x its TP peer arrives last in their TP collectives more
        # often for that reason alone (a victim of TP=2 x PP=2's injected rank 2 was last at 180
        # of 336, 1.5 standard errors, 169 of them in its TP group, and was named).
        arrival, starved = stage2.findings.get(rank), stage4.findings.get(rank)
        return bool((arrival is not None and arrival.flagged) or (starved is not None and starved.flagged))

    kept = []
    for suspect in suspects:
        if suspect.kind == "rank" and suspect.slowdown == suspect.slowdown and not own_evidence(suspect.ranks[0]):
            me = data.roles[suspect.ranks[0]]
            culprit = next((other for other in suspects if other.kind == "rank" and other is not suspect
                            and data.roles[other.ranks[0]].dp == me.dp and data.roles[other.ranks[0]].pp != me.pp
                            and data.roles[other.ranks[0]].role == me.role
                            and other.slowdown >= margin * suspect.slowdown
                            and stage3.producer_wait_ms.get(other.ranks[0], 0.0)
                            > stage3.producer_wait_ms.get(suspect.ranks[0], 0.0)), None)
            if culprit is not None:
                notes.append(f"{data.label(suspect.ranks[0])} computes {suspect.slowdown:.2f}x its peers but shares a "
                             f"pipeline with rank {culprit.ranks[0]} ({culprit.slowdown:.2f}x), whose messages its "
                             f"neighbours waited for longer, and has no evidence of its own (not starved of CPU, not "
                             f"late at collectives): counted as running in the slow rank's bursts, not named")
                continue
        kept.append(suspect)
    return kept


def _drop_ranks_the_pipeline_does_not_wait_for(data: DetectionInput, stage1: ComputeStage, stage3: PipelineStage,
                                               suspects: list[Suspect], notes: list[str]) -> list[Suspect]:
    """A rank with no same-stage peer (PP-only) is compared across stages, layer by layer, or with
    its own history; work and CPU contention differ between stages (on a shared host the first
    stage of a healthy PP=4 run computed its layers 1.42x the others', 7.9 standard errors, and waited
    for a CPU twice as long). What holds a pipeline up is the stage the others wait for: such a
    rank is named only if its neighbours waited for its messages at least as long as for any other
    rank's of its pipeline (same DP replica). Rank 1 slowed 1.25x in PP=4 had its neighbours wait
    2.2-2.9 s for it against at most 1.4-2.0 s for the others; the healthy first stage above, 0.7 s
    against 1.8 s."""
    if not any(stage3.producer_wait_ms.values()):
        return suspects
    kept = []
    for suspect in suspects:
        finding = stage1.findings.get(suspect.ranks[0]) if suspect.kind == "rank" else None
        if suspect.kind == "rank" and (finding is None or finding.method != "peers"):
            me = data.roles[suspect.ranks[0]]
            waited = stage3.producer_wait_ms.get(suspect.ranks[0], 0.0)
            others = {r: stage3.producer_wait_ms.get(r, 0.0) for r, role in data.roles.items()
                      if r != suspect.ranks[0] and role.dp == me.dp and role.tp == me.tp and role.pp != me.pp}
            held_up_by = max(others, key=others.get, default=None)
            if held_up_by is not None and others[held_up_by] > waited:
                notes.append(f"{data.label(suspect.ranks[0])} has no same-stage peer and looks slow "
                             f"({suspect.evidence[0]}), but its pipeline waited longer for rank {held_up_by}'s "
                             f"messages ({others[held_up_by]:.0f} ms) than for its own ({waited:.0f} ms): "
                             f"it is not what holds the pipeline up, not named")
                continue
        kept.append(suspect)
    return kept


def _share(value: float) -> str:
    return "an unknown share" if value != value else f"{100 * value:.0f}%"


def _busy_total_ratio(finding) -> float:
    """The median per-iteration ratio of a finding's busy totals to its peers' (its series')."""
    return float(np.exp(np.median(finding.series))) if len(finding.series) else float("nan")


def _falls_behind(finding, since: int) -> bool:
    """Its compute at least STARVED_SLOWER times its peers' from iteration `since` on, and
    STARVED_SLOWER_Z standard errors clear (False with no such iteration compared)."""
    judged = finding.since(since)
    return judged is not None and judged[0] >= STARVED_SLOWER and judged[1] >= STARVED_SLOWER_Z


_AS_IS = (int, str, bool)


def json_friendly(obj: Any) -> Any:
    """Dataclass -> JSON-friendly dict (floats rounded)."""
    if obj is None or type(obj) in _AS_IS:  # most values, answered before the slower tests below
        return obj
    if hasattr(obj, "__dataclass_fields__"):
        return {k: json_friendly(getattr(obj, k)) for k, f in obj.__dataclass_fields__.items()
                if not f.metadata.get("internal")}
    if isinstance(obj, dict):
        return {str(k): json_friendly(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # lists of one type (a rank's peers, a series): no call per value
        if all(type(v) in _AS_IS for v in obj):
            return list(obj)
        if all(type(v) is float for v in obj):
            return [None if v != v else round(v, 4) for v in obj]
        return [json_friendly(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return None if value != value else round(value, 4)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
