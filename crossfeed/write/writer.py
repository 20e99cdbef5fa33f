"""Writing datasets without TensorFlow.

`write_dataset` is for data one process can produce. The pieces it is made of — `StagedShard`
(a shard written under a temporary name) and `commit_splits` (one atomic, journaled commit:
shards under fresh names, then the manifest by one rename, then the old files go) — are what
the Beam jobs use from many workers. A write never mixes two datasets in one directory: see
`check_target` for ``overwrite`` and ``add_split``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from crossfeed.errors import ConfigError, CrossfeedError, ManifestError, SchemaError
from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.format.encode import SampleSchemaError, encoder_for
from crossfeed.format.manifest import (
    MANIFEST,
    Manifest,
    ShardInfo,
    SplitInfo,
    check_name,
    fsync_dir,
    loads,
    shard_name,
    write_manifest,
)
from crossfeed.format.schema import Schema, infer_feature, widen
from crossfeed.format.stats import FeatureStats, merge_all

DEFAULT_SHARD_SIZE = 256 << 20
log = logging.getLogger(__name__)


TMP_PREFIX = ".tmp-"  # every temporary entry a writer makes in a dataset directory starts with this
_LOCK_TIMEOUT = 600.0


@dataclass(frozen=True)
class StagedShard:
    """A finished shard under a temporary name, waiting for `commit_splits`."""

    tmp_path: str
    num_records: int
    num_bytes: int
    sha256: str
    index_sha256: str | None = None


class ShardSink:
    """Writes one shard and its index file under temporary names in the dataset root
    (``.tmp-<tag>.tfrecord``; ``tag`` starts with the writer's token)."""

    def __init__(self, root: str, tag: str, *, compress: bool = False):
        self.tmp_path = os.path.join(root, f"{TMP_PREFIX}{tag}.tfrecord" + (".gz" if compress else ""))
        self._writer = tfrecord.RecordWriter(self.tmp_path, compress=compress)

    def write(self, payload: bytes) -> None:
        self._writer.write(payload)

    @property
    def num_records(self) -> int:
        return len(self._writer.offsets)

    @property
    def num_bytes(self) -> int:
        return self._writer.num_bytes

    def finish(self) -> StagedShard:
        self._writer.close()
        with open(self.tmp_path, "rb") as f:  # durable before any manifest can name it
            os.fsync(f.fileno())
        index_sha = idx.write_index(idx.index_path(self.tmp_path), self._writer.offsets)
        crash_point("shard staged")
        return StagedShard(
            self.tmp_path, len(self._writer.offsets), self._writer.num_bytes, self._writer.sha256, index_sha
        )

    def abort(self) -> None:
        self._writer.close()
        for p in (self.tmp_path, idx.index_path(self.tmp_path)):
            if os.path.exists(p):
                os.unlink(p)


def discard(staged: Iterable[StagedShard]) -> None:
    for s in staged:
        for p in (s.tmp_path, idx.index_path(s.tmp_path)):
            if os.path.exists(p):
                os.unlink(p)


def read_manifest(root: str) -> Manifest | None:
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            return loads(f.read(), path)
    except FileNotFoundError:
        return None


# ---- crash points: a test kills the writer after step k of a commit, for every k ----------------

_CRASH_ENV = "CROSSFEED_TEST_CRASH_AT"
_crash_steps = 0


def crash_point(step: str) -> None:
    """A step of a write is done. With ``CROSSFEED_TEST_CRASH_AT=k`` in the environment the
    process SIGKILLs itself after the k-th such step (how tests prove commits atomic)."""
    global _crash_steps
    at = os.environ.get(_CRASH_ENV)
    if not at:
        return
    _crash_steps += 1
    if _crash_steps == int(at):
        log.debug("crash point %d (%s): killing this process", _crash_steps, step)
        os.kill(os.getpid(), signal.SIGKILL)


# ---- locks --------------------------------------------------------------------------------------


@contextlib.contextmanager
def writer_lock(root: str, token: str) -> Iterator[None]:
    """Holds ``.tmp-<token>.lock`` (flock) while a writer's temporary files exist, so that others
    know they are alive; a temporary file whose writer's lock is free is stale."""
    path = os.path.join(root, f"{TMP_PREFIX}{token}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break  # not removed by a cleaner between our open and our flock
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def dataset_lock(root: str, timeout: float = _LOCK_TIMEOUT) -> Iterator[None]:
    """An exclusive flock on the dataset directory itself: one commit at a time (no extra file)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"{root}: another writer has been committing for {timeout:.0f} s; wait for it, or stop it"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _token_of(name: str) -> str:
    rest = name[len(TMP_PREFIX) :]
    return re.split(r"[-.]", rest, maxsplit=1)[0]


def _lock_is_free(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _remove_free_lock(path: str) -> None:
    """Unlink a lock file while holding it, so a writer that took it meanwhile is never robbed of
    it (`writer_lock` re-checks, after its flock, that its file is still the one at the path)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except (BlockingIOError, FileNotFoundError):
        pass  # a writer holds it now, or it is gone already
    finally:
        os.close(fd)


def remove_entry(path: str) -> int:
    """Delete a file or a directory tree (a staging folder) that may already be gone; 1 if it was there."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


def remove_stale(root: str, *, keep: str | None = None) -> int:
    """Remove what dead writers left in ``root`` (call with `dataset_lock` held): temporary files
    whose writer's lock is free (or who had none), except those of token ``keep``; and the shards
    that a commit killed half-way renamed into place but no manifest names (listed in its
    journal). Returns how many entries were removed."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    current = read_manifest_or_none(root)
    removed = 0
    live = {
        _token_of(n)
        for n in names
        if n.startswith(TMP_PREFIX) and n.endswith(".lock") and not _lock_is_free(os.path.join(root, n))
    }
    for n in sorted(names):
        if not n.startswith(TMP_PREFIX) or n.endswith(".lock"):
            continue
        tok = _token_of(n)
        if tok in live or tok == keep:
            continue
        path = os.path.join(root, n)
        if n.endswith(_JOURNAL):
            if current is False:  # the manifest is unreadable: which orphans are safe to delete is unknown
                continue
            removed += _undo_journal(root, path, current.files if current else set())
        removed += remove_entry(path)
    for n in names:  # locks of dead writers last
        if n.startswith(TMP_PREFIX) and n.endswith(".lock") and _token_of(n) not in live and _token_of(n) != keep:
            _remove_free_lock(os.path.join(root, n))
    if removed:
        log.info("%s: removed %d files left by writers that died", root, removed)
    return removed


def read_manifest_or_none(root: str):
    """The manifest, None when there is none, False when it cannot be read."""
    try:
        return read_manifest(root)
    except (CrossfeedError, OSError):
        return False


_JOURNAL = ".commit"


def _undo_journal(root: str, path: str, keep: set[str]) -> int:
    """Delete the files a dead commit's journal lists (those it created and those it retired) that
    the current manifest does not name."""
    try:
        with open(path, "rb") as f:
            names = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return 0
    removed = 0
    for n in names if isinstance(names, list) else ():
        try:  # a shard name, or a shard name + ".idx": a plain name inside root either way
            check_name(n.removesuffix(".idx") if isinstance(n, str) else n, path)
        except ManifestError:
            continue
        if n in keep:
            continue
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(os.path.join(root, n))
            removed += 1
    return removed


def dataset_entries(root: str) -> list[str]:
    """What ``root`` holds besides writers' temporary files."""
    try:
        return sorted(n for n in os.listdir(root) if not n.startswith(TMP_PREFIX))
    except FileNotFoundError:
        return []


def check_target(
    root: str, *, overwrite: bool = False, add_split: bool = False, splits=(), clean: bool = False
) -> Manifest | None:
    """Whether a write may go to ``root``; returns the dataset there (None when there is none).

    Refuses a directory that holds a dataset (unless ``overwrite``, which replaces it whole, or
    ``add_split``, which adds splits it does not have yet) and a non-empty directory that holds
    none (unless ``overwrite``): never two conversions' splits side by side, never a dataset
    written among unrelated files. With ``clean`` what dead writers left is removed first (their
    orphaned shards are not "unrelated files"); a commit, holding the lock already, cleans itself.
    """
    if overwrite and add_split:
        raise ConfigError("give overwrite=True (replace the whole dataset) or add_split=True (add a split), not both")
    if clean and os.path.isdir(root):
        with dataset_lock(root):
            remove_stale(root)
    try:
        old = read_manifest(root)
    except ManifestError:
        if not overwrite:
            raise
        old = None
    if old is None:
        entries = dataset_entries(root)
        if entries and not overwrite:
            raise ConfigError(
                f"{root}: the directory is not empty ({', '.join(entries[:3])}{', …' if len(entries) > 3 else ''}) and "
                f"holds no crossfeed dataset; write to a new directory, or pass overwrite=True (--overwrite)"
            )
        return None
    if add_split and old.data_root is not None:
        raise ConfigError(
            f"{root}: the dataset indexes data that lies in {old.data_root} (crossfeed index --index-dir); write new "
            f"splits to a dataset of their own, or overwrite=True to replace it with a self-contained one"
        )
    if add_split:
        clash = sorted(set(splits) & set(old.splits))
        if clash:
            raise ConfigError(
                f"{root}: the dataset already has split(s) {clash}; add_split adds new splits only. "
                f"Rewrite the whole dataset with overwrite=True (--overwrite)"
            )
    elif not overwrite:
        raise ConfigError(
            f"{root}: already holds a dataset (splits {sorted(old.splits)}); pass overwrite=True (--overwrite) to "
            f"replace all of it, add_split=True to add a new split, or write to a new directory"
        )
    return old


def commit_splits(
    root,
    staged: dict[str, list[StagedShard]],
    schema: Schema,
    *,
    statistics: dict[str, dict] | None = None,
    metadata: dict | None = None,
    overwrite: bool = False,
    add_split: bool = False,
    token: str | None = None,
) -> Manifest:
    """Publish staged shards as the splits of the dataset at ``root``, in one atomic step.

    The steps, each durable before the next: a journal lists the final names; the shards move to
    names no file of the current version has (``.g<N>`` when the plain names are taken); the new
    manifest replaces the old one by one rename — the commit point; the old version's files are
    deleted; the journal goes. A process killed at any step leaves the old version or the new one,
    whole, and the next commit removes what it left. See `check_target` for ``overwrite`` and
    ``add_split``; ``token`` names the writer whose temporary files are kept while it commits.
    """
    root = os.fspath(root)
    if not staged or any(not v for v in staged.values()):
        raise ConfigError(f"{root}: nothing to commit ({ {k: len(v) for k, v in staged.items()} })")
    with dataset_lock(root):
        remove_stale(root, keep=token)
        old = check_target(root, overwrite=overwrite, add_split=add_split, splits=staged)
        if old and add_split and old.schema != schema:
            raise SchemaError(
                f"{root}: the dataset's splits {sorted(old.splits)} have schema {old.schema.names} with other types "
                f"than the splits {sorted(staged)} being written; write to another directory, or overwrite it"
            )
        taken = old.files if old else set()
        generation = old.generation + 1 if old else 0
        plain = {
            name: [shard_name(name, i, len(shards), compress=s.tmp_path.endswith(".gz")) for i, s in enumerate(shards)]
            for name, shards in staged.items()
        }
        clash = any(n in taken or n + ".idx" in taken for names in plain.values() for n in names)
        finals = {
            name: [
                shard_name(
                    name, i, len(shards), compress=s.tmp_path.endswith(".gz"), generation=generation if clash else 0
                )
                for i, s in enumerate(shards)
            ]
            for name, shards in staged.items()
        }
        splits = dict(old.splits) if old and add_split else {}
        kept = {n for s in splits.values() for sh in s.shards for n in (sh.file, sh.file + ".idx")}
        # The journal names every file this commit creates or retires: whatever version a crash
        # leaves, the next commit deletes those of them that its manifest does not name.
        journal = os.path.join(root, f"{TMP_PREFIX}{token or secrets.token_hex(6)}-{secrets.token_hex(4)}{_JOURNAL}")
        _write_durably(
            journal,
            json.dumps(
                sorted({x for names in finals.values() for n in names for x in (n, n + ".idx")} | (taken - kept))
            ),
        )
        fsync_dir(root)
        crash_point("journal written")
        for name, shards in sorted(staged.items()):
            infos = []
            for s, final in zip(shards, finals[name]):
                os.replace(s.tmp_path, os.path.join(root, final))
                crash_point("shard renamed")
                os.replace(idx.index_path(s.tmp_path), idx.index_path(os.path.join(root, final)))
                crash_point("index renamed")
                infos.append(ShardInfo(final, s.num_records, s.num_bytes, s.sha256, s.index_sha256))
            splits[name] = SplitInfo(name, tuple(infos), (statistics or {}).get(name, {}))
        fsync_dir(root)
        meta = dict(old.metadata) if old and add_split else {}
        meta.update(metadata or {})
        manifest = Manifest(schema, splits, meta, generation)
        write_manifest(root, manifest, before_rename=lambda: crash_point("manifest staged"))
        crash_point("manifest renamed")  # the commit point: from here on readers see the new version
        for n in sorted(taken - manifest.files):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, n))  # a plain name (the manifest was checked): inside root
            crash_point("old file removed")
        fsync_dir(root)
        os.unlink(journal)
        crash_point("journal removed")
    return manifest


