"""Opening a dataset: ``open_dataset(path)`` → `Dataset`; ``ds["train"]`` → `Split`, a sized,
randomly accessible sequence of samples (``dict`` of numpy arrays).

A dataset is trusted no further than its own directory: a manifest's ``data_root`` elsewhere is
read only under a root the user allowed (`crossfeed.io.roots`). A dataset is read as the version
whose manifest was opened: a file of it that is gone or changed because a writer committed a new
version meanwhile raises `DatasetRewrittenError` (commits never reuse a shard name, so a name
never holds another version's bytes)."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import os
import re
import stat
from collections.abc import Iterator, Mapping
from typing import NoReturn

import numpy as np

from crossfeed.errors import (
    ConfigError,
    CorruptRecordError,
    CrossfeedError,
    DatasetNotFoundError,
    DatasetRewrittenError,
    ExampleError,
    IndexFileError,
    ManifestError,
    RootNotAllowedError,
    SplitNotFoundError,
    redact,
)
from crossfeed.format import example as ex
from crossfeed.format import hf, tar, tfrecord
from crossfeed.format import index as idx
from crossfeed.format.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    VERSION_FILE,
    Manifest,
    ShardInfo,
    SplitInfo,
    loads,
)
from crossfeed.format.schema import Schema, SchemaError, decode_value
from crossfeed.io import roots
from crossfeed.io.storage import ShardFile, Storage, is_remote
from crossfeed.read.sources.parquet import ParquetFiles

_AT_VERSION = re.compile(r"(.+)@v(\d{1,6})(?:-v(\d{1,6}))?")  # path@v3, or path@v3-v2: what v3 appended to v2
# bytes an index file may hold per record: "offset length\n" of two numbers up to 2^56 (17
# digits each), padded or not; a remote index is never read past this
INDEX_BYTES_PER_RECORD = 64


def split_version(path) -> tuple[object, int | None]:
    """``("data", 3)`` for ``"data@v3"`` (a version of a growing dataset); ``(path, None)`` for
    anything else — and for a local path that exists as it is spelled."""
    if not isinstance(path, (str, os.PathLike)):
        return path, None
    text = os.fspath(path)
    if not isinstance(text, str):
        return path, None
    m = _AT_VERSION.fullmatch(text)
    if m is None or m.group(3) is not None or (not is_remote(text) and os.path.exists(text)):
        return path, None
    return m.group(1), int(m.group(2))


def split_delta(path) -> tuple[object, int | None, int | None]:
    """``("data", 3, 2)`` for ``"data@v3-v2"`` (the shards version 3 appended to version 2),
    ``("data", 3, None)`` for ``"data@v3"``; ``(path, None, None)`` for anything else."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        return path, None, None
    text = os.fspath(path)
    m = _AT_VERSION.fullmatch(text)
    if m is None or (not is_remote(text) and os.path.exists(text)):
        return path, None, None
    return m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3))


def open_dataset(
    path,
    *,
    allowed_roots=(),
    read_timeout: float | None = None,
    storage_options: Mapping | None = None,
    version: int | None = None,
    since: int | None = None,
) -> Dataset:
    """Open the dataset at ``path`` (a directory or fsspec URL holding ``crossfeed.json``).
    ``allowed_roots``: directories or URLs (besides those ``$CROSSFEED_ALLOWED_ROOTS`` lists) under
    which a manifest's ``data_root`` outside the dataset may lie (`crossfeed.io.roots`).
    ``read_timeout``: the deadline of each remote read, in seconds (default
    ``$CROSSFEED_READ_TIMEOUT``, else `crossfeed.io.storage.READ_TIMEOUT`).
    ``storage_options``: fsspec's options for a URL — an endpoint, credentials, a region
    (``{"endpoint_url": "http://127.0.0.1:9000"}``); a ``data_root`` is reached with them too.
    Left out, the backend reads the standard environment and config files (docs/storage.md).
    ``version``: an earlier version of a dataset that was appended to (or ``"path@vN"``): its
    manifest as it was, checked against the SHA-256 the current manifest pins for it.
    ``since``: an earlier version (or ``"path@v3-v2"``): a *delta view*, only the shards that
    ``version`` (default: the newest) appended since then — a dataset of its own, whose identity
    is both versions' manifests; refused unless ``since`` → ``version`` is an append chain (every
    split of ``since`` is the start of the same split of ``version``, shard for shard)."""
    if isinstance(path, Dataset):
        if version is not None and version != path.version:
            raise ConfigError(f"{path.path} is opened at version {path.version}, not {version}")
        if since is not None and since != path.since_version:
            raise ConfigError(f"{path.path} is not the delta view since version {since}; open it by path with since=")
        return path
    path, at, at_since = split_delta(path)
    if version is None:
        version = at
    elif at is not None and at != version:
        raise ConfigError(f"{path}@v{at}: the path names version {at}, version={version} another")
    if since is None:
        since = at_since
    elif at_since is not None and at_since != since:
        raise ConfigError(f"{path}@v{at}-v{at_since}: the path names version {at_since}, since={since} another")
    allowed = roots.normalise_all(allowed_roots)
    storage = Storage(path, read_timeout=read_timeout, storage_options=storage_options)
    text = _read_manifest(storage)
    manifest = loads(text, storage.url(MANIFEST))
    if since is not None:
        return _delta_view(storage, manifest, text, version, since, allowed)
    if version is not None and version != manifest.dataset_version:
        text, manifest = _read_version(storage, manifest, version, allowed)
        return Dataset(storage, manifest, allowed_roots=allowed, text=text, pinned=True)
    return Dataset(storage, manifest, allowed_roots=allowed, text=text)


