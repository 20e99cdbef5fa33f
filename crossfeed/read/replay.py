"""Step replay: which samples were in step N of a rank, answered from the plan, nothing logged.

The plan is integers first (`crossfeed.read.stages.sampler`): the samples of a rank's batch ``b``
of epoch ``e`` are a pure function of (seed, epoch, position, world size, rank, b). So "what was
in step 340" — the loss-spike question — needs no log written during training: `replay` plans that
one batch again and names each sample's source, shard file, record within the shard and global key
(`SampleRef`); `crossfeed.read.pipeline.Pipeline.records` then decodes them (CRC-checked).

Steps count a rank's batches: step ``b`` of an epoch is the rank's ``b``-th batch from the epoch
position the iteration began at (``position``: 0, the epoch's start, unless a run was resumed at
another world size or batch size). A rank's batches are the same whatever number of workers
(DataLoader workers, ``num_workers``) share them out: worker ``w`` of ``K`` delivers the rank's
batches ``w, w + K, …``, and a step here is the rank's batch number, not the worker's.

Cost: an unpacked plan answers in O(batch) (`Plan.batch`, no walk from the epoch's start; a
small epoch's order is drawn once, as the Loader draws it). A packed plan (``pack=``) or one of
``batch_by_tokens=`` walks the epoch's lengths up to the step — integers only, no record is read
— as iterating does; O(1) packed replay arrives with the packed-state work. Replaying a global
step across epochs of a packed plan walks each earlier epoch's lengths once to count its steps.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.read.stages.pack import HEADER, PIECE

__all__ = ["SampleRef", "StepSamples", "replay", "resolve_step"]


@dataclass(frozen=True)
class SampleRef:
    """One sample of a replayed step: where it is stored and what the plan calls it.

    ``source``: the dataset's path (a mixture's source's); ``source_index``: the source's place
    in the mixture (0 for one dataset); ``index``: the sample's number within its source's split
    (what ``return_index=True`` delivers as ``__index__``); ``key``: its global key (a mixture's
    sources numbered one after the other: `Pipeline.records` decodes it); ``path``: the shard
    file; ``shard``: its number in the split; ``record``: the record's number within that file.
    Packed plans (``pack=``): a row's piece of a document — ``row`` of the batch, the document's
    tokens ``start .. start + count``."""

    source: str
    source_index: int
    index: int
    key: int
    path: str
    shard: int
    record: int
    row: int | None = None
    start: int | None = None
    count: int | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True, eq=False)
class StepSamples(Sequence):
    """The samples of one rank's step (a sequence of `SampleRef`, in the batch's order; packed: the
    pieces of its rows, row by row). ``planned``: what the pipeline's builder takes for this batch
    (the global keys; packed: the encoded rows) — ``loader.pipeline.build_batch(planned)`` builds
    it again as iteration did."""

    epoch: int
    step: int
    rank: int
    world_size: int
    position: int
    samples: tuple[SampleRef, ...]
    planned: np.ndarray
    packed: bool = False

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]

    def __iter__(self) -> Iterator[SampleRef]:
        return iter(self.samples)

    @property
    def keys(self) -> np.ndarray:
        """The global keys of the step's samples in order (packed: each document once, in the
        order it first appears)."""
        keys = np.array([s.key for s in self.samples], dtype=np.int64)
        if not self.packed:
            return keys
        _, first = np.unique(keys, return_index=True)
        return keys[np.sort(first)]

    def to_json(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "position": self.position,
            "samples": [s.to_json() for s in self.samples],
        }


def resolve_step(pipeline, step: int, *, epoch: int | None, position: int = 0) -> tuple[int, int]:
    """``(epoch, step within it)`` of ``step``: with ``epoch`` given, the rank's batch number in
    that epoch (counted from ``position``); without, a global step counted from epoch 0's start
    (each epoch's rank batches one after the other). Steps beyond the epoch are refused, naming
    its step count."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(f"step must be an integer >= 0, got {step!r}")
    step = int(step)
    if position is None or int(position) < 0:
        raise ConfigError(f"position must be an integer >= 0, got {position!r}")
    position = int(position)
    if epoch is None:
        if position:
            raise ConfigError("position= counts a step within one epoch: pass epoch= with it")
        e = 0
        while True:
            n = pipeline.rank_batch_count(0, epoch=e)
            if n <= 0:
                raise ConfigError(f"epoch {e} has no steps for a rank: nothing to replay")
            plan = pipeline.options.plan
            if plan.pack is None and plan.batch_by_tokens is None:
                more, step = divmod(step, n)  # every epoch has the same steps: no walk
                return e + more, step
            if step < n:
                return e, step
            step -= n
            e += 1
    if isinstance(epoch, bool) or int(epoch) < 0:
        raise ConfigError(f"epoch must be an integer >= 0, got {epoch!r}")
    epoch = int(epoch)
    if not pipeline.within(epoch, position):
        raise ConfigError(
            f"position {position} is outside epoch {epoch} of {pipeline.epoch_total(epoch)} positions; "
            f"pass the position the run's iteration of that epoch began at (0: its start)"
        )
    n = pipeline.rank_batch_count(position, epoch=epoch)
    if step >= n:
        at = f" from position {position}" if position else ""
        raise ConfigError(
            f"step {step} is beyond epoch {epoch}: it has {n} steps per rank{at} (0 … {n - 1}; batch_size "
            f"{pipeline.options.plan.batch_size}, world_size {pipeline.options.shard.world_size}); pass a step "
            f"below {n}, or give no epoch to count steps across epochs"
        )
    return epoch, step


def replay(pipeline, step: int, *, epoch: int | None = None, rank: int | None = None, position: int = 0) -> StepSamples:
    """The samples of rank ``rank``'s (default: the pipeline's rank) step ``step`` (see the module
    docstring and `resolve_step`), planned again: no record is read."""
    world = pipeline.options.shard.world_size
    rank = pipeline.options.shard.rank if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) < world:
        raise ConfigError(f"rank must be in 0 … {world - 1} (world_size {world}), got {rank!r}")
    rank = int(rank)
    if pipeline.step_skips is not None:  # steps count skipped ones too, as the run's trainer did
        pipeline = _Unskipped(pipeline)
    epoch, step = resolve_step(pipeline, step, epoch=epoch, position=position)
    plan = pipeline.plan(epoch, position)
    packed = not getattr(plan, "random_access", False)
    if not packed:  # `Plan`: any batch of any rank by number, O(batch)
        plan = dataclasses.replace(plan, rank=rank, worker=0, num_workers=1, _chunk={})
        planned = np.asarray(plan.batch(step), dtype=np.int64)
        refs = tuple(_refs(pipeline, planned))
    else:  # `PackPlan`: walked from the epoch's start up to the step
        plan.rank, plan.worker, plan.num_workers = rank, 0, 1
        found = next(itertools.islice(iter(plan), step, None), None)
        if found is None:  # cannot happen: resolve_step counted the epoch's steps
            raise AssertionError(f"packed step {step} of epoch {epoch} not found in the walk")
        planned = found
        pieces = np.asarray(planned[HEADER:], dtype=np.int64).reshape(-1, PIECE)
        base = list(_refs(pipeline, pieces[:, 1]))
        refs = tuple(
            dataclasses.replace(ref, row=int(p[0]), start=int(p[2]), count=int(p[3]))
            for ref, p in zip(base, pieces.tolist())
        )
    return StepSamples(epoch, step, rank, world, position, refs, planned, packed)


