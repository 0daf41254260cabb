"""Straggler mitigation (`--straggler-mitigation`): data-parallel microbatch rebalancing and
pipeline layer-split recommendations from the measured per-rank compute rates."""
