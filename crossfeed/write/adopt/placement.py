"""Where an adoption reads and where it writes: the data directory (local or any fsspec URL) is
only ever read; the manifest and the ``.idx`` files go beside the data, or into an index
directory when the data directory is read-only or remote (``crossfeed index --index-dir``).

A manifest written into an index directory records the data directory in its ``data_root``
(an absolute path or URL); readers open the shards there and the index files beside the
manifest (`crossfeed.read.sources.dataset.Dataset`). Every adopter (TFRecord, TFDS, WebDataset tars,
Parquet — which writes no index files, only the manifest) places its outputs through `placement`::

    place = placement(path, index_dir)           # validated; index_dir created
    for name in place.listdir():                 # the data files, plain names
        with place.open(name) as f: ...          # read only (local file or fsspec)
        write_index_for(place.index_path(name))  # never beside the data when index_dir is given
    write_manifest(place.root, Manifest(..., data_root=place.data_root))
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from crossfeed.errors import ConfigError, DatasetNotFoundError
from crossfeed.format import tfrecord
from crossfeed.format.manifest import MANIFEST
from crossfeed.io.files import file_sha256, map_file
from crossfeed.io.storage import FsOptions, filesystem, is_remote, join_url


@dataclass(frozen=True)
class Placement:
    """``data``: the data directory (absolute local path or fsspec URL), read only.
    ``root``: the local directory that receives the manifest and the index files.
    ``storage_options``: fsspec's options for a remote ``data`` (an endpoint, credentials …)."""

    data: str
    root: str
    storage_options: Mapping = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not self.data or not self.root:
            raise ConfigError("a placement needs a data directory and an index directory")

    @property
    def remote(self) -> bool:
        return is_remote(self.data)

    @property
    def separate(self) -> bool:
        """Whether the manifest and indexes sit apart from the data."""
        return self.remote or os.path.realpath(self.data) != os.path.realpath(self.root)

    @property
    def data_root(self) -> str | None:
        """The manifest's ``data_root``: None when the manifest sits beside the data."""
        return self.data if self.separate else None

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.root, MANIFEST)

    def data_url(self, name: str) -> str:
        return join_url(self.data, name) if self.remote else os.path.join(self.data, name)

    def index_path(self, name: str) -> str:
        """Where the index file of data file ``name`` goes."""
        return os.path.join(self.root, name + ".idx")

    def _fs(self):
        return filesystem(self.data, self.storage_options)

    def listdir(self) -> list[str]:
        """The plain file names in the data directory."""
        if not self.remote:
            return sorted(n for n in os.listdir(self.data) if os.path.isfile(os.path.join(self.data, n)))
        fs = self._fs()
        return sorted(
            e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(self.data, detail=True) if e["type"] == "file"
        )

    def read(self, name: str, limit: int) -> bytes:
        """A small data-directory file whole (TFDS's JSON, label names); one of more than
        ``limit`` bytes is refused before more than ``limit + 1`` of them are read."""
        where = self.data_url(name)
        try:
            if self.remote:
                data = self._fs().cat_file(where, start=0, end=limit + 1)
            else:
                with open(where, "rb") as f:
                    data = f.read(limit + 1)
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"{where}: no such file") from e
        if len(data) > limit:
            raise ConfigError(
                f"{where}: more than {limit} bytes, far more than such a file holds; is it the right file?"
            )
        return data

    def open(self, name: str):
        """A binary file object of data file ``name``, read only (local, or fsspec for a URL): what
        a tar or Parquet reader takes."""
        where = self.data_url(name)
        try:
            return self._fs().open(where, "rb") if self.remote else open(where, "rb")
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"{where}: no such file") from e

    def exists(self, name: str) -> bool:
        where = self.data_url(name)
        return self._fs().isfile(where) if self.remote else os.path.isfile(where)

    @contextlib.contextmanager
    def open_records(self, name: str) -> Iterator[tuple[Iterator[tuple[int, bytes | memoryview]], int, str]]:
        """``(records, file size, file sha256)`` of a TFRecord data file; ``records`` yields
        ``(offset, payload)`` with both CRCs checked. A plain local file is memory-mapped; a GZIP
        one is inflated as it is walked (`crossfeed.format.tfrecord.stream_records`: no index
        declares its length yet, so nothing is inflated whole); a remote file is fetched whole, once."""
        where = self.data_url(name)
        if not self.remote:
            if tfrecord.is_gzip(where):
                sha = file_sha256(where)
                with open(where, "rb") as f:
                    yield (
                        tfrecord.stream_records(tfrecord.inflate(f.read, where), where),
                        os.fstat(f.fileno()).st_size,
                        sha,
                    )
                return
            with map_file(where) as buf:
                yield tfrecord.records(buf, where), len(buf), file_sha256(where)
            return
        raw = self._fetch(where)
        sha = hashlib.sha256(raw).hexdigest()
        if tfrecord.looks_gzip(raw[: tfrecord.HEADER]):
            stream = io.BytesIO(raw)
            yield tfrecord.stream_records(tfrecord.inflate(stream.read, where), where), len(raw), sha
            return
        yield tfrecord.records(raw, where), len(raw), sha

    @contextlib.contextmanager
    def open_bytes(self, name: str) -> Iterator[tuple[object, int, str]]:
        """``(file bytes, file size, file sha256)`` of data file ``name`` as stored, nothing
        inflated (a tar or Parquet file indexed in place): a local file memory-mapped, a remote
        one fetched whole, once."""
        where = self.data_url(name)
        if not self.remote:
            try:
                sha = file_sha256(where)
            except FileNotFoundError as e:
                raise DatasetNotFoundError(f"{where}: no such file") from e
            with map_file(where) as buf:
                yield buf, len(buf), sha
            return
        raw = self._fetch(where)
        yield raw, len(raw), hashlib.sha256(raw).hexdigest()

    def _fetch(self, where: str) -> bytes:
        try:
            return self._fs().cat_file(where)
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"{where}: no such file") from e


