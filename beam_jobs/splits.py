"""Which split a sample goes to: one split for the whole run, or deterministic ratios.

``SplitSpec.parse("train=0.9,validation=0.1")`` assigns each sample by the split half of its key
hash (`records.key_hashes`), so membership is a pure function of the key: the same sample lands in
the same split on every run, runner and parallelism, and changing the shuffle seed does not move it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from crossfeed.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.]+$")


@dataclass(frozen=True)
class SplitSpec:
    """``names`` with their ``ratios`` (summing to 1); a single name takes everything."""

    names: tuple[str, ...]
    ratios: tuple[float, ...] = (1.0,)

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "ratios", tuple(float(r) for r in self.ratios))
        if not self.names or len(self.names) != len(self.ratios):
            raise ConfigError(f"splits {self.names} need one ratio each, got {self.ratios}")
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"split names repeat in {self.names}")
        for n in self.names:
            if not _NAME.match(n) or "-of-" in n:
                raise ConfigError(f"split name {n!r} must be letters, digits, '_' or '.', e.g. 'train'")
        if any(not 0.0 < r <= 1.0 for r in self.ratios) or abs(sum(self.ratios) - 1.0) > 1e-6:
            raise ConfigError(f"split ratios {dict(zip(self.names, self.ratios))} must be in (0, 1] and sum to 1")

    @classmethod
    def single(cls, name: str) -> SplitSpec:
        return cls((name,), (1.0,))

    @classmethod
    def parse(cls, text: str) -> SplitSpec:
        """``"train=0.9,validation=0.1"`` (or a bare name, ``"train"``)."""
        items = [t.strip() for t in text.split(",") if t.strip()]
        if len(items) == 1 and "=" not in items[0]:
            return cls.single(items[0])
        names, ratios = [], []
        for item in items:
            name, eq, ratio = item.partition("=")
            try:
                if not eq:
                    raise ValueError
                ratios.append(float(ratio))
            except ValueError:
                raise ConfigError(f"--splits: {item!r} is not NAME=RATIO, e.g. train=0.9,validation=0.1") from None
            names.append(name.strip())
        return cls(tuple(names), tuple(ratios))

    def assign(self, split_hashes: np.ndarray) -> tuple[tuple[str, ...], np.ndarray | None]:
        """``(names, which)``: ``which[i]`` indexes ``names`` for record ``i`` (None: all in one)."""
        if len(self.names) == 1:
            return self.names, None
        # Thresholds on the 64-bit hash: the cumulative ratios scaled to 2**64, exact integers.
        cum = np.cumsum(self.ratios)[:-1]
        bounds = np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cum], dtype=np.uint64)
        return self.names, np.searchsorted(bounds, split_hashes, side="right")