def _delta_view(storage: Storage, current: Manifest, text: bytes, version, since, allowed) -> Dataset:
    """The `Dataset` of the shards version ``version`` appended since version ``since`` (see
    `open_dataset`): ``version``'s manifest with each split cut to the shards after ``since``'s."""
    newest = current.dataset_version
    version = newest if version is None else version
    if type(since) is not int or type(version) is not int or not 1 <= since < version:
        raise ConfigError(
            f"{storage.root}@v{version}-v{since}: a delta view reads what a version appended since an "
            f"earlier one: since= must be a version from 1 to {version!r} - 1"
        )
    newer_text, newer = (text, current) if version == newest else _read_version(storage, current, version, allowed)
    older_text, older = _read_version(storage, current, since, allowed)
    where = f"{storage.root}@v{version}-v{since}"
    old_sha = hashlib.sha256(older_text).hexdigest()
    if dict(newer.versions).get(since) != old_sha:
        raise ConfigError(f"{where}: version {version} does not pin version {since}'s manifest: not an append chain")
    if older.schema.to_json() != newer.schema.to_json() or older.data_root != newer.data_root:
        raise ConfigError(
            f"{where}: versions {since} and {version} differ in schema or data root: not an append chain; "
            f"read version {version} whole (path@v{version})"
        )
    splits = {}
    for name, info in newer.splits.items():
        before = older.splits.get(name)
        k = 0 if before is None else len(before.shards)
        if before is not None and (before.format != info.format or info.shards[:k] != before.shards):
            raise ConfigError(
                f"{where}: split {name!r} of version {version} does not begin with version {since}'s "
                f"{k} shards: not an append chain (was the dataset rewritten?); read version {version} whole"
            )
        if len(info.shards) > k:
            splits[name] = SplitInfo(name, info.shards[k:], {}, info.format)
    for name in older.splits:
        if name not in newer.splits:
            raise ConfigError(
                f"{where}: version {version} has no split {name!r}, version {since} has: not an append chain"
            )
    if not splits:
        raise ConfigError(f"{where}: version {version} appended no shards to version {since}")
    delta = dataclasses.replace(newer, splits=splits)
    return Dataset(
        storage, delta, allowed_roots=allowed, text=newer_text, pinned=version != newest, since=(since, old_sha)
    )


