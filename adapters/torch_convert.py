"""numpy batches → torch batches, without copying numeric data.

Yields the same keys: a numeric ``np.ndarray`` becomes a tensor sharing its memory
(`torch.from_numpy`); strings and bytes (1-D ``object`` or ``U``/``S`` arrays, or lists) become
Python lists; a ragged feature (an ``object`` array of arrays) becomes a list of tensors.
Unsigned integers past ``uint8`` (token ids stored as uint16/uint32), which ``nn.Embedding`` and
``cross_entropy`` refuse, become int64 (a copy) unless ``keep_dtypes=True``
(`crossfeed.adapters.int_dtypes`). Imports torch, never tensorflow.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np

try:
    import torch
except ModuleNotFoundError as e:  # one line naming the extra that installs it
    from crossfeed.errors import missing_extra

    raise missing_extra(e, "crossfeed.adapters.torch") from None

from crossfeed.adapters.int_dtypes import torch_dtype, widen
from crossfeed.errors import ConfigError


def to_torch(batch: Mapping, *, keep_dtypes: bool = False) -> dict:
    """``dict[str, np.ndarray | list]`` → ``dict[str, torch.Tensor | list]``; ``keep_dtypes``:
    unsigned integers as stored (else int64, the dtype torch's indexing ops take)."""
    out = {}
    for key, value in batch.items():
        try:
            out[key] = _convert(value, key, keep_dtypes)
        except TypeError as e:
            raise ConfigError(
                f"feature {key!r}: {getattr(value, 'dtype', type(value).__name__)} has no torch equivalent ({e}); "
                f"cast it in the loader's transform or batch_transform"
            ) from e
    return out


def _convert(value, key: str = "", keep: bool = False):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.dtype.kind in "USV":
            return [_convert(v, key, keep) if isinstance(v, np.ndarray) else v for v in value.tolist()]
        return _from_numpy(value if keep else widen(key, value, torch_dtype(value.dtype)))
    if isinstance(value, np.generic):
        if value.dtype.kind in "USVO":  # a per-sample text value: as Python
            return value.item()
        return _convert(np.asarray(value), key, keep)
    if isinstance(value, list):
        return [_convert(v, key, keep) if isinstance(v, np.ndarray) else v for v in value]
    return value


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    if not arr.flags.aligned or any(s < 0 or s % arr.itemsize for s in arr.strides):
        # torch cannot view negative or misaligned strides (e.g. a value cut straight out of a
        # record's bytes): the one case where we copy
        arr = np.array(arr, order="C", copy=True)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # Read-only arrays (e.g. views of received network frames) are shared as they are; torch
    # warns once that writing to them is undefined. Do not modify such tensors in place.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)
