"""Index files: one ``offset length`` line per record, the format of the ``tfrecord`` package's
``tfrecord2idx`` and of DALI. ``length`` is the framed length (header + payload + footer).
For GZIP shards the offsets are positions in the uncompressed stream."""

from __future__ import annotations

import os

import numpy as np

from crossfeed.errors import IndexFileError


def index_path(shard_path: str | os.PathLike) -> str:
    """The index file that sits beside a shard: ``train-00000-of-00004.tfrecord`` → ``….idx``."""
    return str(shard_path) + ".idx"


def format_index(offsets) -> bytes:
    return "".join(f"{o} {n}\n" for o, n in offsets).encode()


def write_index(path: str | os.PathLike, offsets) -> None:
    with open(path, "wb") as f:
        f.write(format_index(offsets))


def parse_index(data: bytes, path: str) -> np.ndarray:
    """Parse an index file's bytes into an ``(n, 2)`` int64 array of ``(offset, length)``."""
    text = data.decode("ascii", errors="replace")
    lines = text.split()
    if len(lines) % 2:
        raise IndexFileError(f"{path}: odd number of fields; expected 'offset length' per line")
    try:
        arr = np.array(lines, dtype=np.int64).reshape(-1, 2)
    except ValueError as e:
        raise IndexFileError(f"{path}: not an index file of 'offset length' lines ({e}); rebuild it with `crossfeed index`") from e
    if len(arr) and (arr.min() < 0 or np.any(arr[:, 1] < 16)):
        raise IndexFileError(f"{path}: negative offset or a record shorter than 16 bytes; rebuild it with `crossfeed index`")
    return arr


def read_index(path: str | os.PathLike) -> np.ndarray:
    try:
        with open(path, "rb") as f:
            return parse_index(f.read(), str(path))
    except FileNotFoundError as e:
        raise IndexFileError(f"{path}: index file is missing; rebuild it with `crossfeed index`") from e