def _read_version(storage: Storage, current: Manifest, version, allowed=()) -> tuple[bytes, Manifest]:
    """Version ``version``'s manifest bytes (``crossfeed.v<N>.json``), checked against the
    current manifest's ``versions``; `ConfigError` naming the versions there are otherwise."""
    if type(version) is not int or not 1 <= version <= current.dataset_version:
        raise ConfigError(
            f"{storage.root}: no version {version!r} of the dataset; it has versions 1 to {current.dataset_version}"
        )
    pinned = dict(current.versions).get(version)
    if pinned is None:
        raise ConfigError(
            f"{storage.root}: version {version} of the dataset is not kept (it was overwritten); the current "
            f"manifest lists versions {[v for v, _ in current.versions] + [current.dataset_version]}"
        )
    rel = VERSION_FILE.format(version)
    if not storage.remote:  # the dataset's own file: no link out of it, no FIFO (`roots.check_own_file`)
        roots.check_own_file(storage.url(rel), storage.root, allowed, ManifestError)
    try:
        text = storage.read(rel, limit=MAX_MANIFEST_BYTES)
    except (DatasetNotFoundError, FileNotFoundError):
        raise ManifestError(f"{storage.url(rel)}: version {version}'s manifest is missing; it cannot be read") from None
    if hashlib.sha256(text).hexdigest() != pinned:
        raise ManifestError(
            f"{storage.url(rel)}: its sha256 is not the one the current manifest pins for version {version}; "
            f"the file was edited or damaged"
        )
    manifest = loads(text, storage.url(rel))
    if manifest.dataset_version != version:
        raise ManifestError(f"{storage.url(rel)}: says it is version {manifest.dataset_version}, not {version}")
    return text, manifest


def _read_manifest(storage: Storage) -> bytes:
    def too_long(n: int) -> Exception:
        return ManifestError(
            f"{storage.url(MANIFEST)}: {n} bytes or more, more than a manifest may hold "
            f"({MAX_MANIFEST_BYTES}); this is not a crossfeed manifest"
        )

    try:
        return storage.read(MANIFEST, limit=MAX_MANIFEST_BYTES, too_long=too_long)
    except DatasetNotFoundError:
        found = _hf_kind(storage)
        if found is not None:
            raise DatasetNotFoundError(hf.advice(storage.root, found)) from None
        raise DatasetNotFoundError(
            f"{storage.root}: not a crossfeed dataset (no {MANIFEST}); write one with crossfeed.write_dataset, "
            f"`crossfeed convert`, or adopt existing TFRecord shards with `crossfeed index`"
        ) from None
    except OSError as e:  # a directory or unreadable file where the manifest should be
        raise ManifestError(f"{storage.url(MANIFEST)}: cannot read the manifest ({e.strerror or e})") from e


def _hf_kind(storage: Storage) -> str | None:
    """What Hugging Face folder a local root without a manifest is (`crossfeed.format.hf`), if any."""
    if storage.remote:
        return None
    try:
        return hf.kind(os.listdir(storage.root))
    except OSError:
        return None


