"""Which of the global batch's microbatches each data-parallel replica runs.

The global batch of an iteration is a fixed run of `dp * m` microbatches. Under the even split
replica r runs microbatches [r*m, (r+1)*m); a plan may give the replicas any contiguous shares
that add up to the same total (straggler mitigation gives a slow replica fewer). Whatever the
shares, every replica divides each microbatch's loss by the even split's `m` (the `nominal`
count), so the data-parallel mean of the gradients is the mean over the whole global batch:
the samples and the optimizer step are those of the even split.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MicrobatchPlan:
    shares: tuple[int, ...]  # microbatches of each data-parallel replica, in dp-rank order
    nominal: int  # each replica's count under the even split: the loss divisor

    def __post_init__(self) -> None:
        if sum(self.shares) != self.nominal * len(self.shares):
            raise ValueError(f"shares {list(self.shares)} do not add up to {len(self.shares)} x {self.nominal}")
        if min(self.shares) < 1:
            raise ValueError(f"every replica needs at least one microbatch, got shares {list(self.shares)}")

    @classmethod
    def even(cls, data_parallel_size: int, num_microbatches: int) -> "MicrobatchPlan":
        return cls(shares=(num_microbatches,) * data_parallel_size, nominal=num_microbatches)

    @property
    def is_even(self) -> bool:
        return all(share == self.nominal for share in self.shares)

    @property
    def total(self) -> int:
        return self.nominal * len(self.shares)

    def count(self, dp_rank: int) -> int:
        return self.shares[dp_rank]

    def first(self, dp_rank: int) -> int:
        """The global index of replica `dp_rank`'s first microbatch."""
        return sum(self.shares[:dp_rank])

    def describe(self) -> str:
        return ",".join(str(share) for share in self.shares)
