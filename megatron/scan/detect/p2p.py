"""Stage 3, P2P / pipeline: a message's delivery time (from both sides ready to received) and
its effective bandwidth tell a slow link; the time a receiver waited for the producer to be
ready tells a stage that waits for its neighbour from the neighbour that is slow."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.model import DetectionInput, table_rows, unique_rows
from megatron.scan.detect.multiplicity import job_threshold
from megatron.scan.detect.reference import reference_ranks, sampled
from megatron.scan.detect.typical import group_median

_MAD = 1.4826
# Links from which a message is compared with the pooled median of every comparable message.
MANY_LINKS = 32


@dataclass(kw_only=True)
class LinkFinding:
    src: int
    dst: int
    messages: int
    delivery_ms: float  # median
    baseline_ms: float  # median over the other links
    bandwidth_gbps: float
    z: float
    flagged: bool


@dataclass(kw_only=True)
class PipelineStage:
    links: dict[tuple[int, int], LinkFinding]
    producer_wait_ms: dict[int, float]  # rank -> total time its receivers waited for it to send
    receive_wait_ms: dict[int, float]  # rank -> total time it waited for its producers
    notes: list[str] = field(default_factory=list)


def pipeline_analysis(data: DetectionInput, *, z_link: float = 4.0, min_excess_ms: float = 2.0,
                      min_ratio: float = 3.0) -> PipelineStage:
    """Each link's deliveries against comparable messages on the other links. With
    `data.link_stats` (a large job's per-node reductions: reduce_links, merge_link_stats) the
    links are judged from those; a job of few links, none of whose stages is sampled, compares each
    link with the others' messages; any other job pools the reference messages (link_plan) and
    reduces every message against the pool (reduce_links), as the nodes would, so that the full
    and per-node analyses give the same findings."""
    t = data.p2p
    rule = {"min_excess_ms": min_excess_ms, "min_ratio": min_ratio}
    stats = data.link_stats
    if stats is not None and len(stats["links"]["src"]):
        return _stage(stats, judge_links(stats, stats["spread"], z_link=z_link, **rule))
    if stats is not None or not len(t["src"]):
        return PipelineStage(links={}, producer_wait_ms={}, receive_wait_ms={},
                             notes=["no matched P2P messages: pipeline links cannot be compared"])
    large = sampled(data.roles)
    if not large:
        pairs, pair_id = unique_rows(np.stack([t["src"], t["dst"]], axis=1))
    # Among many links, one link's own messages barely move the median of all comparable ones:
    # with MANY_LINKS or more (or a sampled stage, whose links rank 0 does not all hold), each
    # message is compared with the median of every comparable reference message (its own link's
    # included), computed once, rather than of the others' (one median per link and size, which
    # costs links x messages: 20 s at 1,024 ranks).
    if large or len(pairs) >= MANY_LINKS:
        # Unless a stage is sampled, every rank is a reference rank: the whole table is the reference.
        reference = table_rows(t, np.isin(t["dst"], reference_ranks(data.roles))) if large else t
        plan = link_plan(reference, link_classes(t))
        stats = merge_link_stats([reduce_links(t, plan)])
        return _stage(stats, judge_links(stats, plan["spread"], z_link=z_link, **rule))
    delivery, log_delivery = _delivery(t)
    kind, size_class = _classes_of(t)
    links = _links_against_others(t, pairs, pair_id, delivery, log_delivery, kind.astype(bool), size_class,
                                  z_link=job_threshold(z_link, len(pairs)), **rule)
    return _stage(reduce_links(t, None), links)


def _stage(stats: dict, links: dict[tuple[int, int], LinkFinding]) -> PipelineStage:
    def per_rank(table: dict[str, np.ndarray]) -> dict[int, float]:
        return dict(zip(table["rank"].tolist(), table["ms"].tolist()))

    return PipelineStage(links=links, producer_wait_ms=per_rank(stats["producer_wait"]),
                         receive_wait_ms=per_rank(stats["receive_wait"]))


def _delivery(t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per message: delivery ms (from both sides ready to received) and its log."""
    ready = np.maximum(t["send_start"], t["recv_start"])
    delivery = np.maximum(t["recv_end"] - ready, 0) / 1e6  # ms
    return delivery, np.log(delivery + 0.05)  # 50 µs floor: sub-resolution deliveries are all "instant"


def _classes_of(t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per message: (kind, size class).
    A message is compared with messages of its own direction (activations forward, gradients
    backward) on the other links: a receiver that posted its receive long before the data came
    sleeps and must be woken, which on a busy host takes milliseconds, so the direction whose
    receives are posted early (backward, in 1F1B) is slower on every link alike.
    Only messages of about the same size are compared (within a factor of 2): a link that carries
    only larger messages (MegaFBD's weight hand-off beside activations and RNG states) is slower
    without being slow, and one with nothing comparable is not judged."""
    kind = t["backward"].astype(bool).astype(np.int64)
    size_class = np.round(np.log2(np.maximum(t["bytes"].astype(np.float64), 1.0))).astype(np.int64)
    return kind, size_class


def link_classes(t: dict[str, np.ndarray]) -> np.ndarray:
    """The distinct (kind, size class) rows of a P2P table, int64 [n, 2]: what a node's messages
    need pooled medians for (round 1 of the per-node analysis)."""
    if not len(t["src"]):
        return np.zeros((0, 2), dtype=np.int64)
    return unique_rows(np.column_stack(_classes_of(t)))[0]


def link_plan(reference: dict[str, np.ndarray], classes: np.ndarray) -> dict:
    """At rank 0, from the reference messages: per (kind, size class) row of `classes` (and of the
    reference's own), the pooled medians of log delivery and delivery over comparable messages
    (size class within 1) of the same direction, else of either (nan: none comparable); and the
    spread of the reference messages' residuals around them, which every link's shift is judged
    by. Small: broadcast to the nodes (reduce_links): {"keys": each class's size class x 2 + kind,
    sorted; "log_median", "median": its pooled medians (nan: nothing comparable); "spread"}."""
    delivery, log_delivery = _delivery(reference)
    kind, size_class = _classes_of(reference)
    classes = np.asarray(classes, dtype=np.int64).reshape(-1, 2)
    keys = np.unique(np.concatenate([_class_key(classes[:, 0], classes[:, 1]), _class_key(kind, size_class)]))
    log_median, median = np.full(len(keys), np.nan), np.full(len(keys), np.nan)
    pooled: dict[tuple[int, int, bool], tuple[float, float] | None] = {}

    def pool(k: int, size: int, any_kind: bool) -> tuple[float, float] | None:
        if (k, size, any_kind) not in pooled:
            comparable = np.abs(size_class - size) <= 1
            chosen = comparable if any_kind else comparable & (kind == k)
            pooled[k, size, any_kind] = ((float(np.median(log_delivery[chosen])), float(np.median(delivery[chosen])))
                                         if chosen.any() else None)
        return pooled[k, size, any_kind]

    for j, key in enumerate(keys.tolist()):
        found = pool(key & 1, key >> 1, False) or pool(key & 1, key >> 1, True)
        if found is not None:
            log_median[j], median[j] = found
    plan = {"keys": keys, "log_median": log_median, "median": median, "spread": 0.05}
    residual = _residuals(plan, log_delivery, kind, size_class)[0]
    if len(residual):
        plan["spread"] = max(_MAD * float(np.median(np.abs(residual - np.median(residual)))), 0.05)
    return plan


def _class_key(kind: np.ndarray, size_class: np.ndarray) -> np.ndarray:
    # Size classes are log2 of bytes (>= 0): one int64 per class, the direction in the low bit.
    return size_class.astype(np.int64) * 2 + kind.astype(np.int64)


def _residuals(plan: dict, log_delivery: np.ndarray, kind: np.ndarray, size_class: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Per message: log delivery less its class's pooled median, and the pooled delivery median
    (its baseline); both 0 for a message with nothing comparable (not judged against anything)."""
    key = _class_key(kind, size_class)
    at = np.minimum(np.searchsorted(plan["keys"], key), max(len(plan["keys"]) - 1, 0))
    found = np.zeros(len(key), dtype=bool)
    if len(plan["keys"]):
        found = (plan["keys"][at] == key) & ~np.isnan(plan["log_median"][at])
    residual, baseline_of = np.zeros(len(key)), np.zeros(len(key))
    residual[found] = log_delivery[found] - plan["log_median"][at[found]]
    baseline_of[found] = plan["median"][at[found]]
    return residual, baseline_of


LINK_COLUMNS = ("src", "dst", "messages", "shift", "delivery_ms", "baseline_ms", "gbps")


def reduce_links(t: dict[str, np.ndarray], plan: dict | None) -> dict[str, dict[str, np.ndarray]]:
    """On a node, over the messages its ranks received: per link (src, dst) the message count and
    the medians the judgement needs (residual: `shift`; delivery; baseline; bandwidth), and the
    producer wait (how long a receiver waited for its sender to be ready) summed per sender
    ("producer_wait") and per receiver ("receive_wait"). Without a plan, the waits only."""
    producer_wait = np.maximum(t["send_start"] - t["recv_start"], 0) / 1e6
    (senders, send_of), (receivers, receive_of) = (unique_rows(np.asarray(t[c])[:, None]) for c in ("src", "dst"))
    out = {"producer_wait": {"rank": senders[:, 0].astype(np.int64),
                             "ms": np.bincount(send_of, weights=producer_wait, minlength=len(senders))},
           "receive_wait": {"rank": receivers[:, 0].astype(np.int64),
                            "ms": np.bincount(receive_of, weights=producer_wait, minlength=len(receivers))}}
    if plan is None:
        return out
    if not len(t["src"]):
        return {**out, "links": _no_links()}
    delivery, log_delivery = _delivery(t)
    residual, baseline_of = _residuals(plan, log_delivery, *_classes_of(t))
    gbps = t["bytes"] / np.maximum(delivery, 1e-6) / 1e6
    pairs, pair_id = unique_rows(np.stack([t["src"], t["dst"]], axis=1))
    # The rows in link order once: each median's own sort of the link ids then finds them sorted
    # (a median does not depend on the order of its values).
    by_link = np.argsort(pair_id, kind="stable")
    pair_id, residual, delivery, baseline_of, gbps = (a[by_link] for a in
                                                      (pair_id, residual, delivery, baseline_of, gbps))
    out["links"] = {"src": pairs[:, 0].astype(np.int64), "dst": pairs[:, 1].astype(np.int64),
                    "messages": np.bincount(pair_id, minlength=len(pairs)),
                    "shift": group_median(residual, pair_id)[1], "delivery_ms": group_median(delivery, pair_id)[1],
                    "baseline_ms": group_median(baseline_of, pair_id)[1], "gbps": group_median(gbps, pair_id)[1]}
    return out


def _no_links() -> dict[str, np.ndarray]:
    return {c: np.zeros(0, dtype=np.int64 if c in ("src", "dst", "messages") else np.float64) for c in LINK_COLUMNS}


def merge_link_stats(parts: list[dict]) -> dict:
    """On rank 0, the nodes' reduce_links as one: the links are disjoint (a node reduces the
    messages its ranks received), a sender's producer wait is summed over the nodes it sent to."""
    parts = [{"links": _no_links(), **{name: {"rank": np.zeros(0, dtype=np.int64), "ms": np.zeros(0)}
                                       for name in ("producer_wait", "receive_wait")}}, *parts]
    out = {"links": {c: np.concatenate([p["links"][c] for p in parts]) for c in LINK_COLUMNS}}
    for name in ("producer_wait", "receive_wait"):
        ranks, of = np.unique(np.concatenate([p[name]["rank"] for p in parts]), return_inverse=True)
        ms = np.concatenate([p[name]["ms"] for p in parts])
        out[name] = {"rank": ranks, "ms": np.bincount(of.reshape(-1), weights=ms, minlength=len(ranks))}
    return out


def judge_links(stats: dict, spread: float, *, z_link: float, min_excess_ms: float, min_ratio: float
                ) -> dict[tuple[int, int], LinkFinding]:
    """Each link's median residual against the spread of one message's (scaled to the standard
    error of a median of its messages against one of all the others'); a link with no other
    messages in the job has nothing to be compared with."""
    links = stats["links"]
    order = np.lexsort((links["dst"], links["src"]))
    counts = links["messages"][order]
    others = int(counts.sum()) - counts
    z = links["shift"][order] / (1.2533 * spread * np.sqrt(1 / counts + 1 / np.maximum(others, 1)))
    z_link = job_threshold(z_link, len(counts))
    columns = [links[c][order].tolist() for c in LINK_COLUMNS if c != "shift"]
    return {(int(src), int(dst)): _link(src, dst, n, median, baseline, gbps, zi, z_link=z_link,
                                        min_excess_ms=min_excess_ms, min_ratio=min_ratio)
            for (src, dst, n, median, baseline, gbps), zi, other in zip(zip(*columns), z.tolist(), others.tolist())
            if other}


def _link(src, dst, messages, delivery_ms, baseline_ms, gbps, z, *, z_link, min_excess_ms, min_ratio) -> LinkFinding:
    return LinkFinding(src=int(src), dst=int(dst), messages=int(messages), delivery_ms=float(delivery_ms),
                       baseline_ms=float(baseline_ms), bandwidth_gbps=float(gbps), z=float(z),
                       flagged=bool(z > z_link and delivery_ms - baseline_ms > min_excess_ms
                                    and delivery_ms > min_ratio * max(baseline_ms, 0.05)))


def _links_against_others(t, pairs, pair_id, delivery, log_delivery, kind, size_class, **rule
                          ) -> dict[tuple[int, int], LinkFinding]:
    """Each link's messages against the median of comparable messages on the other links."""
    residual = np.zeros(len(delivery))
    baseline_of = np.zeros(len(delivery))
    by_pair = np.argsort(pair_id, kind="stable")
    bounds = np.searchsorted(pair_id[by_pair], np.arange(len(pairs) + 1))
    rows_of = [by_pair[bounds[i]:bounds[i + 1]] for i in range(len(pairs))]
    for index in range(len(pairs)):
        rows = rows_of[index]
        for k in (False, True):
            directed = rows[kind[rows] == k]
            for size in np.unique(size_class[directed]):
                these = directed[size_class[directed] == size]
                comparable = (pair_id != index) & (np.abs(size_class - size) <= 1)
                others = comparable & (kind == k)
                if not others.any():
                    others = comparable  # no other link carries this direction (PP=2, DP=1): the other links
                if not others.any():
                    continue
                residual[these] = log_delivery[these] - np.median(log_delivery[others])
                baseline_of[these] = np.median(delivery[others])
    links = {}
    for index, (src, dst) in enumerate(pairs):
        rows = rows_of[index]
        n_others = len(delivery) - len(rows)
        if not n_others:
            continue
        others = pair_id != index
        spread = max(_MAD * float(np.median(np.abs(residual[others] - np.median(residual[others])))), 0.05)
        shift = float(np.median(residual[rows]))
        z = shift / (1.2533 * spread * np.sqrt(1 / len(rows) + 1 / n_others))
        gbps = np.median(t["bytes"][rows] / np.maximum(delivery[rows], 1e-6) / 1e6)
        links[(int(src), int(dst))] = _link(src, dst, len(rows), np.median(delivery[rows]),
                                            np.median(baseline_of[rows]), gbps, z, **rule)
    return links
