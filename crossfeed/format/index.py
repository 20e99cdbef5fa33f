"""Index files: one ``offset length`` line per record, the format of the ``tfrecord`` package's
``tfrecord2idx`` and of DALI. ``length`` is the framed length (header + payload + footer).
For GZIP shards the offsets are positions in the uncompressed stream.

An index is trusted only once checked (`checked_index`): against the manifest's ``index_sha256``
where it has one, and always for tiling its shard, so that no edited entry can make a reader
return one record twice and another never."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable

import numpy as np

from crossfeed.errors import IndexFileError


def index_path(shard_path: str | os.PathLike) -> str:
    """The index file that sits beside a shard: ``train-00000-of-00004.tfrecord`` → ``….idx``."""
    return str(shard_path) + ".idx"


def format_index(offsets) -> bytes:
    return "".join(f"{o} {n}\n" for o, n in offsets).encode()


def write_index(path: str | os.PathLike, offsets) -> str:
    """Write an index file (fsynced) and return its sha256, for the manifest."""
    data = format_index(offsets)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def parse_index(data: bytes, path: str) -> np.ndarray:
    """Parse an index file's bytes into an ``(n, 2)`` int64 array of ``(offset, length)``.

    Well-formed files (digits, one space, newline) are parsed in one C pass (~6× faster: the
    index of a large shard is parsed when a batch first touches it); anything else takes the
    careful path, whose errors say what is wrong."""
    data = bytes(data)
    if data and not data.translate(None, b"0123456789 \n") and data.endswith(b"\n"):
        lines = data.count(b"\n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            flat = np.fromstring(data.decode("ascii"), dtype=np.int64, sep=" ")
        if len(flat) == 2 * lines and data.count(b" ") == lines and len(data) < 40 * lines:
            arr = flat.reshape(-1, 2)
            if arr.min() >= 0 and not np.any(arr[:, 1] < 16) and arr.max() <= 1 << 56:
                return arr
    text = data.decode("ascii", errors="replace")
    lines = text.split()
    if len(lines) % 2:
        raise IndexFileError(f"{path}: odd number of fields; expected 'offset length' per line")
    try:
        arr = np.array(lines, dtype=np.int64).reshape(-1, 2)
    except (ValueError, OverflowError) as e:
        raise IndexFileError(
            f"{path}: not an index file of 'offset length' lines ({e}); rebuild it with `crossfeed index`"
        ) from e
    if len(arr) and (arr.min() < 0 or np.any(arr[:, 1] < 16) or arr.max() > 1 << 56):
        raise IndexFileError(
            f"{path}: negative offset or a record shorter than 16 bytes; rebuild it with `crossfeed index`"
        )
    return arr


def read_index(path: str | os.PathLike) -> np.ndarray:
    try:
        with open(path, "rb") as f:
            return parse_index(f.read(), str(path))
    except FileNotFoundError as e:
        raise IndexFileError(f"{path}: index file is missing; rebuild it with `crossfeed index`") from e


def checked_index(data: bytes, where: str, shard, *, gzip: Callable[[], bool]) -> np.ndarray:
    """Parse the index of ``shard`` (a `crossfeed.format.manifest.ShardInfo`) and check it.

    With the manifest's ``index_sha256`` the bytes must match it. Whatever the manifest holds
    (older ones have no checksum) the entries must tile the record stream: the first at offset 0,
    each starting where the one before ends, the last ending at the file's size for a plain
    shard (``gzip()`` says whether it is compressed; only asked when the end differs). So an
    entry edited to point at another record is caught before any record is read.
    Raises `IndexFileError` naming the index file and the entry.
    """
    fix = "rebuild it with `crossfeed index --force`"
    arr = parse_index(data, where)
    if len(arr) != shard.num_records:
        raise IndexFileError(
            f"{where}: {len(arr)} entries, the manifest says {shard.num_records} records; the "
            f"dataset is inconsistent, {fix}"
        )
    if len(arr):
        _check_tiling(arr, where, shard.num_bytes, gzip, fix)
    if shard.index_sha256 is not None and hashlib.sha256(data).hexdigest() != shard.index_sha256:
        raise IndexFileError(
            f"{where}: sha256 differs from the manifest's index_sha256: the index changed after it was written; {fix}"
        )
    return arr


def _check_tiling(arr: np.ndarray, where: str, num_bytes: int, gzip: Callable[[], bool], fix: str) -> None:
    if arr[0, 0] != 0:
        raise IndexFileError(f"{where}: entry 0 starts at byte {arr[0, 0]}, not 0; {fix}")
    ends = arr[:, 0] + arr[:, 1]
    gaps = np.flatnonzero(arr[1:, 0] != ends[:-1])
    if gaps.size:
        k = int(gaps[0]) + 1
        raise IndexFileError(
            f"{where}: entry {k} ('{arr[k, 0]} {arr[k, 1]}') does not start where entry {k - 1} "
            f"ends (byte {ends[k - 1]}); {fix}"
        )
    if ends[-1] != num_bytes and not gzip():
        raise IndexFileError(
            f"{where}: the last entry (entry {len(arr) - 1}) ends at byte {ends[-1]}, the shard is "
            f"{num_bytes} bytes; {fix}"
        )
