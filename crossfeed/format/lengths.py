"""Lengths files: the per-record lengths of a dataset's variable-length features (the tokens
of a tokenized corpus), beside each shard, so a plan can pack rows or bucket batches from
integers without reading a record.

``NAME.len`` beside shard ``NAME``: a little-endian ``uint32`` array of shape
``(num_records, k)`` in record order, no header, where the manifest's ``lengths`` lists the
``k`` features in column order (a feature's length is its number of values: a record's token
count). The manifest's ``lengths_sha256`` of each shard pins the file's bytes, so a lengths
file is trusted only once its size and checksum match (`checked_lengths`); a reader also checks
every record it decodes against the length the plan used.

A checksum pins bytes, not sense: a lengths file re-pinned in an edited manifest could claim a
record of 2^31 tokens, and a plan would size rows and batches by it. So each entry is also
bounded by what its record can hold (`record_bound`): a record of a TFRecord or tar shard takes at
least its values' bytes (a raw tensor its dtype's size a value, a varint one byte, a float four)
within the shard's ``num_bytes`` (times deflate's largest ratio, 1,032, for a GZIP shard);
`check_bound` refuses an entry past it, naming the file and the entry.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from crossfeed.errors import IndexFileError

DTYPE = np.dtype("<u4")
SUFFIX = ".len"
GZIP_RATIO = 1032  # deflate's largest expansion: at most this many bytes out per byte in


def lengths_path(shard_path: str | os.PathLike) -> str:
    """The lengths file beside a shard: ``train-00000-of-00004.tfrecord`` → ``….len``."""
    return str(shard_path) + SUFFIX


def format_lengths(lengths) -> bytes:
    """The file's bytes for ``lengths`` (``(num_records, k)`` non-negative integers; a 1-D array
    is one feature)."""
    arr = np.asarray(lengths)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or (arr.size and (arr.min() < 0 or arr.max() > np.iinfo(DTYPE).max)):
        raise ValueError(f"lengths must be a (records, features) array of uint32 values, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=DTYPE).tobytes()


def checked_lengths(data, where: str, shard, features: int, digest: str | None = None) -> np.ndarray:
    """The ``(num_records, features)`` read-only array a lengths file holds, checked: its size
    is exactly ``num_records × features × 4`` bytes and, where the manifest pins it
    (``shard.lengths_sha256``), its sha256 matches (``digest``: the file's, hashed by the caller
    — e.g. read in chunks, so a memory-mapped ``data`` is not paged in whole). Raises
    `IndexFileError` naming the file."""
    fix = "rebuild the dataset's lengths (convert it again, or `crossfeed index --force`)"
    view = memoryview(data)
    want = shard.num_records * features * DTYPE.itemsize
    if view.nbytes != want:
        raise IndexFileError(
            f"{where}: {view.nbytes} bytes, expected {want} ({shard.num_records} records × {features} "
            f"lengths × 4 bytes); {fix}"
        )
    sha = getattr(shard, "lengths_sha256", None)
    if sha is not None and (digest if digest is not None else hashlib.sha256(view).hexdigest()) != sha:
        raise IndexFileError(f"{where}: sha256 differs from the manifest's lengths_sha256; {fix}")
    arr = np.frombuffer(view, dtype=DTYPE).reshape(shard.num_records, features)
    arr.flags.writeable = False
    return arr


def record_bound(shard, feature, split_format: str = "tfrecord") -> int:
    """The most values of ``feature`` (a `crossfeed.format.schema.Feature`) one record of
    ``shard`` (a manifest `ShardInfo`) can hold: its bytes over the fewest bytes a value takes
    (see the module docstring); ``np.iinfo(DTYPE).max`` where the shard's bytes bound nothing
    (Parquet: a dictionary-encoded column holds a million values in a few bytes)."""
    top = int(np.iinfo(DTYPE).max)
    if split_format == "parquet":
        return top
    encoding = getattr(feature.encoding, "value", feature.encoding)
    per_value = np.dtype(feature.dtype).itemsize if encoding == "tensor" else 4 if encoding == "float" else 1
    stream = shard.num_bytes * (GZIP_RATIO if shard.file.endswith(".gz") else 1)
    return min(top, stream // max(per_value, 1))


def check_bound(lengths: np.ndarray, bound: int, where: str, feature: str) -> None:
    """Refuse (`IndexFileError` naming the file and the entry) a length over ``bound`` values."""
    if lengths.size and int(lengths.max()) > bound:
        at = int(np.argmax(lengths > bound))
        raise IndexFileError(
            f"{where}: entry {at} says record {at} holds {int(lengths[at]):,} values of {feature!r}; its shard "
            f"can hold at most {bound:,}; the lengths file is damaged or was edited (rebuild the dataset's "
            f"lengths: convert it again, or `crossfeed index --force`)"
        )