def _write_durably(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit_split(
    root,
    split: str,
    staged: list[StagedShard],
    schema: Schema,
    *,
    statistics: dict | None = None,
    metadata: dict | None = None,
    overwrite: bool = False,
    add_split: bool = False,
    token: str | None = None,
) -> Manifest:
    """`commit_splits` for one split."""
    return commit_splits(
        root,
        {split: staged},
        schema,
        statistics={split: statistics or {}},
        metadata=metadata,
        overwrite=overwrite,
        add_split=add_split,
        token=token,
    )


def write_dataset(
    path,
    samples: Iterable[Mapping],
    *,
    split: str = "train",
    num_shards: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    schema: Schema | None = None,
    compress: bool = False,
    metadata: dict | None = None,
    overwrite: bool = False,
    add_split: bool = False,
):
    """Write ``samples`` (dicts of numpy arrays, scalars, bytes or str) as split ``split`` of the
    dataset at ``path``, and return the opened dataset.

    With ``num_shards`` samples go round-robin, so shard counts differ by at most one; without it
    a new shard starts every ``shard_size`` bytes. The schema is inferred unless given (list
    lengths may vary; tensor shapes may not unless the schema says ``None``).

    ``path`` must be a new or empty directory. ``overwrite=True`` replaces the dataset there, all of
    its splits; ``add_split=True`` adds ``split`` to it, keeping its other splits (same schema).
    The commit is atomic (`commit_splits`): on any error, or if the process dies, readers see the
    old dataset or the new one, never a mix, and nothing of a failed write is left behind.
    """
    from crossfeed.read.dataset import open_dataset

    if num_shards is not None and num_shards < 1:
        raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
    if shard_size < 1:
        raise ConfigError(f"shard_size must be >= 1 byte, got {shard_size}")
    root = os.fspath(path)
    os.makedirs(root, exist_ok=True)
    check_target(root, overwrite=overwrite, add_split=add_split, splits=[split], clean=True)  # fail before the work
    token = secrets.token_hex(6)
    with writer_lock(root, token):
        _write(
            root,
            token,
            samples,
            split=split,
            num_shards=num_shards,
            shard_size=shard_size,
            schema=schema,
            compress=compress,
            metadata=metadata,
            overwrite=overwrite,
            add_split=add_split,
        )
    return open_dataset(root)


def _write(
    root: str,
    token: str,
    samples: Iterable[Mapping],
    *,
    split,
    num_shards,
    shard_size,
    schema,
    compress,
    metadata,
    overwrite,
    add_split,
) -> None:
    feats = {f.name: f for f in schema} if schema is not None else None
    inferred = schema is None
    sinks: list[ShardSink] = []
    staged: list[StagedShard] = []
    stats: dict[str, FeatureStats] = {}

    def new_sink() -> ShardSink:
        sinks.append(ShardSink(root, f"{token}-{split}-{len(sinks):05d}", compress=compress))
        return sinks[-1]

    def put(payload: bytes, count: int) -> None:
        if num_shards is not None:
            sinks[(count - 1) % num_shards].write(payload)
        else:
            if not sinks or sinks[-1].num_bytes >= shard_size:
                if sinks:
                    staged.append(sinks[-1].finish())
                new_sink()
            sinks[-1].write(payload)

    try:
        if num_shards is not None:
            for _ in range(num_shards):
                new_sink()
        count = 0
        if inferred:  # the schema may widen at any sample: one at a time
            enc = None
            for count, sample in enumerate(samples, 1):
                feats = _widen_all(feats, sample, count)
                sch = Schema(feats.values())
                if enc is None or enc.schema != sch:
                    enc = encoder_for(sch)
                try:
                    payload = enc.encode(sample)
                except SchemaError as e:
                    raise SchemaError(f"sample {count - 1}: {e}") from None
                for k, v in sample.items():
                    stats.setdefault(k, FeatureStats()).add(v)
                put(payload, count)
        else:  # a chunk at a time, with the same results and errors as one at a time
            enc = encoder_for(Schema(feats.values()))
            it = iter(samples)
            while True:
                chunk, pending = [], None
                try:
                    for sample in it:
                        chunk.append(sample)
                        if len(chunk) >= _CHUNK:
                            break
                except BaseException as e:  # raised after the samples before it, as it would have been
                    pending = e
                if chunk:
                    try:
                        payloads = enc.encode_rows(chunk)
                    except SampleSchemaError as e:
                        if e.index:
                            _add_stats({}, chunk[: e.index])  # what would have failed before it
                        raise SchemaError(f"sample {count + e.index}: {e.reason}") from None
                    _add_stats(stats, chunk)
                    for payload in payloads:
                        count += 1
                        put(payload, count)
                if pending is not None:
                    raise pending
                if len(chunk) < _CHUNK:
                    break
        if count == 0:
            raise ConfigError(f"no samples to write for split {split!r}: the iterable was empty")
        staged += [s.finish() for s in (sinks if num_shards is not None else sinks[-1:])]
        commit_split(
            root,
            split,
            staged,
            Schema(feats.values()),
            statistics={k: v.to_json() for k, v in merge_all([stats]).items()},
            metadata=metadata,
            overwrite=overwrite,
            add_split=add_split,
            token=token,
        )
    except BaseException:
        for s in sinks:
            s.abort()
        discard(staged)
        raise


_CHUNK = 1024
_STAT_SCALARS = {
    float: np.float64,
    np.float64: np.float64,
    np.float32: np.float32,
    int: np.int64,
    **{t: t for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)},
}


