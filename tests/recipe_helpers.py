"""Module-level transforms and filters of the recipe tests (worker processes import them by
reference), and a helper that keys what each sample got by its id."""

from __future__ import annotations

import numpy as np

import crossfeed


def write(root, n: int = 120, shards: int = 4):
    """A dataset of ``n`` samples: ``x`` (3 int32, all ``i``) and ``label`` ``i``, ``i`` its
    global sample id (the writer deals samples to shards in turn)."""
    per = n // shards
    ids = [(j % shards) * per + j // shards for j in range(n)]
    samples = [{"x": np.full(3, i, np.int32), "label": i} for i in ids]
    crossfeed.write_dataset(root, samples, num_shards=shards).close()
    with crossfeed.Loader(root, batch_size=n, shuffle="none", return_index=True) as ld:
        b = next(iter(ld))
        assert (b["__index__"] == b["label"]).all(), "the writer no longer deals samples in turn"
    return root


def augment(sample, rng):
    """A random crop offset and noise, from the sample's own generator."""
    out = dict(sample)
    out["noise"] = rng.random(4).astype(np.float64)
    out["shift"] = np.int64(rng.integers(0, 1000))
    return out


def keep_even(sample) -> bool:
    return int(sample["label"]) % 2 == 0


def drop_odd(sample):
    """A transform that drops odd labels (returns None)."""
    return None if int(sample["label"]) % 2 else sample


def drop_most(sample) -> bool:
    return int(sample["label"]) % 10 == 0


def not_a_dict(sample):
    return 3


def augment_even(sample, rng):
    """Drops odd labels, augments the rest."""
    return None if int(sample["label"]) % 2 else augment(sample, rng)


def noise_by_id(batches) -> dict[int, bytes]:
    """``{sample id: its noise and shift as bytes}`` over batches holding ``__index__``."""
    out = {}
    for b in batches:
        for i, n, s in zip(np.asarray(b["__index__"]).tolist(), np.asarray(b["noise"]), np.asarray(b["shift"])):
            out[int(i)] = n.tobytes() + np.int64(s).tobytes()
    return out


def positive_y(sample) -> bool:
    """A filter of `framework_helpers.write_xy`'s samples: about half have y > 0."""
    return float(sample["y"]) > 0


def augment_tenth(sample, rng):
    """Keeps one label in ten (drop_most's), augments it: its features are known only once one is kept."""
    return augment(sample, rng) if int(sample["label"]) % 10 == 0 else None


def day(base: int, n: int) -> list[dict]:
    """A day's new records for a growing dataset: ``x`` = base … base + n - 1, and a vector."""
    return [{"x": base + i, "v": np.full(2, base + i, np.float32)} for i in range(n)]


def xs(ds, split="train") -> list[int]:
    """The sorted ``x`` of every record of a dataset's split."""
    return sorted(int(r["x"]) for r in ds[split])