class Dataset:
    """``index_storage`` holds the manifest and index files; ``storage`` the shards — the same
    place unless the manifest names a ``data_root`` (data adopted in place with ``--index-dir``),
    which must lie inside the dataset or under one of ``allowed_roots`` (`crossfeed.io.roots`).
    ``text``: the manifest's bytes as read, which `rewritten` compares the current one with."""

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        *,
        allowed_roots=(),
        text: bytes | None = None,
        pinned: bool = False,
        since: tuple[int, str] | None = None,
    ):
        self.index_storage = storage
        # a delta view (``path@v3-v2``): the version and manifest SHA-256 its shards were appended to
        self.since_version: int | None = since[0] if since is not None else None
        self.since_sha256: str | None = since[1] if since is not None else None
        # opened at an earlier version (``path@vN``): read from its kept manifest, which never changes
        self.pinned = pinned
        self.allowed_roots: tuple[str, ...] = roots.normalise_all(allowed_roots)
        if manifest.data_root is None:
            self.storage = storage
        else:
            where = storage.url(MANIFEST)
            self.storage = Storage(
                roots.check_data_root(manifest.data_root, storage.root, self.allowed_roots, where),
                read_timeout=storage.read_timeout,
                storage_options=storage.storage_options,
            )
        self.manifest = manifest
        self.manifest_sha256 = None if text is None else hashlib.sha256(text).hexdigest()
        self._splits: dict[str, Split] = {}
        self._stamp = self._manifest_stamp()  # the version opened, as the file system sees it (local)

    def _manifest_stamp(self) -> tuple | None:
        if self.index_storage.remote or self.manifest_sha256 is None or self.pinned:
            return None
        try:
            st = os.stat(self.index_storage.url(MANIFEST))
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def check_version(self, where: str) -> None:
        """Raise `DatasetRewrittenError` if the manifest is no longer the one this reader opened
        (a dataset written again under the same shard names): checked when a shard is first
        opened, so no batch mixes two versions. A stat of the manifest; hashed only if it changed."""
        if self._stamp is None:
            return
        now = self._manifest_stamp()
        if now == self._stamp:
            return
        err = self.rewritten(where, "the shard belongs to another version of the dataset")
        if err is not None:
            raise err
        self._stamp = now  # touched, not changed

    def rewritten(self, where: str, what: str) -> DatasetRewrittenError | None:
        """The error to raise when a file of this version (``where``) is gone or changed
        (``what``): a `DatasetRewrittenError` if the manifest is no longer the one this reader
        opened (a writer committed meanwhile), else None — the file itself is at fault."""
        if self.manifest_sha256 is None:
            return None
        data: bytes | None
        now: str | None
        try:
            data = self.index_storage.read(MANIFEST, limit=MAX_MANIFEST_BYTES)
            now = hashlib.sha256(data).hexdigest()
        except OSError:  # DatasetNotFoundError included: the manifest is gone, the dataset with it
            data = now = None
        if now == self.manifest_sha256:
            return None
        if data is not None and self._kept_in(data):
            return None  # appended to: this version is kept, every file of it with it
        return DatasetRewrittenError(
            f"{where}: {what}: the dataset was rewritten while this reader had it open (its manifest "
            f"{self.index_storage.url(MANIFEST)} changed); reopen it"
        )

    def _kept_in(self, data: bytes) -> bool:
        """Whether the manifest ``data`` keeps this reader's version (a later version of an
        appended dataset: no file of the earlier ones is removed)."""
        try:
            later = loads(data, self.index_storage.url(MANIFEST))
        except CrossfeedError:
            return False
        return (self.manifest.dataset_version, self.manifest_sha256) in later.versions

    @property
    def path(self) -> str:
        """Where the dataset lies (``root@vN`` when opened at an earlier version: reopening it
        by this path opens the same version)."""
        root = self.index_storage.root
        if self.since_version is not None:
            return f"{root}@v{self.manifest.dataset_version}-v{self.since_version}"
        return f"{root}@v{self.manifest.dataset_version}" if self.pinned else root

    @property
    def version(self) -> int:
        """Which version of the dataset this is (1 for a dataset never appended to)."""
        return self.manifest.dataset_version

    @property
    def schema(self) -> Schema:
        return self.manifest.schema

    @property
    def splits(self) -> dict[str, SplitInfo]:
        return self.manifest.splits

    @property
    def metadata(self) -> dict:
        return self.manifest.metadata

    def __getitem__(self, split: str) -> Split:
        if split not in self.manifest.splits:
            raise SplitNotFoundError(f"{self.path}: no split {split!r}; it has {sorted(self.manifest.splits)}")
        if split not in self._splits:
            self._splits[split] = Split(self, self.manifest.splits[split])
        return self._splits[split]

    def __contains__(self, split: str) -> bool:
        return split in self.manifest.splits

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v.num_records}" for k, v in self.splits.items())
        return f"Dataset({redact(self.path)!r}, {counts}, features={self.schema.names})"

    def close(self) -> None:
        for s in self._splits.values():
            s.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _VersionShard(ShardFile):
    """A shard of the version a `Dataset` opened: a file gone when it is first read is reported
    as a rewrite of the dataset where its manifest changed (`Dataset.rewritten`)."""

    def __init__(self, dataset: Dataset, storage: Storage, rel: str, *, size: int | None = None, stream_bytes=None):
        super().__init__(storage, rel, size=size, stream_bytes=stream_bytes)
        self.dataset = dataset

    def load(self):
        first = self._buf is None
        if first:
            self.dataset.check_version(self.path)
        try:
            buf = super().load()
        except FileNotFoundError as e:
            self._gone(e)
        if first and self.size is not None and not self.storage.remote and len(buf) != self.size:
            # another version's shard (its manifest changed meanwhile); else damage, which the
            # record checks name record by record
            err = None if tfrecord.is_gzip(self.path) else self.dataset.rewritten(self.path, "the shard's size changed")
            if err is not None:
                raise err
        return buf

    def record(self, offset: int, length: int) -> memoryview:
        try:
            return super().record(offset, length)
        except FileNotFoundError as e:
            self._gone(e)

    def raw(self, offset: int, length: int) -> tuple:
        try:
            return super().raw(offset, length)
        except FileNotFoundError as e:
            self._gone(e)

    def _gone(self, e: FileNotFoundError) -> NoReturn:
        err = self.dataset.rewritten(self.path, "the shard file is gone")
        if err is None:
            raise e
        raise err from e


