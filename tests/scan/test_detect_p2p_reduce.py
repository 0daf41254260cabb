"""The P2P link analysis scaled out: each node reduces the messages its ranks received to a few
numbers per link (p2p.reduce_links, against rank 0's plan from the reference ranks' messages) and
rank 0 judges the links from those; the full analysis of one process runs the same functions, so
both name the same links with the same numbers."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron.scan.detect.p2p import (
    MANY_LINKS,
    link_classes,
    link_plan,
    merge_link_stats,
    pipeline_analysis,
    reduce_links,
)
from megatron.scan.detect.reference import reference_ranks, sampled
from megatron.scan.synthetic_job import Fault, JobSpec, synthesize

RANKS_PER_NODE = 8


def slow_link_job(tp: int, pp: int, dp: int, seed: int, link: tuple[int, int, int] | None):
    """A synthetic job; `link` (dp, pp, tp): the link from that rank to the same (dp, tp) of the next
    stage 30x slower. Returns (input, slow link or None)."""
    spec = JobSpec(tp=tp, pp=pp, dp=dp, ranks_per_node=RANKS_PER_NODE, iterations=6, seed=seed)
    if link is None:
        return synthesize(spec)[0], None
    d, p, t = link
    slow = (spec.rank(d, p, t), spec.rank(d, p + 1, t))
    return synthesize(replace(spec, faults=(Fault("slow_link", ranks=slow, factor=30.0),)))[0], slow


def rows(t: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    return {c: v[keep] for c, v in t.items()}


def per_node(data):
    """The per-node rounds in one process: classes from every node, rank 0's plan from the
    reference messages, each node's reduction of the messages it received, merged at rank 0; and
    the input rank 0 then analyses (the reference messages and the merged reductions)."""
    t = data.p2p
    node = t["dst"] // RANKS_PER_NODE
    parts = [rows(t, node == n) for n in np.unique(node)]
    reference = rows(t, np.isin(t["dst"], reference_ranks(data.roles)))
    plan = link_plan(reference, np.unique(np.concatenate([link_classes(p) for p in parts]), axis=0))
    stats = merge_link_stats([reduce_links(p, plan) for p in parts])
    stats["spread"] = plan["spread"]
    return replace(data, p2p=reference, link_stats=stats)


def flagged(stage) -> list[tuple[int, int]]:
    return sorted(k for k, v in stage.links.items() if v.flagged)


@pytest.mark.parametrize("seed", [1, 2])
def test_per_node_reductions_judged_at_rank_0_give_the_full_analysis_and_name_the_slow_link(seed):
    # 1,024 ranks: stages of 128, compared with 64 reference ranks each.
    data, slow = slow_link_job(8, 8, 16, seed, (5, 2, 3))
    assert sampled(data.roles)
    full = pipeline_analysis(data)
    combined = per_node(data)
    assert len(combined.p2p["src"]) < len(data.p2p["src"])  # rank 0 holds the reference messages only
    node = pipeline_analysis(combined)
    assert len(full.links) == 2 * 7 * 128  # every link both ways, though rank 0 held a sample of the messages
    assert node.links == full.links  # same links, same numbers
    assert flagged(full) == [slow]
    assert node.receive_wait_ms == full.receive_wait_ms  # a receiver's messages are all on its node
    # A sender's producer wait is summed over the nodes it sent to: equal but for rounding.
    assert node.producer_wait_ms.keys() == full.producer_wait_ms.keys()
    assert np.allclose(list(node.producer_wait_ms.values()), list(full.producer_wait_ms.values()), rtol=1e-9)


def test_a_healthy_sampled_job_names_no_link():
    data, _ = slow_link_job(8, 8, 16, 3, None)
    assert flagged(pipeline_analysis(data)) == []
    assert flagged(pipeline_analysis(per_node(data))) == []


def test_a_small_job_names_its_slow_link_alone_either_way():
    # 64 ranks, 96 links: pooled, every rank a reference rank, so both paths are one computation.
    data, slow = slow_link_job(2, 4, 8, seed=4, link=(3, 1, 1))
    full = pipeline_analysis(data)
    assert not sampled(data.roles) and len(full.links) >= MANY_LINKS
    assert flagged(full) == [slow]
    assert pipeline_analysis(per_node(data)).links == full.links


def test_the_pooled_judgement_is_the_rule_written_out():
    # Each message against the median of every comparable message (same direction, size within a
    # factor of 2), the spread of all residuals, each link's median residual against it.
    data, slow = slow_link_job(2, 4, 8, seed=5, link=(6, 2, 0))
    t = data.p2p
    delivery = (t["recv_end"] - np.maximum(t["send_start"], t["recv_start"])).clip(0) / 1e6
    log_delivery = np.log(delivery + 0.05)
    size = np.round(np.log2(t["bytes"].clip(1)))
    residual = np.empty(len(delivery))
    for i in range(len(delivery)):  # every message of a class shares its pool: one per class
        if i == 0 or (t["backward"][i], size[i]) != (t["backward"][i - 1], size[i - 1]):
            pool = (t["backward"] == t["backward"][i]) & (np.abs(size - size[i]) <= 1)
            centre = np.median(log_delivery[pool])
        residual[i] = log_delivery[i] - centre
    spread = max(1.4826 * np.median(np.abs(residual - np.median(residual))), 0.05)
    stage = pipeline_analysis(data)
    assert flagged(stage) == [slow]
    for (src, dst), finding in stage.links.items():
        mine = (t["src"] == src) & (t["dst"] == dst)
        n = int(mine.sum())
        z = np.median(residual[mine]) / (1.2533 * spread * np.sqrt(1 / n + 1 / (len(delivery) - n)))
        assert finding.messages == n and finding.z == pytest.approx(z, rel=1e-9, abs=1e-9)
        assert finding.delivery_ms == pytest.approx(np.median(delivery[mine]), rel=1e-12)


def test_a_job_of_few_links_compares_each_with_the_others_messages():
    # 4 ranks, 4 links: a quarter of the messages are the slow link's, which a pool of every
    # message would hold; each link is compared with the other links' messages instead.
    data, slow = slow_link_job(1, 2, 2, seed=4, link=(1, 0, 0))
    stage = pipeline_analysis(data)
    assert len(stage.links) < MANY_LINKS and flagged(stage) == [slow]
    assert stage.links[slow].baseline_ms < stage.links[slow].delivery_ms / 3


def test_a_senders_producer_wait_is_added_over_the_nodes_it_sent_to():
    # Rank 0 sends to ranks 8 (node 1) and 16 (node 2), waited for 2 ms and 3 ms.
    ms = 1_000_000

    def message(src, dst, wait):
        return {"src": np.array([src]), "dst": np.array([dst]), "iteration": np.array([0]), "backward": np.array([0]),
                "send_start": np.array([wait * ms]), "send_end": np.array([wait * ms + ms]),
                "recv_start": np.array([0]), "recv_end": np.array([wait * ms + ms]), "bytes": np.array([1 << 20])}

    parts = [message(0, 8, 2), message(0, 16, 3)]
    plan = link_plan(parts[0], link_classes(parts[1]))
    merged = merge_link_stats([reduce_links(p, plan) for p in parts])
    data, _ = slow_link_job(1, 2, 2, 0, None)  # any job's roles: rank 0 reads the merged reductions
    stage = pipeline_analysis(replace(data, p2p=parts[0], link_stats={**merged, "spread": plan["spread"]}))
    assert stage.producer_wait_ms == {0: 5.0} and stage.receive_wait_ms == {8: 2.0, 16: 3.0}
    assert merged["links"]["src"].tolist() == [0, 0] and merged["links"]["dst"].tolist() == [8, 16]