class _Unskipped:
    """A pipeline's plan without its skipped steps (`Pipeline.step_skips`): a step number counts
    the skipped steps too (a replay of a skipped step names what the plan had there)."""

    def __init__(self, pipeline):
        self._pipeline, self._plan = pipeline, pipeline.step_skips.inner

    def __getattr__(self, name: str):
        return getattr(self._pipeline, name)

    def plan(self, epoch: int, position: int = 0):
        return self._plan.plan(epoch, position)

    def rank_batch_count(self, position: int = 0, epoch: int = 0) -> int:
        return self._plan.rank_batch_count(position, epoch=epoch)


def _refs(pipeline, keys: np.ndarray) -> Iterator[SampleRef]:
    """Each global key's `SampleRef` (no file is opened: the manifest's counts say where)."""
    starts = np.asarray(pipeline.starts, dtype=np.int64)
    src = np.searchsorted(starts, keys, side="right") - 1
    splits: dict[int, Any] = {}
    for key, s in zip(keys.tolist(), src.tolist()):
        split = splits.get(s)
        if split is None:
            split = splits[s] = _split(pipeline, s)
        index = key - int(starts[s])
        shard = int(np.searchsorted(split.starts, index, side="right") - 1)
        yield SampleRef(
            source=pipeline.datasets[s].path,
            source_index=s,
            index=index,
            key=key,
            path=split.file(shard).path,
            shard=shard,
            record=index - int(split.starts[shard]),
        )


def _split(pipeline, s: int):
    if pipeline.sources is None:
        return pipeline.split
    return pipeline.datasets[s][pipeline.sources[s].split]
