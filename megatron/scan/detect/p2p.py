"""Stage 3, P2P / pipeline: a message's delivery time (from both sides ready to received) and
its effective bandwidth tell a slow link; the time a receiver waited for the producer to be
ready tells a stage that waits for its neighbour from the neighbour that is slow."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.model import DetectionInput, unique_rows
from megatron.scan.detect.multiplicity import job_threshold
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
    t = data.p2p
    if not len(t["src"]):
        return PipelineStage(links={}, producer_wait_ms={}, receive_wait_ms={},
                             notes=["no matched P2P messages: pipeline links cannot be compared"])
    ready = np.maximum(t["send_start"], t["recv_start"])
    delivery = np.maximum(t["recv_end"] - ready, 0) / 1e6  # ms
    producer_wait = np.maximum(t["send_start"] - t["recv_start"], 0) / 1e6
    pairs, pair_id = unique_rows(np.stack([t["src"], t["dst"]], axis=1))
    log_delivery = np.log(delivery + 0.05)  # 50 µs floor: sub-resolution deliveries are all "instant"
    # A message is compared with messages of its own direction (activations forward, gradients
    # backward) on the other links: a receiver that posted its receive long before the data came
    # sleeps and must be woken, which on a busy host takes milliseconds, so the direction whose
    # receives are posted early (backward, in 1F1B) is slower on every link alike.
    # Only messages of about the same size are compared (within a factor of 2): a link that carries
    # only larger messages (MegaFBD's weight hand-off beside activations and RNG states) is slower
    # without being slow, and one with nothing comparable is not judged.
    kind = t["backward"].astype(bool)
    size_class = np.round(np.log2(np.maximum(t["bytes"].astype(np.float64), 1.0))).astype(np.int64)
    z_link = job_threshold(z_link, len(pairs))
    # Among many links, one link's own messages barely move the median of all comparable ones:
    # with MANY_LINKS or more, each message is compared with the median of every comparable
    # message (its own link's included), computed once, rather than of the others' (one median
    # per link and size, which costs links x messages: 20 s at 1,024 ranks).
    if len(pairs) >= MANY_LINKS:
        links = _pooled_links(t, pairs, pair_id, delivery, log_delivery, kind, size_class, z_link=z_link,
                              min_excess_ms=min_excess_ms, min_ratio=min_ratio)
    else:
        links = _links_against_others(t, pairs, pair_id, delivery, log_delivery, kind, size_class, z_link=z_link,
                                      min_excess_ms=min_excess_ms, min_ratio=min_ratio)
    senders, send_of = np.unique(t["src"], return_inverse=True)
    receivers, receive_of = np.unique(t["dst"], return_inverse=True)
    producer = dict(zip(senders.tolist(), np.bincount(send_of.reshape(-1), weights=producer_wait).tolist()))
    receiver = dict(zip(receivers.tolist(), np.bincount(receive_of.reshape(-1), weights=producer_wait).tolist()))
    return PipelineStage(links=links, producer_wait_ms=producer, receive_wait_ms=receiver)


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


def _pooled_links(t, pairs, pair_id, delivery, log_delivery, kind, size_class, **rule
                  ) -> dict[tuple[int, int], LinkFinding]:
    """Each message against the median of every comparable message of its direction (of either
    direction where none is), one median per (direction, size class); each link's medians at once."""
    residual = np.zeros(len(delivery))
    baseline_of = np.zeros(len(delivery))
    pooled: dict[tuple[bool, int, bool], tuple[float, float] | None] = {}

    def pool(k: bool, size: int, any_kind: bool) -> tuple[float, float] | None:
        key = (k, size, any_kind)
        if key not in pooled:
            comparable = np.abs(size_class - size) <= 1
            chosen = comparable if any_kind else comparable & (kind == k)
            pooled[key] = ((float(np.median(log_delivery[chosen])), float(np.median(delivery[chosen])))
                           if chosen.any() else None)
        return pooled[key]

    classes, class_of = unique_rows(np.column_stack([kind.astype(np.int64), size_class]))
    for j, (k, size) in enumerate(classes.tolist()):
        found = pool(bool(k), int(size), False) or pool(bool(k), int(size), True)
        if found is not None:
            these = class_of == j
            residual[these] = log_delivery[these] - found[0]
            baseline_of[these] = found[1]
    spread = max(_MAD * float(np.median(np.abs(residual - np.median(residual)))), 0.05)
    counts = np.bincount(pair_id, minlength=len(pairs))
    others = len(delivery) - counts
    shift = group_median(residual, pair_id)[1]
    median = group_median(delivery, pair_id)[1]
    baseline = group_median(baseline_of, pair_id)[1]
    gbps = group_median(t["bytes"] / np.maximum(delivery, 1e-6) / 1e6, pair_id)[1]
    z = shift / (1.2533 * spread * np.sqrt(1 / counts + 1 / np.maximum(others, 1)))
    return {(int(src), int(dst)): _link(src, dst, counts[i], median[i], baseline[i], gbps[i], z[i], **rule)
            for i, (src, dst) in enumerate(pairs.tolist()) if others[i]}