class Split:
    """The records of one split. ``split[i]`` decodes sample ``i`` (global index, shard order)."""

    def __init__(self, dataset: Dataset, info: SplitInfo):
        self.dataset = dataset
        self.info = info
        self.name = info.name
        self.schema = dataset.schema
        self.shards: tuple[ShardInfo, ...] = info.shards
        self.counts = np.array([s.num_records for s in info.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._files: dict[int, _VersionShard] = {}  # made on first use: a split may list 2^20 shards
        self._index: list[np.ndarray | None] = [None] * len(info.shards)
        self._parquet: ParquetFiles | None = None
        self._lazy: list = [None] * len(info.shards)  # shard → its `LazyIndex`, or False: read whole
        self._fds: list[int] = []  # the lazy indexes' open files

    @property
    def block_counts(self) -> np.ndarray:
        """The record counts of the units a block shuffle windows over: the shards, or the row
        groups of Parquet files (global sample numbers are the same either way)."""
        if self.info.format == "parquet":
            return np.asarray([n for s in self.shards for n in s.row_groups or ()], dtype=np.int64)
        return self.counts

    def __len__(self) -> int:
        return int(self.starts[-1])

    def file(self, shard: int) -> ShardFile:
        f = self._files.get(shard)
        if f is None:  # (setdefault: two threads at once keep one; neither has opened anything yet)
            s = self.shards[shard]
            f = self._files.setdefault(
                shard,
                _VersionShard(
                    self.dataset,
                    self.dataset.storage,
                    s.file,
                    size=s.num_bytes,
                    stream_bytes=functools.partial(self.stream_end, shard),
                ),
            )
        return f

    def index(self, shard: int) -> np.ndarray:
        """``(n, 2)`` int64 ``(offset, length)`` of each record of a shard, checked against the manifest."""
        arr = self._index[shard]
        if arr is None:
            info = self.shards[shard]
            where = self.dataset.index_storage.url(idx.index_path(info.file))
            self._check_regular(shard, where)
            limit = INDEX_BYTES_PER_RECORD * (info.num_records + 1)

            def too_long(n: int) -> Exception:
                return IndexFileError(
                    f"{where}: {n} bytes or more, more than an index of {info.num_records} records may "
                    f"hold ({limit}); rebuild it with `crossfeed index --force`"
                )

            try:
                data = self.dataset.index_storage.read(idx.index_path(info.file), limit=limit, too_long=too_long)
            except DatasetNotFoundError as e:
                raise self.dataset.rewritten(where, "the index file is gone") or IndexFileError(
                    f"{where}: index file is missing; rebuild it with `crossfeed index`"
                ) from e
            except OSError as e:
                raise IndexFileError(f"{where}: cannot read the index file ({e.strerror or e})") from e
            try:
                arr = idx.checked_index(data, where, info, gzip=lambda: self._is_gzip(shard))
            except IndexFileError as e:
                err = self.dataset.rewritten(where, "the index file changed")
                if err is None:
                    raise
                raise err from e
            self._index[shard] = arr
        return arr

    def stream_end(self, shard: int) -> int:
        """Where shard ``shard``'s last record ends, as its checked index says: the length of its
        uncompressed stream, and so the most a GZIP shard may inflate to."""
        index = self.lazy_index(shard)
        if isinstance(index, np.ndarray):
            return int(index[-1, 0] + index[-1, 1]) if len(index) else 0
        return int(index.end)

    def entries(self, shard: int, k: np.ndarray) -> np.ndarray:
        """``index(shard)[k]``, without reading the whole index where it need not be: a local
        index of fixed-width lines is read in place (`crossfeed.format.index.LazyIndex`)."""
        return self.lazy_index(shard)[k]

    def lazy_index(self, shard: int):
        """Shard ``shard``'s index as a `LazyIndex` (local, fixed-width lines, not loaded whole
        yet), or else the whole checked index."""
        lazy = self._lazy[shard]
        if lazy is None:
            lazy = self._lazy[shard] = self._open_lazy(shard) or False
        return lazy if lazy is not False else self.index(shard)

    def _open_lazy(self, shard: int):
        if self.dataset.index_storage.remote or self._index[shard] is not None:
            return None
        info = self.shards[shard]
        where = self.dataset.index_storage.url(idx.index_path(info.file))
        self._check_regular(shard, where)
        try:
            fd = os.open(where, os.O_RDONLY)
        except OSError:
            return None  # reported by `index`, which names the problem
        self._fds.append(fd)
        gz = self.file(shard).rel.endswith(".gz") or self._is_gzip(shard)
        return idx.LazyIndex.open(
            lambda off, n: os.pread(fd, n, off),
            os.fstat(fd).st_size,
            where,
            info.num_records,
            None if gz else info.num_bytes,
        )

    def _check_regular(self, shard: int, index_where: str) -> None:
        """A local shard and its index must be regular files inside their root: a FIFO would
        block the reader forever, a device never end; a symlink is followed only where it stays
        inside the dataset (or its data root) or under an allowed root (`crossfeed.io.roots`)."""
        checks = (
            (self.dataset.storage, self.file(shard).path, None),
            (self.dataset.index_storage, index_where, True),
        )
        for storage, where, error in checks:
            if storage.remote:
                continue
            try:
                mode = os.stat(where).st_mode
            except OSError:
                continue  # missing: reported where it is read
            if not stat.S_ISREG(mode):
                reason = "not a regular file (a directory, FIFO or device); shards and index files are plain files"
                raise IndexFileError(f"{where}: {reason}") if error else CorruptRecordError(where, 0, reason)
            real = os.path.realpath(where)
            allowed = (*self.dataset.allowed_roots, *roots.from_env())
            if not roots.within(real, os.path.realpath(storage.root), allowed):
                raise RootNotAllowedError(
                    f"{where}: a symbolic link to {real}, outside the dataset ({storage.root}); crossfeed "
                    f"follows links out of a dataset only to a root you allow: {roots.how_to_allow(os.path.dirname(real))}"
                )

    def _is_gzip(self, shard: int) -> bool:
        f = self.file(shard)
        if f.rel.endswith(".gz"):
            return True
        storage = f.storage
        if not storage.remote:
            return tfrecord.is_gzip(f.path)
        try:
            return tfrecord.looks_gzip(storage.read_range(f.rel, 0, tfrecord.HEADER))
        except (OSError, ValueError):
            return False

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard, record_within_shard)`` of global index ``i``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for split {self.name!r} of {n} samples")
        i %= n
        s = bisect.bisect_right(self.starts, i) - 1
        return s, i - int(self.starts[s])

    def payload(self, shard: int, k: int) -> memoryview:
        off, length = self.index(shard)[k]
        return self.file(shard).record(int(off), int(length))

    def parse(self, shard: int, k: int) -> dict:
        """``example.decode`` of a record; a malformed Example names shard and offset."""
        data = self.payload(shard, k)
        try:
            return ex.decode(data)
        except ExampleError as e:
            off = int(self.index(shard)[k][0])
            raise CrossfeedError(
                f"{self.file(shard).path}: record at byte offset {off} is not a tf.train.Example: {e}"
            ) from e

    def decode(self, shard: int, k: int, *, features=None, decode_images: bool = True) -> dict:
        feats = self.schema if features is None else [self.schema[n] for n in features]
        if self.info.format == tar.FORMAT:  # WebDataset tar shards, read in place
            off, length = (int(x) for x in self.index(shard)[k])
            sf = self.file(shard)
            buf, base = sf.raw(off, length)
            return tar.decode_sample(buf, off - base, length, sf.path, feats, decode_images=decode_images, base=base)
        if self.info.format == "parquet":
            if self._parquet is None:
                self._parquet = ParquetFiles(self)
            return self._parquet.row(shard, k, feats, decode_images=decode_images)
        parsed = self.parse(shard, k)
        try:
            return {f.name: decode_value(f, parsed, decode_images=decode_images) for f in feats}
        except (SchemaError, ExampleError) as e:
            off = int(self.index(shard)[k][0])
            raise type(e)(f"{self.file(shard).path}: record at byte offset {off}: {e}") from e

    def __getitem__(self, i: int) -> dict:
        return self.decode(*self.locate(int(i)))

    def __iter__(self) -> Iterator[dict]:
        for s, n in enumerate(self.counts):
            for k in range(int(n)):
                yield self.decode(s, k)

    def close(self) -> None:
        for f in list(self._files.values()):
            f.close()
        if self._parquet is not None:
            self._parquet.close()
        fds, self._fds, self._lazy = self._fds, [], [None] * len(self._lazy)
        for fd in fds:
            os.close(fd)
