"""The first step of a write: shards staged under temporary names (``.tmp-<tag>.tfrecord``, its
index and, for datasets with per-record lengths, its lengths file) in the dataset root, each a `StagedShard` that `crossfeed.write.commit` publishes or
`discard` removes; and the crash points that mark every step of a write (tests kill the writer
after each one to prove the commit atomic).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.format.lengths import format_lengths, lengths_path

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # every temporary entry a writer makes in a dataset directory starts with this


@dataclass(frozen=True)
class StagedShard:
    """A finished shard under a temporary name, waiting for `commit_splits`."""

    tmp_path: str
    num_records: int
    num_bytes: int
    sha256: str
    index_sha256: str | None = None
    lengths_sha256: str | None = None  # of the staged lengths file (`crossfeed.format.lengths`), if any
    crc32c: int | None = None  # of the shard file's bytes (`crossfeed.format.manifest.ShardInfo.crc32c`)


def _companions(tmp_path: str) -> tuple[str, str]:
    """The files staged beside a shard: its index and its lengths file (there or not)."""
    return idx.index_path(tmp_path), lengths_path(tmp_path)


class ShardSink:
    """Writes one shard and its index file under temporary names in the dataset root
    (``.tmp-<tag>.tfrecord``; ``tag`` starts with the writer's token); `finish` given the
    records' lengths writes the lengths file too."""

    def __init__(self, root: str, tag: str, *, compress: bool = False):
        self.tmp_path = os.path.join(root, f"{TMP_PREFIX}{tag}.tfrecord" + (".gz" if compress else ""))
        self._writer = tfrecord.RecordWriter(self.tmp_path, compress=compress)

    def write(self, payload: bytes) -> None:
        self._writer.write(payload)

    def write_many(self, payloads: list) -> None:
        """`write` of each of ``payloads`` in order, framed and written as one batch (the same bytes)."""
        self._writer.write_many(payloads)

    def write_framed(self, data, sizes: np.ndarray) -> None:
        """Records already framed (`crossfeed.format.tfrecord.frame_many`), ``sizes`` their framed
        sizes, written as one batch: the same bytes and index as `write_many` of their payloads."""
        self._writer.write_framed(data, sizes)

    @property
    def num_records(self) -> int:
        return len(self._writer.offsets)

    @property
    def num_bytes(self) -> int:
        return self._writer.num_bytes

    def finish(self, lengths: np.ndarray | None = None) -> StagedShard:
        """Close the shard and write its index; with ``lengths`` (``(num_records, k)``, each
        record's lengths in the order written) its lengths file too."""
        return finish_all([self], [lengths])[0]

    def _close(self, lengths: np.ndarray | None) -> tuple[StagedShard, list[str]]:
        """Close the shard and write its index and lengths files, not yet durable: the shard
        staged, and the files to fsync before any manifest can name it."""
        self._writer.close()
        n = len(self._writer.offsets)
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"{self.tmp_path}: {len(lengths)} lengths for {n} records")
        files = [self.tmp_path, idx.index_path(self.tmp_path)]
        index_sha = idx.write_index(files[1], self._writer.offsets, sync=False)
        lengths_sha = None
        if lengths is not None:
            files.append(lengths_path(self.tmp_path))
            lengths_sha = write_lengths(files[2], lengths, sync=False)
        w = self._writer
        staged = StagedShard(self.tmp_path, n, w.num_bytes, w.sha256, index_sha, lengths_sha, w.crc32c)
        return staged, files

    def abort(self) -> None:
        self._writer.close()
        for p in (self.tmp_path, *_companions(self.tmp_path)):
            if os.path.exists(p):
                os.unlink(p)


def finish_all(sinks: list[ShardSink], lengths: list) -> list[StagedShard]:
    """`ShardSink.finish` of each of ``sinks`` (``lengths``: each one's, or None): every shard
    closed and its index and lengths files written, then all their files fsynced together (a
    thread each: the file system commits them at once, rather than one journal commit a file),
    then a "shard staged" crash point a shard, in order. Every file is durable on return."""
    closed = [s._close(ln) for s, ln in zip(sinks, lengths)]
    files = [p for _, ps in closed for p in ps]
    if len(files) > 1:
        with ThreadPoolExecutor(min(len(files), 16)) as pool:
            list(pool.map(_fsync, files))
    else:
        for p in files:
            _fsync(p)
    for _ in closed:
        crash_point("shard staged")
    return [staged for staged, _ in closed]


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_lengths(path: str, lengths, *, sync: bool = True) -> str:
    """Write a lengths file (`crossfeed.format.lengths.format_lengths`), durably unless ``sync``
    is False (the caller fsyncs it); its sha256."""
    data = format_lengths(lengths)
    with open(path, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def discard(staged: Iterable[StagedShard]) -> None:
    for s in staged:
        for p in (s.tmp_path, *_companions(s.tmp_path)):
            if os.path.exists(p):
                os.unlink(p)


# ---- crash points: a test kills the writer after step k of a commit, for every k ----------------

_CRASH_ENV = "CROSSFEED_TEST_CRASH_AT"
_crash_steps = 0


def crash_point(step: str) -> None:
    """A step of a write is done. With ``CROSSFEED_TEST_CRASH_AT=k`` in the environment the
    process SIGKILLs itself after the k-th such step, with ``CROSSFEED_TEST_CRASH_AT=STEP:k``
    after the k-th step named ``STEP`` (how tests prove commits atomic)."""
    global _crash_steps
    at = os.environ.get(_CRASH_ENV)
    if not at:
        return
    name, _, k = at.rpartition(":")
    if name and name != step:
        return
    _crash_steps += 1
    if _crash_steps == int(k):
        log.debug("crash point %d (%s): killing this process", _crash_steps, step)
        os.kill(os.getpid(), signal.SIGKILL)
