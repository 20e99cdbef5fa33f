"""Several splits read as one: the shards of a mixture's sources, numbered one after another.

A mixture's sample ids are global across its sources (source ``s``'s sample ``i`` is
``source_starts[s] + i``, see `crossfeed.read.stages.sampler.MixtureOrder`). Laid end to end, the sources'
shards number those very ids shard-major, so one `crossfeed.read.stages.frames.FrameReader` over a
`UnionSplit` reads a mixture batch in one pass — one gather, one check, one decode — at the cost
of a batch of one source, instead of a pass per source and a merge.
"""

from __future__ import annotations

import bisect

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.format.manifest import SplitInfo


class UnionSplit:
    """The shards of ``splits`` as one split (the part of `crossfeed.read.sources.dataset.Split` a frame
    reader uses: ``counts``, ``starts``, ``shards``, ``file``, ``index``, ``locate``)."""

    def __init__(self, splits):
        self.splits = list(splits)
        if not self.splits:
            raise ConfigError("a union of splits needs at least one split")
        self.name = "+".join(sp.name for sp in self.splits)
        self.schema = self.splits[0].schema
        self._at = [(i, k) for i, sp in enumerate(self.splits) for k in range(len(sp.counts))]
        self.counts = np.concatenate([np.asarray(sp.counts, dtype=np.int64) for sp in self.splits])
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.shards = tuple(info for sp in self.splits for info in sp.shards)
        self.info = SplitInfo(self.name, self.shards, format=self.splits[0].info.format)
        sizes = [len(sp) for sp in self.splits]
        self.source_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def file(self, shard: int):
        i, k = self._at[shard]
        return self.splits[i].file(k)

    def index(self, shard: int) -> np.ndarray:
        i, k = self._at[shard]
        return self.splits[i].index(k)

    def entries(self, shard: int, k: np.ndarray) -> np.ndarray:
        i, j = self._at[shard]
        return self.splits[i].entries(j, k)

    def lazy_index(self, shard: int):
        i, j = self._at[shard]
        return self.splits[i].lazy_index(j)

    def source_of(self, shard: int) -> int:
        return self._at[shard][0]

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard, record_within_shard)`` of id ``i``."""
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"sample {i} is out of range for a mixture of {n} samples")
        s = bisect.bisect_right(self.starts, i) - 1
        return s, i - int(self.starts[s])
