"""The adapters' one rule for integer dtypes a framework's ops do not take.

Token datasets store their ids narrow (``uint16`` under 65,536 ids, else ``uint32``;
`crossfeed convert text`), and the Loader delivers them as stored. Frameworks index with signed
integers: ``nn.Embedding`` takes int32/int64 indices and ``cross_entropy`` int64 targets;
``tf.keras`` embeddings and sparse losses int32/int64; JAX computes in int32 (int64 only under
``jax_enable_x64``). So each adapter widens the unsigned integers past ``uint8`` as it hands a
batch over — every feature, packed ``tokens`` included:

==========  ======================  ===================================================
adapter     uint16                  uint32 / uint64
==========  ======================  ===================================================
PyTorch     int64                   int64
JAX         int32                   int32; a value >= 2^31 is a SchemaError naming the feature
TF          int32                   int64
==========  ======================  ===================================================

``uint8`` (image pixels) and the signed integers stay as they are; floats are untouched.
``keep_dtypes=True`` (the same name in `TorchDataset`, `JaxLoader`, the TF `dataset`) keeps
every dtype as stored — for your own cast, or to move the narrow ids to the device first.
Numpy only: imports no framework.
"""

from __future__ import annotations

import numpy as np

from crossfeed.errors import SchemaError

WIDENED = (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64))
INT32_MAX = 2**31 - 1


def torch_dtype(dtype) -> np.dtype | None:
    """What PyTorch gets for ``dtype`` (None: as stored)."""
    return np.dtype(np.int64) if np.dtype(dtype) in WIDENED else None


def jax_dtype(dtype) -> np.dtype | None:
    """What JAX gets for ``dtype`` (None: as stored, JAX's own 64→32 rule aside)."""
    return np.dtype(np.int32) if np.dtype(dtype) in WIDENED else None


def tf_dtype(dtype) -> np.dtype | None:
    """What TensorFlow gets for ``dtype`` (None: as stored): int32 where every value fits, else int64."""
    dtype = np.dtype(dtype)
    if dtype not in WIDENED:
        return None
    return np.dtype(np.int32) if dtype == np.uint16 else np.dtype(np.int64)


def widen(name: str, value: np.ndarray, to: np.dtype | None) -> np.ndarray:
    """``value`` as ``to`` (None: unchanged); narrowing to int32 is checked value by value."""
    if to is None or value.dtype == to:
        return value
    if to.itemsize < value.dtype.itemsize or (to == np.int32 and value.dtype == np.uint32):
        top = int(value.max()) if value.size else 0
        if top > np.iinfo(to).max:
            raise SchemaError(
                f"feature {name!r} holds {value.dtype} values up to {top:,}, past {to}'s {np.iinfo(to).max:,}: "
                f"pass keep_dtypes=True to get them as stored (or enable jax_enable_x64 and cast them yourself)"
            )
    return value.astype(to)
