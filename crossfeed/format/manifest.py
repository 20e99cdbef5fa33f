"""The manifest: ``crossfeed.json`` at the dataset root, written last and atomically.

It holds the schema, the splits and, per shard, the file name, record count, byte size, sha256
and the sha256 of its index file. A directory without it is not a dataset. Shards sit beside it,
or in its ``data_root`` (data adopted in place with ``crossfeed index --index-dir``).

A manifest is data from disk, so it is checked in full when it is read (`loads`): every field's
type and range, file names that stay inside the dataset directory (`check_name`), shard files
unique across splits, feature names unique, size and nesting limits. Every problem is a
`ManifestError` naming the field, e.g. ``splits.train.shards[3].num_records``."""

from __future__ import annotations

import json
import os
import re
import secrets
import urllib.parse
from dataclasses import dataclass, field
from typing import NoReturn

from crossfeed.errors import ManifestError, SchemaError
from crossfeed.format.codecs import codec_of
from crossfeed.format.schema import SHAPE_SUFFIX, Encoding, Feature, Schema

MANIFEST = "crossfeed.json"
# An earlier version of a dataset that was appended to (`Manifest.versions`): its manifest's bytes,
# kept as they were (its SHA-256 is still that version's identity), beside the current one
VERSION_FILE = "crossfeed.v{}.json"
_VERSION_NAME = re.compile(r"crossfeed\.v\d+\.json")
MAX_VERSIONS = 1 << 16
TMP_MANIFEST_PREFIX = ".tmp-manifest-"
FORMAT = "crossfeed.read.dataset"  # the on-disk format id: fixed, whatever module reads it
VERSION = 1
MAX_ROW_GROUPS = 1 << 20
# Bounds a manifest must stay within (far above any real dataset; they stop hostile files early).
MAX_MANIFEST_BYTES = 256 << 20
MAX_DEPTH = 32
MAX_NAME_BYTES = 255
MAX_SPLITS = 1024
MAX_SHARDS = 1 << 20  # per split; the manifest's byte cap holds about 950,000 shards of crossfeed's naming
# Records per shard: a shard's index is read whole into 16 bytes per record (a 64 GiB array at
# this cap), and its lengths into 4 per feature: a shard of more is data to split into more shards
MAX_SHARD_RECORDS = 1 << 32
# JSON values (counted before parsing, as the commas, '[' and '{' of the text: strings holding them
# count too): what parsing allocates is bounded by this, not only by the bytes (``[{},{},…]`` is
# 64 bytes of memory per 3 bytes of text). A shard is about 7 values, so 2^20 shards fit
MAX_VALUES = 16 << 20
MAX_FEATURES = 4096
MAX_RANK = 32
MAX_DIM = 1 << 40
MAX_BYTES = 1 << 50
MAX_INT = 1 << 62
# How a split's shards are laid out ("tfrecord" unless the manifest says): crossfeed's own TFRecord
# shards (and adopted ones), WebDataset tars read in place (`crossfeed.format.tar`), Parquet files read
# in place (`crossfeed.format.parquet`: row groups from the footers, no index files).
SPLIT_FORMATS = ("tfrecord", "tar", "parquet")
MAX_DATA_ROOT = 4096
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_NOT_IN_SEGMENT = re.compile(r"[/\\\x00-\x1f\x7f]")  # a separator or a control character


def shard_name(split: str, i: int, n: int, *, compress: bool = False, generation: int = 0) -> str:
    """``train-00003-of-00008.tfrecord`` (``.tfrecord.gz`` when GZIP); with a ``generation``
    ``train-00003-of-00008.g2.tfrecord``: every commit after a directory's first names its shards
    with its own generation, so no name is ever reused for other bytes."""
    gen = f".g{generation}" if generation else ""
    return f"{split}-{i:05d}-of-{n:05d}{gen}.tfrecord" + (".gz" if compress else "")


