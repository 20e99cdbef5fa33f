"""Shared checks for anything that plans or loads: one helper asserts that stopping after any
batch and resuming from the saved state — in a new Loader, in a new process if asked — yields
the identical remaining sequence."""

from __future__ import annotations

import numpy as np

from crossfeed.format.schema import SOURCE_KEY
from crossfeed.read.loader import INDEX_KEY, Loader


def ids_of(batches) -> list[np.ndarray]:
    """Each batch's sample ids (a mixture's as ``source * 10**9 + index``)."""
    return [np.asarray(b[INDEX_KEY]) + (np.asarray(b[SOURCE_KEY]) * 10**9 if SOURCE_KEY in b else 0) for b in batches]


def epoch_batches(path, **kw) -> list[np.ndarray]:
    with Loader(path, return_index=True, **kw) as loader:
        return ids_of(loader)


def assert_resumes_identically(path, *, stops=None, **kw) -> None:
    """For every stop point k (default: all), the batches after k of a resumed Loader equal those
    of the uninterrupted epoch, batch for batch."""
    full = epoch_batches(path, **kw)
    for k in stops if stops is not None else range(len(full) + 1):
        with Loader(path, return_index=True, **kw) as first:
            it = iter(first)
            for _ in range(k):
                next(it)
            state = first.state_dict()
        with Loader(path, return_index=True, **kw) as second:
            second.load_state_dict(state)
            rest = ids_of(second)
        assert len(rest) == len(full) - k, f"stop {k}: {len(rest)} batches after resuming, expected {len(full) - k}"
        for a, b in zip(rest, full[k:]):
            np.testing.assert_array_equal(a, b, err_msg=f"stop {k}: resumed batches differ")
