"""Stage 3, P2P / pipeline: a message's delivery time (from both sides ready to received) and
its effective bandwidth tell a slow link; the time a receiver waited for the producer to be
ready tells a stage that waits for its neighbour from the neighbour that is slow."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.scan.detect.model import DetectionInput

_MAD = 1.4826


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
    links: dict[tuple[int, int], LinkFinding] = {}
    pairs, pair_id = np.unique(np.stack([t["src"], t["dst"]], axis=1), axis=0, return_inverse=True)
    pair_id = pair_id.reshape(-1)
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
    residual = np.zeros(len(delivery))
    baseline_of = np.zeros(len(delivery))
    for index in range(len(pairs)):
        mine = pair_id == index
        for k in (False, True):
            for size in np.unique(size_class[mine & (kind == k)]):
                these = mine & (kind == k) & (size_class == size)
                comparable = ~mine & (np.abs(size_class - size) <= 1)
                others = comparable & (kind == k)
                if not others.any():
                    others = comparable  # no other link carries this direction (PP=2, DP=1): the other links
                if not others.any():
                    continue
                residual[these] = log_delivery[these] - np.median(log_delivery[others])
                baseline_of[these] = np.median(delivery[others])
    for index, (src, dst) in enumerate(pairs):
        mine = pair_id == index
        others = ~mine
        if not others.any():
            continue
        baseline = float(np.median(baseline_of[mine]))
        spread = max(_MAD * float(np.median(np.abs(residual[others] - np.median(residual[others])))), 0.05)
        shift = float(np.median(residual[mine]))
        z = shift / (1.2533 * spread * np.sqrt(1 / mine.sum() + 1 / others.sum()))
        median = float(np.median(delivery[mine]))
        gbps = float(np.median(t["bytes"][mine] / np.maximum(delivery[mine], 1e-6) / 1e6))
        flagged = bool(z > z_link and median - baseline > min_excess_ms and median > min_ratio * max(baseline, 0.05))
        links[(int(src), int(dst))] = LinkFinding(src=int(src), dst=int(dst), messages=int(mine.sum()),
                                                  delivery_ms=median, baseline_ms=baseline, bandwidth_gbps=gbps,
                                                  z=float(z), flagged=flagged)
    producer = {int(r): float(producer_wait[t["src"] == r].sum()) for r in np.unique(t["src"])}
    receiver = {int(r): float(producer_wait[t["dst"] == r].sum()) for r in np.unique(t["dst"])}
    return PipelineStage(links=links, producer_wait_ms=producer, receive_wait_ms=receiver)