def check_name(name, where: str) -> str:
    """``name`` if it is a plain file name inside the dataset root, else `ManifestError`.

    Every file a manifest names (shards, and so their ``.idx`` files) must be one: no directory
    part, not ``.``/``..``, no leading dot (temporary files), no control characters, not the
    manifest, an index or a lengths file itself — and none of these once percent-decoded (``%2e%2e`` is
    ``..`` in a URL, ``%2f`` a ``/``). So nothing a manifest says can make crossfeed read, write
    or delete a file outside the dataset directory."""
    if not isinstance(name, str):
        raise ManifestError(f"{where}: expected a file name (string), got {type(name).__name__}")
    bad = (
        not name
        or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
        or name.startswith(".")
        or not plain_segment(name)
        or urllib.parse.unquote(name).startswith(".")
        or name == MANIFEST
        or _VERSION_NAME.fullmatch(name) is not None
        or name.endswith((".idx", ".len"))
    )
    if bad:
        raise ManifestError(
            f"{where}: {name!r} is not a plain file name inside the dataset directory (no '/', no leading '.', "
            f"not even percent-decoded, not {MANIFEST}, an .idx or a .len file); shards must sit beside {MANIFEST}"
        )
    return name


def plain_segment(name: str) -> bool:
    """Whether ``name`` is one plain path segment, as itself and percent-decoded (again and
    again until nothing changes: a remote shard's name is joined into a URL, and ``%2e%2e`` is
    ``..`` to the server, ``%2f`` a ``/``): not ``.``/``..``, no ``/`` or ``\\``, no control
    character. Each decoding round shortens the text, so the loop ends."""
    form = name
    while True:
        if form in (".", "..") or _NOT_IN_SEGMENT.search(form):
            return False
        decoded = urllib.parse.unquote(form, errors="surrogateescape") if "%" in form else form
        if decoded == form:
            return True
        form = decoded


def url_problem(url: str) -> str | None:
    """What makes ``url`` unfit as a root (None when it is fit): a scheme (no chained ``a::b://``),
    no query or fragment, no ``.``/``..`` segment or backslash, even percent-decoded."""
    if not _SCHEME.match(url):
        return "expected scheme://host/path (letters, digits, '+', '.', '-' before '://')"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return "a root has no query ('?') or fragment ('#')"
    segments = [s for s in parts.path.split("/") if s]
    if not all(plain_segment(s) for s in segments) or not plain_segment(parts.netloc or "host"):
        return "no '.' or '..' segments, backslashes or control characters (percent-encoded ones included)"
    return None


@dataclass(frozen=True)
class ShardInfo:
    file: str  # a plain name in the dataset root (`check_name`)
    num_records: int
    num_bytes: int
    sha256: str
    index_sha256: str | None = None  # sha256 of the .idx file; None in manifests of older crossfeed
    row_groups: tuple[int, ...] | None = None  # Parquet: the rows of each row group (from the footer)
    lengths_sha256: str | None = None  # sha256 of the .len file (`crossfeed.format.lengths`), if any
    # CRC32C of the shard file's bytes (unmasked; None in manifests of older crossfeed and adopted
    # shards): one C call checks a whole shard at ~10 GB/s, where the sha256 runs at ~2
    crc32c: int | None = None

    @property
    def compressed(self) -> bool:
        return self.file.endswith(".gz")

    def to_json(self) -> dict:
        d = {"file": self.file, "num_records": self.num_records, "num_bytes": self.num_bytes, "sha256": self.sha256}
        if self.index_sha256 is not None:
            d["index_sha256"] = self.index_sha256
        if self.row_groups is not None:
            d["row_groups"] = list(self.row_groups)
        if self.lengths_sha256 is not None:
            d["lengths_sha256"] = self.lengths_sha256
        if self.crc32c is not None:
            d["crc32c"] = self.crc32c
        return d


