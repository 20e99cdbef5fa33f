"""Rank and world size from the environment: torchrun / torch.distributed (RANK, WORLD_SIZE),
then TF_CONFIG (tf.distribute multi-worker), else a single process."""

from __future__ import annotations

import json
import os

from crossfeed.errors import ConfigError


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    if rank is None and world_size is None:
        rank, world_size = _from_env()
    elif rank is None or world_size is None:
        raise ConfigError(
            "pass both rank and world_size, or neither (then they come from RANK/WORLD_SIZE or TF_CONFIG)"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in range for world_size {world_size}")
    return int(rank), int(world_size)


def _from_env() -> tuple[int, int]:
    if "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        except ValueError as e:
            raise ConfigError(f"RANK/WORLD_SIZE are not integers: {e}") from e
    if "TF_CONFIG" in os.environ:
        try:
            cfg = json.loads(os.environ["TF_CONFIG"])
            cluster, task = cfg.get("cluster", {}), cfg.get("task", {})
            workers = list(cluster.get("chief", [])) + list(cluster.get("worker", []))
            kind, index = task.get("type"), int(task.get("index", 0))
        except (ValueError, AttributeError, TypeError) as e:
            raise ConfigError(f"TF_CONFIG is not valid JSON of a cluster spec: {e}") from e
        if kind in ("chief", "worker") and workers:
            offset = len(cluster.get("chief", [])) if kind == "worker" else 0
            return offset + index, len(workers)
    return 0, 1
