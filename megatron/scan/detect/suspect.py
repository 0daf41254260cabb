"""What detection names: a slow rank, a slow link or a slow node, with its evidence."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron.scan.detect.model import DetectionInput
from megatron.scan.hang import rank_ranges


# Peers listed one by one in evidence up to this many; more read as a count and rank ranges
# (a stage of a 4,096-rank job has 511 peers).
LISTED_PEERS = 8


def peer_list(peers: list[int]) -> str:
    """[1, 2, 3] as it reads in evidence; many peers as '511 ranks (2560-2809,2811-3071)'."""
    if len(peers) <= LISTED_PEERS:
        return str(list(peers))
    return f"{len(peers)} ranks ({rank_ranges(peers)})"


@dataclass(kw_only=True)
class Suspect:
    kind: str  # "rank" | "link" | "node" (every rank of one host: details["host"])
    ranks: list[int]
    confidence: float
    slowdown: float
    evidence: list[str]  # the first line is what named it
    details: dict[str, Any] = field(default_factory=dict)
    what_if: dict[str, float] | None = None
    # The analyzers whose own test named it ("compute", "host", "arrival", "pipeline"): a suspect
    # two independent analyzers agree on is better founded than one only a single test found.
    named_by: list[str] = field(default_factory=list)

    def describe(self, data: DetectionInput) -> str:
        """What is named, for a person: a rank with its coordinates, a link, or a node."""
        if self.kind == "rank":
            return data.label(self.ranks[0])
        if self.kind == "node":
            return f"node {self.details.get('host', '?')} ({len(self.ranks)} ranks: {rank_ranges(self.ranks)})"
        return f"link {self.ranks[0]} -> {self.ranks[1]}"


def one_entry_per_suspect(suspects: list[Suspect]) -> list[Suspect]:
    """A rank or link two analyzers reached by different routes is one suspect: the first entry
    keeps its place, takes the other's evidence it lacks, the union of who named it and the
    higher confidence."""
    merged: dict[tuple[str, tuple[int, ...]], Suspect] = {}
    for suspect in suspects:
        key = (suspect.kind, tuple(suspect.ranks))
        first = merged.get(key)
        if first is None:
            merged[key] = suspect
            continue
        first.evidence.extend(e for e in suspect.evidence if e not in first.evidence)
        first.named_by.extend(n for n in suspect.named_by if n not in first.named_by)
        first.confidence = max(first.confidence, suspect.confidence)
        for name, value in suspect.details.items():
            first.details.setdefault(name, value)
    return list(merged.values())
