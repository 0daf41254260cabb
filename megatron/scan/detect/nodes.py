"""A slow node named as the node: the ranks of one host named together become one suspect."""
from __future__ import annotations

import numpy as np

from megatron.scan.detect.model import DetectionInput
from megatron.scan.detect.suspect import Suspect

# A host is named as the suspect, in place of its ranks, when at least this share of its ranks
# (and two or more) are named, alike (the slowest at most NODE_SPREAD times the least slow: one
# slow device among victims that merely look slow is not a slow node), and the job spans more
# than one host: a slow node (its power, cooling, NIC or data loader shared by every GPU on it)
# is one fault to fix, not eight.
NODE_SHARE = 0.75
NODE_SPREAD = 1.15


def name_slow_nodes(data: DetectionInput, suspects: list[Suspect]) -> list[Suspect]:
    """Ranks named on one host that make up NODE_SHARE of it become one node suspect."""
    members: dict[str, list[int]] = {}
    for rank, role in data.roles.items():
        members.setdefault(role.host, []).append(rank)
    if len(members) < 2:
        return suspects
    named: dict[str, list[Suspect]] = {}
    for suspect in suspects:
        if suspect.kind == "rank":
            named.setdefault(data.roles[suspect.ranks[0]].host, []).append(suspect)
    nodes: dict[int, Suspect] = {}  # id of the host's first named rank's entry -> the node entry
    folded: set[int] = set()
    for host, entries in named.items():
        ranks = sorted(members[host])
        if len(entries) < 2 or len(entries) < NODE_SHARE * len(ranks):
            continue
        slowdowns = [e.slowdown for e in entries if e.slowdown == e.slowdown]
        if slowdowns and max(slowdowns) > NODE_SPREAD * min(slowdowns):
            continue
        slowdown = float(np.median(slowdowns)) if slowdowns else float("nan")
        shown = f"{slowdown:.2f}x their peers" if slowdown == slowdown else "slowdown not measurable"
        evidence = [f"{len(entries)} of the {len(ranks)} ranks of host {host} are named slow (median {shown}): "
                    f"the node, not one device"]
        evidence += [f"rank {e.ranks[0]}: {e.evidence[0]}" for e in entries[:3]]
        node = Suspect(kind="node", ranks=ranks, confidence=max(e.confidence for e in entries),
                       slowdown=round(slowdown, 3) if slowdown == slowdown else slowdown, evidence=evidence,
                       named_by=sorted({n for e in entries for n in e.named_by}),
                       details={"host": host, "named_ranks": sorted(e.ranks[0] for e in entries),
                                "slowdowns": {str(e.ranks[0]): e.slowdown for e in entries}})
        nodes[id(entries[0])] = node
        folded.update(id(e) for e in entries)
    if not nodes:
        return suspects
    return [nodes[id(s)] if id(s) in nodes else s for s in suspects if id(s) in nodes or id(s) not in folded]
