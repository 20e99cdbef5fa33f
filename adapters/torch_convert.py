"""numpy batches → torch batches, without copying numeric data.

Yields the same keys: a numeric ``np.ndarray`` becomes a tensor sharing its memory
(`torch.from_numpy`); strings and bytes (1-D ``object`` or ``U``/``S`` arrays, or lists) become
Python lists; a ragged feature (an ``object`` array of arrays) becomes a list of tensors.
Unsigned integers past ``uint8`` (token ids stored as uint16/uint32), which ``nn.Embedding`` and
``cross_entropy`` refuse, become int64 (a copy) unless ``keep_dtypes=True``
(`crossfeed.adapters.int_dtypes`).

``shared=True`` (what a DataLoader worker uses): the batch's numeric arrays are copied, each
widened on the way, into one block of shared memory, and its tensors are views of it. A
DataLoader worker's batch crosses to the trainer by pickling each tensor's storage into shared
memory (a new segment, a copy and a file descriptor handed over per storage); one storage per
batch makes that one segment and one descriptor whatever the batch holds (a packed batch's
tokens, segment ids and positions: 3 → 1), and the copy into it is the one the queue made
anyway. Imports torch, never tensorflow.
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

ALIGN = 64  # bytes: where each array starts in a shared block (any dtype's alignment)


def to_torch(batch: Mapping, *, keep_dtypes: bool = False, shared: bool = False) -> dict:
    """``dict[str, np.ndarray | list]`` → ``dict[str, torch.Tensor | list]``; ``keep_dtypes``:
    unsigned integers as stored (else int64, the dtype torch's indexing ops take); ``shared``:
    the numeric arrays as views of one shared-memory storage (see the module docstring)."""
    if shared:
        batch = _shared(batch, keep_dtypes)
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


def to_torch_group(batches: list, *, keep_dtypes: bool = False) -> list[dict]:
    """`to_torch` of each of ``batches`` with ``shared=True``, their numeric arrays all in one
    shared-memory storage: several batches cross the DataLoader's queue for one segment and one
    file descriptor (`crossfeed.adapters.torch.StatefulLoader`'s ``batches_per_transfer``)."""
    return [to_torch(b, keep_dtypes=keep_dtypes) for b in _in_block(batches, keep_dtypes)]


def _shared(batch: Mapping, keep: bool) -> dict:
    """``batch`` with its numeric arrays (two or more) replaced by tensors viewing one
    shared-memory storage, each array copied in once (widened as `_convert` would)."""
    return _in_block([batch], keep)[0]


def _in_block(batches: list, keep: bool) -> list[dict]:
    """``batches`` with their numeric arrays (two or more in all) replaced by tensors viewing one
    shared-memory storage, each array copied in once (widened as `_convert` would)."""
    arrays = [
        (i, k, np.asarray(v))
        for i, batch in enumerate(batches)
        for k, v in batch.items()
        if isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind in "biufc" and v.dtype.isnative
    ]
    out = [dict(b) for b in batches]
    if len(arrays) < 2:  # one storage already: torch shares it as it is
        return out
    dtypes = [v.dtype if keep else torch_dtype(v.dtype) or v.dtype for _, _, v in arrays]
    starts, size = [], 0
    for (_, _, v), dt in zip(arrays, dtypes):
        starts.append(size)
        size += -(-v.size * dt.itemsize // ALIGN) * ALIGN
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is not None:  # allocated in shared memory: the queue's pickling copies nothing more
        block = torch.empty(0, dtype=torch.uint8).set_(new_shared(size))
    else:
        block = torch.empty(size, dtype=torch.uint8).share_memory_()
    raw = block.numpy()
    for (i, k, v), dt, lo in zip(arrays, dtypes, starts):
        dst = raw[lo : lo + v.size * dt.itemsize].view(dt).reshape(v.shape)
        if v.dtype == dt or np.can_cast(v.dtype, dt, "safe"):
            np.copyto(dst, v, casting="safe")
        else:  # a narrowing the widening rule decides (uint64 → int64)
            np.copyto(dst, widen(k, v, dt), casting="unsafe")
        out[i][k] = block[lo : lo + v.size * dt.itemsize].view(torch_of(dt)).view(v.shape)
    return out


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def torch_of(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of numpy ``dtype`` (one a torch tensor can view)."""
    got = _TORCH_DTYPES.get(dtype)
    if got is None:
        got = _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return got


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
