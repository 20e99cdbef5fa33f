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
small epoch's order is drawn once, as the Loader draws it). A packed plan (``pack=``) finds the
step's rows (`PackSampler.rows`) by walking the epoch's lengths — integers only, no record is
read — from the packer's nearest cursor at or before them (`crossfeed.read.stages.pack`,
`PackCursor`): one this process met while iterating, or the one a saved state carries
(``state=``: `crossfeed.Loader.state_dict`, ``crossfeed replay --state``). A step at or after a
state's position, in the state's epoch, is then O(bins + batch + a chunk of documents) however
far into the epoch it lies: no lengths before the cursor are read, and the epoch's steps are not
counted (a step past the epoch's end is found so, then refused). Without a cursor near the step
(a fresh process, a step before the state's) the walk starts at the nearest one known — the
epoch's start at worst — and `StepSamples.walked_from` and a log line say so. A global step
(no ``epoch``) of a packed plan counts the steps of each earlier epoch (their rows: a walk each,
except ``split="rows"`` of one dataset, counted from the lengths files' sums). ``batch_by_tokens=``
has no cursors: its batches are walked from the epoch's start.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.read import state as states
from crossfeed.read.stages import pack
from crossfeed.read.stages.pack import HEADER, PIECE

log = logging.getLogger(__name__)

__all__ = ["SampleRef", "StepSamples", "replay", "resolve_step", "take_state"]


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
    it again as iteration did. ``walked_from``: packed (``pack=``), the row of the epoch the walk
    to the step's rows began at (the packer's nearest cursor); None for other plans."""

    epoch: int
    step: int
    rank: int
    world_size: int
    position: int
    samples: tuple[SampleRef, ...]
    planned: np.ndarray
    packed: bool = False
    walked_from: int | None = None

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
    step, epoch, position = _checked(step, epoch, position)
    if epoch is None:
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
    _check_position(pipeline, epoch, position)
    n = pipeline.rank_batch_count(position, epoch=epoch)
    if step >= n:
        raise _beyond(pipeline, step, epoch, position, n)
    return epoch, step


def _checked(step, epoch, position) -> tuple[int, int | None, int]:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(f"step must be an integer >= 0, got {step!r}")
    if position is None or isinstance(position, bool) or int(position) < 0:
        raise ConfigError(f"position must be an integer >= 0, got {position!r}")
    if epoch is None:
        if int(position):
            raise ConfigError("position= counts a step within one epoch: pass epoch= with it")
        return int(step), None, 0
    if isinstance(epoch, bool) or int(epoch) < 0:
        raise ConfigError(f"epoch must be an integer >= 0, got {epoch!r}")
    return int(step), int(epoch), int(position)


def _check_position(pipeline, epoch: int, position: int) -> None:
    if not pipeline.within(epoch, position):
        raise ConfigError(
            f"position {position} is outside epoch {epoch} of {pipeline.epoch_total(epoch)} positions; "
            f"pass the position the run's iteration of that epoch began at (0: its start)"
        )


def _beyond(pipeline, step: int, epoch: int, position: int, n: int) -> ConfigError:
    at = f" from position {position}" if position else ""
    return ConfigError(
        f"step {step} is beyond epoch {epoch}: it has {n} steps per rank{at} (0 … {n - 1}; batch_size "
        f"{pipeline.options.plan.batch_size}, world_size {pipeline.options.shard.world_size}); pass a step "
        f"below {n}, or give no epoch to count steps across epochs"
    )


def replay(
    pipeline,
    step: int,
    *,
    epoch: int | None = None,
    rank: int | None = None,
    position: int = 0,
    state: dict | None = None,
) -> StepSamples:
    """The samples of rank ``rank``'s (default: the pipeline's rank) step ``step`` (see the module
    docstring and `resolve_step`), planned again: no record is read. ``state``: a saved Loader
    state (`crossfeed.Loader.state_dict`) of this stream (checked as `load_state_dict` checks
    it, refused by name otherwise): ``epoch`` defaults to its epoch, and a packed state's cursor
    is where a walk to a step at or after it starts."""
    world = pipeline.options.shard.world_size
    rank = pipeline.options.shard.rank if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) < world:
        raise ConfigError(f"rank must be in 0 … {world - 1} (world_size {world}), got {rank!r}")
    rank = int(rank)
    if state is not None:
        saved_epoch, _ = take_state(pipeline, state)
        epoch = saved_epoch if epoch is None else epoch
    if pipeline.step_skips is not None:  # steps count skipped ones too, as the run's trainer did
        pipeline = _Unskipped(pipeline)
    if pipeline.options.plan.pack is not None:
        return _packed(pipeline, step, epoch, rank, position)
    epoch, step = resolve_step(pipeline, step, epoch=epoch, position=position)
    plan = pipeline.plan(epoch, position)
    packed = not getattr(plan, "random_access", False)
    if not packed:  # `Plan`: any batch of any rank by number, O(batch)
        plan = dataclasses.replace(plan, rank=rank, worker=0, num_workers=1, _chunk={})
        planned = np.asarray(plan.batch(step), dtype=np.int64)
        refs = tuple(_refs(pipeline, planned))
    else:  # batch_by_tokens: walked from the epoch's start up to the step (no cursors)
        plan.rank, plan.worker, plan.num_workers = rank, 0, 1
        found = next(itertools.islice(iter(plan), step, None), None)
        if found is None:  # cannot happen: resolve_step counted the epoch's steps
            raise AssertionError(f"step {step} of epoch {epoch} not found in the walk")
        planned = found
        refs = _piece_refs(pipeline, planned)
    return StepSamples(epoch, step, rank, world, position, refs, planned, packed)


def take_state(pipeline, state: dict) -> tuple[int, int]:
    """``(epoch, position)`` of a saved Loader state of ``pipeline``'s stream, checked as
    `crossfeed.Loader.load_state_dict` checks it (another stream's is refused by name); a packed
    state's cursor becomes one the packer knows (a walk to a row at or after it starts there)."""
    return states.resume_point(pipeline, state, "refuse")


def _packed(pipeline, step: int, epoch: int | None, rank: int, position: int) -> StepSamples:
    """A packed plan's step: its rows walked to from the nearest cursor at or before them, the
    rank's picked as `PackPlan` deals them (`Pipeline.packed_batch`). The step's existence is
    found by that walk, not by counting the epoch's steps."""
    step, epoch, position = _checked(step, epoch, position)
    W = pipeline.options.shard.world_size
    if epoch is None:  # a global step: each earlier epoch's steps counted
        e = 0
        while (got := pipeline.packed_batch(e, 0, step, rank)) is None:
            n = pipeline.rank_batch_count(0, epoch=e)  # the walk reached the epoch's end: known
            if n <= 0:
                raise ConfigError(f"epoch {e} has no steps for a rank: nothing to replay")
            step -= n
            e += 1
        epoch = e
    else:
        _check_position(pipeline, epoch, position)
        got = pipeline.packed_batch(epoch, position, step, rank)
        if got is None:
            raise _beyond(pipeline, step, epoch, position, pipeline.rank_batch_count(position, epoch=epoch))
    planned, start = got
    lo = position + step * pipeline.options.plan.batch_size * W
    if lo - start > pack.SCAN:  # far (a rule of thumb: more rows than a chunk holds documents)
        log.info(
            "no packer cursor near step %d of epoch %d (rows %d …) in this process: its rows were walked from row "
            "%d; replay with the state saved at or before the step (state=, --state) to start there",
            step,
            epoch,
            lo,
            start,
        )
    return StepSamples(epoch, step, rank, W, position, _piece_refs(pipeline, planned), planned, True, start)


def _piece_refs(pipeline, planned: np.ndarray) -> tuple[SampleRef, ...]:
    """The `SampleRef` of each piece of an encoded packed batch, with its row and tokens."""
    pieces = np.asarray(planned[HEADER:], dtype=np.int64).reshape(-1, PIECE)
    base = list(_refs(pipeline, pieces[:, 1]))
    return tuple(
        dataclasses.replace(ref, row=int(p[0]), start=int(p[2]), count=int(p[3]))
        for ref, p in zip(base, pieces.tolist())
    )


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