@dataclass(frozen=True)
class SplitInfo:
    name: str
    shards: tuple[ShardInfo, ...]
    statistics: dict = field(default_factory=dict)
    format: str = "tfrecord"  # one of SPLIT_FORMATS

    def __post_init__(self):
        if self.format not in SPLIT_FORMATS:
            raise ManifestError(f"split {self.name!r}: format {self.format!r} is not one of {', '.join(SPLIT_FORMATS)}")

    @property
    def num_records(self) -> int:
        return sum(s.num_records for s in self.shards)

    def __len__(self) -> int:
        """The split's records (``len(ds.splits["train"])``, as ``len(ds["train"])``)."""
        return self.num_records

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)


@dataclass(frozen=True)
class Manifest:
    schema: Schema
    splits: dict[str, SplitInfo]
    metadata: dict = field(default_factory=dict)
    generation: int = 0  # bumped by every commit, whose shards carry it in their names (`shard_name`)
    # Where the shards lie when not beside the manifest (an adopted read-only or remote directory,
    # `crossfeed index --index-dir`): an absolute path or URL. Index files stay beside the manifest.
    data_root: str | None = None
    # The features whose per-record lengths lie beside each shard (`crossfeed.format.lengths`),
    # in the lengths files' column order
    lengths: tuple[str, ...] = ()
    # Growing datasets (`crossfeed.write.commit.commit_splits` with ``append``): this manifest is
    # version ``dataset_version`` of the dataset; ``versions`` pins each earlier one still readable
    # (``{version: sha256}`` of its manifest's bytes, kept as `VERSION_FILE`), 1 … dataset_version-1
    dataset_version: int = 1
    versions: tuple[tuple[int, str], ...] = ()

    @property
    def files(self) -> set[str]:
        """Every file of the dataset: shards, their index files and lengths files (plain names),
        and the kept manifests of its earlier versions."""
        return {
            n
            for s in self.splits.values()
            for sh in s.shards
            for n in (
                ((sh.file,) if s.format == "parquet" else (sh.file, sh.file + ".idx"))
                + ((sh.file + ".len",) if sh.lengths_sha256 is not None else ())
            )
        } | {VERSION_FILE.format(v) for v, _ in self.versions}

    def to_json(self) -> dict:
        d = {
            "format": FORMAT,
            "version": VERSION,
            "schema": self.schema.to_json(),
            "splits": {
                name: {
                    "num_records": s.num_records,
                    "num_bytes": s.num_bytes,
                    "shards": [sh.to_json() for sh in s.shards],
                    "statistics": s.statistics,
                    **({"format": s.format} if s.format != "tfrecord" else {}),
                }
                for name, s in sorted(self.splits.items())
            },
            "metadata": self.metadata,
        }
        if self.generation:
            d["generation"] = self.generation
        if self.data_root is not None:
            d["data_root"] = self.data_root
        if self.lengths:
            d["lengths"] = list(self.lengths)
        if self.dataset_version != 1:
            d["dataset_version"] = self.dataset_version
        if self.versions:
            d["versions"] = [{"version": v, "sha256": sha} for v, sha in self.versions]
        return d

    @classmethod
    def from_json(cls, d, where: str) -> Manifest:
        """The manifest a parsed ``crossfeed.json`` holds, every field checked (`ManifestError`
        naming the field, e.g. ``splits.train.shards[3].num_records``)."""
        return _Validator(where).manifest(d)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n"


def write_manifest(root: str | os.PathLike, manifest: Manifest, *, before_rename=None) -> None:
    """Write ``crossfeed.json`` atomically and durably: a temporary file in the same directory
    (created with the umask's permissions, like the shards), fsync, rename, fsync the directory.
    ``before_rename()``, if given, runs once the temporary file is durable (a test hook)."""
    root = os.fspath(root)
    tmp = os.path.join(root, f"{TMP_MANIFEST_PREFIX}{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to every shard
    try:
        with os.fdopen(fd, "w") as f:
            f.write(manifest.dumps())
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, os.path.join(root, MANIFEST))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(root)


