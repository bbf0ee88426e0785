"""Placement: which ranks hold the frozen target, which train the drafter, and their groups.

`--target-ranks`:
  colocated  every rank runs both (one GPU, small rigs, CPU)
  T          T ranks run the target, the other D = world - T train the drafter
  auto       T from the FLOP model below, for the run's real lengths and shapes

Target ranks are the LAST local ranks of every node (spread evenly over nodes), so global
rank 0 is always a drafter rank (it logs, exports and evaluates) and every node holds both
roles, letting routing pair ranks on the same node.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from dflash.drafter.flops import CostShapes, drafter_flops, target_flops

logger = logging.getLogger(__name__)


class TopologyError(ValueError):
    """An impossible placement, named with the fix."""


@dataclass
class Topology:
    world_size: int
    target_ranks: list[int]
    drafter_ranks: list[int]
    nodes: dict[int, int] = field(default_factory=dict)  # rank -> node index

    @property
    def colocated(self) -> bool:
        return self.target_ranks == self.drafter_ranks

    def is_target(self, rank: int) -> bool:
        return rank in self.target_ranks

    def is_drafter(self, rank: int) -> bool:
        return rank in self.drafter_ranks

    def describe(self) -> str:
        if self.colocated:
            return f"colocated: target and drafter on all {self.world_size} ranks"
        return (f"split: target on ranks {self.target_ranks}, drafter on ranks {self.drafter_ranks} "
                f"({len(self.target_ranks)}:{len(self.drafter_ranks)}, {len(set(self.nodes.values()))} node(s))")


def ranks_per_node(world_size: int) -> int:
    """Launchers export LOCAL_WORLD_SIZE; a plain run is one node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local < 1 or world_size % local:
        raise TopologyError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world_size}")
    return local


def plan_topology(target_ranks: str | int, world_size: int, local_size: int | None = None) -> Topology:
    """Place T target ranks (an int or a resolved 'auto') or colocate."""
    local_size = local_size or world_size
    nodes = {rank: rank // local_size for rank in range(world_size)}
    if target_ranks == "colocated":
        everyone = list(range(world_size))
        return Topology(world_size, everyone, everyone, nodes)
    count = int(target_ranks)
    if not 1 <= count < world_size:
        raise TopologyError(
            f"--target-ranks {count} with {world_size} processes: need 1 <= T < world size so both roles "
            f"have ranks (launch more processes, or use --target-ranks colocated)"
        )
    num_nodes = world_size // local_size
    if count % num_nodes:
        raise TopologyError(
            f"--target-ranks {count} over {num_nodes} nodes: use a multiple of the node count so every "
            "node holds the same split"
        )
    per_node = count // num_nodes
    targets = [node * local_size + local for node in range(num_nodes)
               for local in range(local_size - per_node, local_size)]
    drafters = [rank for rank in range(world_size) if rank not in targets]
    return Topology(world_size, targets, drafters, nodes)


def parse_target_ranks(value: str) -> str | int:
    if value in ("colocated", "auto"):
        return value
    try:
        return int(value)
    except ValueError:
        raise TopologyError(f"--target-ranks {value!r}: use colocated, auto, or a number of ranks") from None


SPLIT_MIN_EFFICIENCY = 0.9


def split_efficiency(share: float, world_size: int, targets: int) -> float:
    """Work done per GPU by a split with `targets` target ranks, relative to colocated (which
    keeps every GPU busy with both parts): the slower side sets the pace."""
    return min(targets / share, (world_size - targets) / (1 - share)) / world_size


def suggest_target_ranks(s: CostShapes, lengths: np.ndarray, world_size: int) -> tuple[int | str, str]:
    """The best T for the total target vs drafter FLOPs over the data, or "colocated" when no
    split keeps SPLIT_MIN_EFFICIENCY of colocated's work per GPU (a split pays for the idle
    side; it gains memory: drafter ranks hold no target weights); and a report."""
    sample = np.quantile(lengths, [0.1, 0.5, 0.9]).astype(int).tolist()
    rows = [f"  length {n:>6}: target {target_flops(s, n) / n / 1e9:8.3g} GFLOP/token, "
            f"drafter {drafter_flops(s, n) / n / 1e9:8.3g} GFLOP/token, "
            f"ratio {target_flops(s, n) / drafter_flops(s, n):.2f}" for n in sample]
    total_target = sum(target_flops(s, int(n)) for n in lengths)
    total_drafter = sum(drafter_flops(s, int(n)) for n in lengths)
    share = total_target / (total_target + total_drafter)
    best = max(range(1, world_size), key=lambda t: split_efficiency(share, world_size, t), default=None)
    efficiency = split_efficiency(share, world_size, best) if best is not None else 0.0
    if best is not None and efficiency >= SPLIT_MIN_EFFICIENCY:
        choice: int | str = best
        verdict = f"suggested --target-ranks {best} of {world_size} (T:D = {best}:{world_size - best}, " \
                  f"{efficiency:.0%} of colocated's work per GPU)"
    else:
        choice = "colocated"
        verdict = (f"suggested colocated (the best split, T = {best}, would do {efficiency:.0%} of colocated's "
                   f"work per GPU)" if best is not None else "suggested colocated (one rank)")
    report = "\n".join(["FLOP model (per sequence token, at the 10/50/90% length quantiles):", *rows,
                        f"  whole data: target share {share:.2f} of the work -> {verdict}"])
    return choice, report


def drafter_groups(topology: Topology):
    """Process groups for the drafter's data-parallel group and a singleton per rank (DeepSpeed's
    model-parallel group). new_group is collective: every rank calls this, in the same order."""
    group = dist.new_group(topology.drafter_ranks)
    singles = {rank: dist.new_group([rank]) for rank in range(topology.world_size)}
    return group, singles[dist.get_rank()]


class DrafterParallelism:
    """The `mpu` DeepSpeed accepts: data parallelism over the drafter ranks only, no model
    parallelism. ZeRO then shards the optimizer state over exactly these ranks."""

    def __init__(self, data_group, self_group, drafter_ranks: list[int]):
        self._data, self._self, self._ranks = data_group, self_group, list(drafter_ranks)

    def get_data_parallel_group(self):
        return self._data

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._data)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._data)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._ranks

    def get_model_parallel_group(self):
        return self._self

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()
