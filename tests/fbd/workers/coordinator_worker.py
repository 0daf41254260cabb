"""Worker: threads in each process issue seeded random interleavings of all-reduces over
overlapping groups through the CommunicationCoordinator; every result is checked."""
import argparse
import json
import random
import threading

import torch
import torch.distributed as dist

from megatron.fbd.coordinator import CommunicationCoordinator


def make_trial(rng: random.Random, world: int, threads: int) -> tuple[list, list]:
    members = [(r, t) for r in range(world) for t in range(threads)]
    groups = []
    for _ in range(rng.randint(2, 6)):
        groups.append(sorted(rng.sample(members, rng.randint(2, len(members)))))
    # A random global order of collective instances; each thread runs its own projection of it,
    # so the programs interleave groups differently per thread but are never cyclic.
    instances = [rng.randrange(len(groups)) for _ in range(rng.randint(5, 25))]
    return groups, instances


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    summary = {"trials": 0, "collectives": 0, "rounds": 0, "orders": []}
    for trial in range(args.trials):
        rng = random.Random(args.seed * 10_000 + trial)
        groups, instances = make_trial(rng, world, args.threads)
        coordinator = CommunicationCoordinator(groups)
        errors: list[str] = []

        def thread_body(slot: int) -> None:
            local = random.Random(args.seed * 777 + trial * 31 + rank * 7 + slot)  # timing jitter per thread
            for index, group in enumerate(instances):
                if (rank, slot) not in groups[group]:
                    continue
                value = torch.tensor([float(index + 1), float(rank * 100 + slot)], dtype=torch.float64)
                if local.random() < 0.5:
                    threading.Event().wait(local.random() * 0.002)
                result = coordinator.all_reduce(group, slot, value)
                expected = [float(index + 1) * len(groups[group]), float(sum(r * 100 + t for r, t in groups[group]))]
                if result.tolist() != expected:
                    errors.append(f"trial {trial} instance {index} group {group}: {result.tolist()} != {expected}")

        workers = [threading.Thread(target=thread_body, args=(slot,)) for slot in range(args.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                errors.append(f"trial {trial}: a thread is stuck (deadlock)")
        coordinator.close(timeout=60)
        if errors:
            raise SystemExit("\n".join(errors))
        summary["trials"] += 1
        summary["collectives"] += len(coordinator.executed)
        summary["rounds"] += coordinator.rounds
        # Only collectives spanning both processes must run in the same order on both.
        summary["orders"].append([g for g in coordinator.executed if len({r for r, _ in groups[g]}) > 1])
    with open(f"{args.out}/rank{rank}.json", "w") as f:
        json.dump(summary, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