def _add_stats(stats: dict[str, FeatureStats], chunk: list) -> None:
    """``FeatureStats.add`` of every value of ``chunk`` (samples with the same keys), per column:
    columns of one scalar type take a few numpy operations with exactly the same result (min/max
    in order, the total summed left to right); anything else goes value by value."""
    for k in chunk[0]:
        st = stats.setdefault(k, FeatureStats())
        col = [s[k] for s in chunk]
        types = set(map(type, col))
        if types <= {str, bytes}:
            st.count += len(col)
            continue
        if len(types) == 1 and _add_scalars(st, col, _STAT_SCALARS.get(types.pop())):
            continue
        for v in col:
            st.add(v)


def _add_scalars(st: FeatureStats, col: list, dtype) -> bool:
    if dtype is None:
        return False
    try:
        arr = np.array(col, dtype=dtype)
    except (OverflowError, ValueError, TypeError):
        return False
    vals = arr.astype(np.float64)
    if arr.dtype.kind == "f" and (np.isnan(vals).any() or not vals.all()):
        return False  # NaN and ±0 make min/max depend on the order: go value by value
    lo, hi = float(vals.min()), float(vals.max())
    st.count += len(col)
    st.min = lo if st.min is None else min(st.min, lo)
    st.max = hi if st.max is None else max(st.max, hi)
    st.total = float(np.add.accumulate(np.concatenate(([st.total], vals)))[-1])
    st.n_values += len(col)
    return True


def _widen_all(feats, sample: Mapping, count: int):
    feats = dict(feats or {})
    if count > 1 and set(sample) != set(feats):
        raise SchemaError(f"sample {count - 1} has keys {sorted(sample)}, earlier samples had {sorted(feats)}")
    for k, v in sample.items():
        try:
            f = infer_feature(k, v)
            feats[k] = widen(feats[k], f) if k in feats else f
        except SchemaError as e:
            raise SchemaError(f"sample {count - 1}: {e}") from None
        except CrossfeedError:
            raise
    return feats