def placement(path, index_dir=None, storage_options: Mapping | None = None) -> Placement:
    """Where adopting the data directory ``path`` reads and writes.

    Without ``index_dir`` the manifest and indexes go beside the data, which must then be a
    writable local directory. With it they go into ``index_dir`` (created if missing), and
    ``path`` — a local directory or an fsspec URL (reached with ``storage_options``) — is never
    written to."""
    storage_options = FsOptions(storage_options).to_dict()
    raw = os.fspath(path)
    if raw.startswith("file://"):
        raw = raw[len("file://") :]
    data = raw.rstrip("/") if is_remote(raw) else os.path.abspath(raw)
    if is_remote(data):
        fs = filesystem(data, storage_options)
        if not fs.isdir(data):
            raise DatasetNotFoundError(f"{data}: not a directory; pass the directory that holds the data files")
        if index_dir is None:
            raise ConfigError(
                f"{data}: a remote data directory is read in place; pass --index-dir DIR (index_dir=) for a local "
                f"directory to hold its manifest and index files"
            )
    elif not os.path.isdir(data):
        raise DatasetNotFoundError(f"{data}: not a directory; pass the directory that holds the data files")
    if index_dir is None:
        if not os.access(data, os.W_OK):
            raise ConfigError(
                f"{data}: the data directory is read-only; pass --index-dir DIR (index_dir=) to write the manifest "
                f"and index files there instead"
            )
        return Placement(data, data)
    root = os.fspath(index_dir)
    if is_remote(root):
        raise ConfigError(f"--index-dir {root}: the index directory must be a local directory")
    root = os.path.abspath(root.removeprefix("file://"))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"--index-dir {root}: exists and is not a directory")
    if not is_remote(data) and _inside(root, data) and os.path.realpath(root) != os.path.realpath(data):
        raise ConfigError(f"--index-dir {root}: lies inside the data directory {data}; pick a directory outside it")
    os.makedirs(root, exist_ok=True)
    return Placement(data, root, storage_options)


def _inside(path: str, parent: str) -> bool:
    p, q = os.path.realpath(path), os.path.realpath(parent)
    return p == q or p.startswith(q.rstrip(os.sep) + os.sep)