def fsync_dir(path: str) -> None:
    """Make renames and unlinks in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def loads(text: str | bytes, where: str) -> Manifest:
    """Parse and check a manifest's text; every problem is a `ManifestError` naming ``where``."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{where}: {len(text)} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES}); "
            f"rebuild it with `crossfeed index --force`"
        )
    if isinstance(text, (bytearray, memoryview)):
        text = bytes(text)
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")  # every JSON value but the first of each container
    if values > MAX_VALUES:
        raise ManifestError(
            f"{where}: {values} JSON values (',', '[' and '{{' characters), more than a manifest may hold "
            f"({MAX_VALUES}: room for {MAX_SHARDS} shards per split and their fields); it is not parsed (each "
            f"value costs memory once parsed): rebuild it with `crossfeed index --force`"
        )
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(f"{where}: not UTF-8 text ({e}); rebuild it with `crossfeed index --force`") from e
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: not valid JSON ({e}); rebuild it with `crossfeed index --force`") from e
    except RecursionError as e:
        raise ManifestError(f"{where}: JSON nested too deeply; rebuild it with `crossfeed index --force`") from e
    return Manifest.from_json(d, where)


class _Validator:
    """Checks a parsed manifest field by field; errors name the field's path."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field_: str, what: str) -> NoReturn:
        raise ManifestError(
            f"{self.where}: {field_}: {what}; fix the manifest or rebuild it with `crossfeed index --force`"
        )

    def dict_(self, v, field_: str) -> dict:
        if not isinstance(v, dict):
            self.fail(field_, f"expected an object, got {json_kind(v)}")
        return v

    def int_(self, v, field_: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(field_, f"expected an integer, got {json_kind(v)}")
        if not lo <= v <= hi:
            self.fail(field_, f"{v} is out of range [{lo}, {hi}]")
        return v

    def hex_(self, v, field_: str) -> str:
        if not isinstance(v, str) or not _SHA256.fullmatch(v):
            self.fail(field_, f"expected a sha256 (64 lowercase hex digits), got {short_repr(v)}")
        return v

    def json_(self, v, field_: str) -> dict:
        """A free-form object (metadata, statistics), no deeper than `MAX_DEPTH`."""
        self.dict_(v, field_)
        stack = [(v, 1)]
        while stack:
            x, depth = stack.pop()
            if depth > MAX_DEPTH:
                self.fail(field_, f"nested deeper than {MAX_DEPTH} levels")
            if isinstance(x, dict):
                stack += [(y, depth + 1) for y in x.values()]
            elif isinstance(x, list):
                stack += [(y, depth + 1) for y in x]
        return v

    def manifest(self, d) -> Manifest:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ManifestError(f"{self.where}: not a crossfeed manifest (format is not {FORMAT!r})")
        if d.get("version") != VERSION:
            raise ManifestError(
                f"{self.where}: manifest version {short_repr(d.get('version'))}; this crossfeed reads version {VERSION}"
            )
        unknown = set(d) - {
            "format",
            "version",
            "schema",
            "splits",
            "metadata",
            "generation",
            "data_root",
            "lengths",
            "dataset_version",
            "versions",
        }
        if unknown:
            self.fail(sorted(unknown)[0], "unknown field")
        schema = self.schema(d.get("schema"))
        splits_d = self.dict_(d.get("splits"), "splits")
        if not splits_d:
            self.fail("splits", "no splits")
        if len(splits_d) > MAX_SPLITS:
            self.fail("splits", f"{len(splits_d)} splits, more than {MAX_SPLITS}")
        splits: dict[str, SplitInfo] = {}
        seen: dict = {}
        for name, s in splits_d.items():
            if not name or len(name) > MAX_NAME_BYTES:
                self.fail(f"splits.{name}", "a split name must be 1 to 255 characters")
            splits[name] = self.split(name, s, seen)
        metadata = self.json_(d.get("metadata", {}), "metadata")
        generation = self.int_(d.get("generation", 0), "generation")
        lengths = self.lengths(d.get("lengths", []), schema, splits)
        dataset_version = self.int_(d.get("dataset_version", 1), "dataset_version", 1, MAX_VERSIONS)
        versions = self.versions(d.get("versions", []), dataset_version)
        return Manifest(
            schema,
            splits,
            metadata,
            generation,
            self.data_root(d.get("data_root")),
            lengths,
            dataset_version,
            versions,
        )

    def versions(self, v, current: int) -> tuple[tuple[int, str], ...]:
        """The earlier versions: ``[{"version": 1, "sha256": …}, …]``, exactly 1 … current-1 in order."""
        if not isinstance(v, list):
            self.fail("versions", f"expected a list of earlier versions, got {json_kind(v)}")
        if len(v) != current - 1:
            self.fail("versions", f"lists {len(v)} earlier versions; dataset_version {current} has {current - 1}")
        out = []
        for i, x in enumerate(v):
            at = f"versions[{i}]"
            self.dict_(x, at)
            if set(x) != {"version", "sha256"}:
                self.fail(at, f"expected the fields version, sha256, got {sorted(map(str, x))}")
            if self.int_(x["version"], f"{at}.version", 1, MAX_VERSIONS) != i + 1:
                self.fail(f"{at}.version", f"expected {i + 1} (versions are listed 1, 2, … in order)")
            out.append((i + 1, self.hex_(x["sha256"], f"{at}.sha256")))
        return tuple(out)

    def lengths(self, v, schema, splits) -> tuple[str, ...]:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            self.fail("lengths", f"expected a list of feature names, got {json_kind(v)}")
        names = set(schema.names)
        for i, x in enumerate(v):
            if x not in names:
                self.fail(f"lengths[{i}]", f"{short_repr(x)} is not a feature of the schema")
        if len(set(v)) != len(v):
            self.fail("lengths", "a feature is listed twice")
        pinned = [sh.lengths_sha256 is not None for s in splits.values() for sh in s.shards]
        if v and not all(pinned):
            self.fail("lengths", "every shard needs a lengths_sha256 when the manifest lists lengths")
        if not v and any(pinned):
            self.fail("lengths", "shards have lengths_sha256 but the manifest lists no lengths features")
        return tuple(v)

    def data_root(self, v) -> str | None:
        if v is None:
            return None
        ok = (
            isinstance(v, str)
            and 0 < len(v) <= MAX_DATA_ROOT
            and not any(ord(c) < 32 or ord(c) == 127 for c in v)
            and ("://" in v or os.path.isabs(v))
        )
        if not ok:
            self.fail("data_root", f"expected an absolute path or URL of the data directory, got {short_repr(v)}")
        local = v[len("file://") :] if v.startswith("file://") else v
        if "://" in local:
            problem = url_problem(v)
            if problem:
                self.fail("data_root", f"{short_repr(v)}: {problem}")
        elif not os.path.isabs(local) or any(s in (".", "..") for s in local.split("/")):
            self.fail("data_root", f"{short_repr(v)}: expected an absolute path without '.' or '..' segments")
        return v

    def schema(self, items) -> Schema:
        if not isinstance(items, list):
            self.fail("schema", f"expected a list of features, got {json_kind(items)}")
        if not items:
            self.fail("schema", "no features; a dataset needs at least one")
        if len(items) > MAX_FEATURES:
            self.fail("schema", f"{len(items)} features, more than {MAX_FEATURES}")
        feats, names = [], set()
        for i, f in enumerate(items):
            at = f"schema[{i}]"
            self.dict_(f, at)
            if set(f) != {"name", "dtype", "shape", "encoding"}:
                self.fail(at, f"expected the fields name, dtype, shape, encoding, got {sorted(map(str, f))}")
            name, dtype, shape, enc = f["name"], f["dtype"], f["shape"], f["encoding"]
            if not isinstance(name, str) or not name or len(name) > MAX_NAME_BYTES:
                self.fail(f"{at}.name", f"expected a name of 1 to {MAX_NAME_BYTES} characters, got {short_repr(name)}")
            if name in names:
                self.fail(f"{at}.name", f"feature {name!r} appears twice")
            names.add(name)
            if not isinstance(enc, str) or enc not in _ENCODINGS:
                self.fail(f"{at}.encoding", f"unknown encoding {short_repr(enc)}; expected one of {sorted(_ENCODINGS)}")
            if not isinstance(dtype, str) or dtype not in _DTYPES[enc]:
                self.fail(
                    f"{at}.dtype",
                    f"dtype {short_repr(dtype)} is not one the {enc} encoding stores ({', '.join(sorted(_DTYPES[enc]))})",
                )
            if not isinstance(shape, list) or len(shape) > MAX_RANK:
                self.fail(f"{at}.shape", f"expected a list of at most {MAX_RANK} dimensions, got {short_repr(shape)}")
            for j, dim in enumerate(shape):
                if dim is not None:
                    self.int_(dim, f"{at}.shape[{j}]", 0, MAX_DIM)
            try:
                feats.append(Feature(name, dtype, tuple(shape), Encoding(enc)))
            except (SchemaError, TypeError, ValueError) as e:
                self.fail(at, str(e))
        for n in names:
            if n + SHAPE_SUFFIX in names:
                self.fail("schema", f"feature {n + SHAPE_SUFFIX!r} clashes with the shape of feature {n!r}")
        return Schema(feats)

    def split(self, name: str, s, seen: dict) -> SplitInfo:
        at = f"splits.{name}"
        self.dict_(s, at)
        unknown = set(s) - {"num_records", "num_bytes", "shards", "statistics", "format"}
        if unknown:
            self.fail(f"{at}.{sorted(unknown)[0]}", "unknown field")
        items = s.get("shards")
        if not isinstance(items, list):
            self.fail(f"{at}.shards", f"expected a list of shards, got {json_kind(items)}")
        if len(items) > MAX_SHARDS:
            self.fail(f"{at}.shards", f"{len(items)} shards, more than {MAX_SHARDS}")
        fmt = s.get("format", "tfrecord")
        if fmt not in SPLIT_FORMATS:
            self.fail(f"{at}.format", f"unknown shard format {short_repr(fmt)}; expected one of {list(SPLIT_FORMATS)}")
        shards = tuple(self.shard(f"{at}.shards[{i}]", sh, seen, fmt) for i, sh in enumerate(items))
        info = SplitInfo(name, shards, self.json_(s.get("statistics", {}), f"{at}.statistics"), fmt)
        for key in ("num_records", "num_bytes"):
            if key in s and self.int_(s[key], f"{at}.{key}") != getattr(info, key):
                self.fail(f"{at}.{key}", f"says {s[key]}, its shards add up to {getattr(info, key)}")
        return info

    def shard(self, at: str, sh, seen: dict, fmt: str) -> ShardInfo:
        # one of up to MAX_SHARDS per split: the common case is checked inline, each field's
        # own check (and its message) runs only where the quick one fails
        if type(sh) is not dict:
            self.dict_(sh, at)
        keys = sh.keys()
        if not (keys <= _SHARD_FIELDS and _SHARD_REQUIRED <= keys):
            unknown, missing = set(keys) - _SHARD_FIELDS, _SHARD_REQUIRED - set(keys)
            self.fail(
                at, f"unknown field {sorted(unknown)[0]!r}" if unknown else f"missing field {sorted(missing)[0]!r}"
            )
        name = sh["file"]
        if not (
            type(name) is str
            and _SIMPLE_NAME.fullmatch(name)
            and name != MANIFEST
            and name[-4:] not in _INDEXES
            and name[-5:] != ".json"
        ):
            name = check_name(name, f"{self.where}: {at}.file")
        if name in seen:
            self.fail(f"{at}.file", f"{name!r} is listed twice (also at {seen[name]}); each shard belongs to one place")
        seen[name] = at
        nbytes = sh["num_bytes"]
        if not (type(nbytes) is int and 0 <= nbytes <= MAX_BYTES):
            nbytes = self.int_(nbytes, f"{at}.num_bytes", 0, MAX_BYTES)
        # A record is at least 16 bytes and deflate inflates at most ~1032:1 (adopted GZIP shards
        # need not end in .gz, so this bound holds for every shard; the index pins plain ones exactly).
        # Parquet encodes runs of equal values in a few bytes: its row count has no byte bound (the
        # Loader checks it against the file's footer). Neither holds more than MAX_SHARD_RECORDS.
        most = MAX_SHARD_RECORDS if fmt == "parquet" else min(MAX_SHARD_RECORDS, (nbytes * 1100) // 16 + 64)
        n = sh["num_records"]
        if not (type(n) is int and 0 <= n <= most):
            n = self.int_(n, f"{at}.num_records", 0, most)
        index_sha = sh.get("index_sha256")
        row_groups = self.row_groups(at, sh, fmt, n) if fmt == "parquet" or "row_groups" in sh else None
        if fmt == "parquet" and index_sha is not None:
            self.fail(f"{at}.index_sha256", "a parquet shard has no index file")
        lengths_sha = sh.get("lengths_sha256")
        crc = sh.get("crc32c")
        if "crc32c" in sh and not (type(crc) is int and 0 <= crc <= 0xFFFFFFFF):
            crc = self.int_(crc, f"{at}.crc32c", 0, 0xFFFFFFFF)
        if crc is not None and fmt != "tfrecord":
            self.fail(f"{at}.crc32c", f"only a tfrecord shard carries a crc32c, this one is {fmt}")
        return ShardInfo(
            name,
            n,
            nbytes,
            self._sha(sh["sha256"], at, "sha256"),
            None if index_sha is None else self._sha(index_sha, at, "index_sha256"),
            row_groups,
            None if lengths_sha is None else self._sha(lengths_sha, at, "lengths_sha256"),
            crc,
        )

    def _sha(self, v, at: str, key: str) -> str:
        return v if type(v) is str and _SHA256.fullmatch(v) else self.hex_(v, f"{at}.{key}")

    def row_groups(self, at: str, sh: dict, fmt: str, n: int) -> tuple[int, ...] | None:
        """A Parquet shard's row counts per row group (they add up to its ``num_records``)."""
        groups = sh.get("row_groups")
        if fmt != "parquet":
            if groups is not None:
                self.fail(f"{at}.row_groups", f"only a parquet shard has row groups, this one is {fmt}")
            return None
        if not isinstance(groups, list) or len(groups) > MAX_ROW_GROUPS:
            self.fail(
                f"{at}.row_groups", f"expected a list of at most {MAX_ROW_GROUPS} row counts, got {json_kind(groups)}"
            )
        out = tuple(self.int_(g, f"{at}.row_groups[{i}]") for i, g in enumerate(groups))
        if sum(out) != n:
            self.fail(f"{at}.row_groups", f"add up to {sum(out)} rows, num_records says {n}")
        return out


def json_kind(v) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def short_repr(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHARD_FIELDS = frozenset(
    {"file", "num_records", "num_bytes", "sha256", "index_sha256", "row_groups", "lengths_sha256", "crc32c"}
)
_SHARD_REQUIRED = frozenset({"file", "num_records", "num_bytes", "sha256"})
# a file name that needs no further check (`check_name` passes it): plain characters, no leading dot
_SIMPLE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}")
_INDEXES = (".idx", ".len")
_ENCODINGS = {e.value for e in Encoding}
_DTYPES = {e.value: codec_of(e).manifest_dtypes for e in Encoding}
