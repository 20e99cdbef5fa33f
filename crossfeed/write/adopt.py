"""Adopting TFRecord shards written by anyone (tf.io.TFRecordWriter, Beam's WriteToTFRecord, the
``tfrecord`` package; plain or GZIP): scan every record with its CRCs, write the ``.idx`` index
beside each shard, infer the schema from the Examples and write the manifest, last.

``index_dataset(path)`` is what ``crossfeed index PATH`` runs. Shard files keep their names.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import mmap
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from crossfeed.errors import ConfigError, DatasetNotFoundError, ExampleError, ManifestError, SchemaError
from crossfeed.format import example as ex
from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.format.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo, check_name, loads, write_manifest
from crossfeed.format.parquet import is_parquet_name
from crossfeed.format.schema import SHAPE_SUFFIX, Encoding, Feature, Schema, decode_value
from crossfeed.write.adopt_parquet import index_parquet
from crossfeed.write.writer import dataset_lock

log = logging.getLogger(__name__)

DEFAULT_SPLIT = "train"
# `<split>-SSSSS-of-NNNNN` with any suffix: crossfeed, Beam (`data-00000-of-00004`), TFDS.
_SHARDED = re.compile(r"^(?P<split>.+?)-(?P<i>\d{5})-of-(?P<n>\d{5})(?:\..*)?$")
_EXTS = (".tfrecord", ".tfrecords", ".tfrec")
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")


def is_shard_name(name: str) -> bool:
    """Whether a file name looks like a TFRecord shard (by extension or ``-SSSSS-of-NNNNN``)."""
    if name.startswith(".") or name == MANIFEST or name.endswith(".idx") or is_parquet_name(name):
        return False
    base = name[:-3] if name.endswith(".gz") else name
    return base.endswith(_EXTS) or _SHARDED.match(name) is not None


def split_of(name: str, default: str = DEFAULT_SPLIT) -> tuple[str, int]:
    """``(split, shard_number)`` from a file name; ``(default, 0)`` when it names no split."""
    m = _SHARDED.match(name)
    if not m:
        return default, 0
    split = m["split"]
    for ext in _EXTS:  # TFDS: `mnist-train.tfrecord-00000-of-00001` → `mnist-train`
        split = split[: -len(ext)] if split.endswith(ext) else split
    return split, int(m["i"])


@contextlib.contextmanager
def open_stream(path: str) -> Iterator:
    """The uncompressed record stream of a local shard: an mmap for plain files, bytes for GZIP
    (detected by its magic bytes, whatever the name)."""
    if tfrecord.is_gzip(path):
        yield tfrecord.read_bytes(path)
        return
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield mm
    finally:
        with contextlib.suppress(BufferError):  # a caller still holds a view; it goes with them
            mm.close()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class _Seen:
    """What the records so far say about one feature."""

    kind: int = 0  # 0 until a non-empty list is seen
    counts: set = field(default_factory=set)
    image: bool = True  # every bytes value so far starts with JPEG/PNG magic
    image_shapes: set = field(default_factory=set)

    def add(self, name: str, kind: int, region, where: str) -> None:
        vals = ex.kind_values(kind, region)
        if kind and len(vals):
            if self.kind and kind != self.kind:
                raise SchemaError(
                    f"{where}: feature {name!r} is a {ex.KIND_NAMES[kind]} here and a {ex.KIND_NAMES[self.kind]} in "
                    f"earlier records; every record must use one list type per feature"
                )
            self.kind = kind
        if len(self.counts) < 3:
            self.counts.add(len(vals))
        if kind == ex.BYTES and self.image:
            self.image = len(vals) == 1 and bytes(vals[0][:8]).startswith(_IMAGE_MAGIC)
            if self.image and len(self.image_shapes) < 3:
                self.image_shapes.add(_image_shape(vals[0]))

    def feature(self, name: str) -> Feature:
        n = next(iter(self.counts)) if len(self.counts) == 1 else None
        shape: tuple = () if n == 1 else (n,)
        if self.kind == ex.BYTES:
            if self.image and n == 1:
                dims = [
                    d if len({s[i] for s in self.image_shapes}) == 1 else None
                    for i, d in enumerate(next(iter(self.image_shapes)))
                ]
                return Feature(name, "uint8", tuple(dims), Encoding.IMAGE)
            return Feature(name, "bytes", shape, Encoding.BYTES)
        if self.kind == ex.FLOAT:
            return Feature(name, "float32", shape, Encoding.FLOAT)
        return Feature(name, "int64", shape, Encoding.INT64)  # also a feature that is always empty


def _image_shape(data) -> tuple:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            w, h = im.size
            return (h, w, len(im.getbands()))
    except Exception:  # Pillow raises many types; the shape is then unknown
        return (None, None, None)


def parse_feature(spec: str) -> Feature:
    """A declared feature ``NAME=ENCODING[:DTYPE[:SHAPE]]``, e.g. ``image=tensor:uint8:224,224,3``,
    ``label=int64``, ``jpeg=image``, ``x=float:float32:32`` (``SHAPE``: comma-separated, ``?`` for a
    dimension that varies, empty for a scalar)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(
            f"--feature {spec!r}: expected NAME=ENCODING[:DTYPE[:SHAPE]], e.g. image=tensor:uint8:224,224,3"
        )
    parts = rest.split(":")
    if len(parts) > 3:
        raise ConfigError(f"--feature {spec!r}: expected NAME=ENCODING[:DTYPE[:SHAPE]]")
    try:
        enc = Encoding(parts[0])
    except ValueError:
        raise ConfigError(
            f"--feature {spec!r}: encoding {parts[0]!r} is not one of {', '.join(e.value for e in Encoding)}"
        ) from None
    default_dtype = {Encoding.INT64: "int64", Encoding.FLOAT: "float32", Encoding.IMAGE: "uint8"}.get(enc, "bytes")
    dtype = parts[1] if len(parts) > 1 and parts[1] else default_dtype
    if len(parts) > 2:
        try:
            shape = tuple(None if d.strip() == "?" else int(d) for d in parts[2].split(",") if d.strip())
        except ValueError:
            raise ConfigError(
                f"--feature {spec!r}: SHAPE must be comma-separated integers or ?, got {parts[2]!r}"
            ) from None
    else:
        shape = (None, None, None) if enc is Encoding.IMAGE else ((None,) if enc is Encoding.TENSOR else ())
    if enc is Encoding.TENSOR and dtype == "bytes":
        raise ConfigError(f"--feature {spec!r}: a tensor needs a dtype, e.g. {name}=tensor:uint8:224,224,3")
    try:
        return Feature(name, dtype, shape, enc)
    except (SchemaError, ValueError, TypeError) as e:
        raise ConfigError(f"--feature {spec!r}: {e}") from e


class _Inference:
    def __init__(self, declared: dict[str, Feature] | None = None):
        self.names: list[str] | None = None
        self.seen: dict[str, _Seen] = {}
        self.declared = dict(declared or {})

    def add(self, payload, path: str, offset: int) -> None:
        where = f"{path}: record at byte offset {offset}"
        try:
            parsed = ex.decode(payload)
        except ExampleError as e:
            raise ExampleError(
                f"{where} is not a tf.train.Example ({e}); crossfeed adopts shards of tf.train.Example"
            ) from e
        if self.names is None:
            self.names = sorted(parsed)
            self.seen = {k: _Seen() for k in self.names}
        elif sorted(parsed) != self.names:
            raise SchemaError(
                f"{where} has features {sorted(parsed)}, the first record had {self.names}; crossfeed needs every "
                f"record to carry the same features (fill missing ones with empty lists)"
            )
        for k, (kind, region) in parsed.items():
            if k not in self.declared:
                self.seen[k].add(k, kind, region, where)
        for k, f in self.declared.items():  # a declared feature must fit every record
            if k not in parsed:
                raise SchemaError(f"{where} has no feature {k!r} (declared with --feature); it has {sorted(parsed)}")
            try:
                decode_value(f, parsed, decode_images=False)
            except (SchemaError, ExampleError, ValueError) as e:
                raise SchemaError(
                    f"{where}: feature {k!r} does not fit its declaration {f.encoding.value} "
                    f"{f.dtype}{list(f.shape)}: {e}"
                ) from e

    def schema(self, old: Manifest | None) -> Schema:
        names = set(self.names or ())
        if old is not None:  # re-indexing a crossfeed dataset: its schema knows tensor dtypes
            expected = set(old.schema.names) | {
                f.name + SHAPE_SUFFIX for f in old.schema if f.encoding is Encoding.TENSOR and not f.fixed
            }
            if expected == names:
                return old.schema
        return Schema(self.declared[k] if k in self.declared else self.seen[k].feature(k) for k in sorted(names))


def _index_shard(path: str, inference: _Inference) -> ShardInfo:
    offsets = []
    with open_stream(path) as buf:
        for offset, payload in tfrecord.records(buf, path):
            inference.add(payload, path, offset)
            offsets.append((offset, tfrecord.HEADER + len(payload) + tfrecord.FOOTER))
            del payload
    index_sha = idx.write_index(idx.index_path(path), offsets)
    return ShardInfo("", len(offsets), os.path.getsize(path), file_sha256(path), index_sha)


def index_dataset(
    path,
    *,
    split: str = DEFAULT_SPLIT,
    split_from_name: bool = True,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    features: dict | list | None = None,
) -> Manifest:
    """Adopt the TFRecord shards in directory ``path`` as a crossfeed dataset and return its manifest.

    Shards are the files named ``*.tfrecord``/``*.tfrecords``/``*.tfrec`` (optionally ``.gz``) or
    ``<split>-SSSSS-of-NNNNN[...]``. With ``split_from_name`` the split comes from the latter
    pattern; other files (all files otherwise) go to ``split``. ``progress`` is called with the
    byte size of each shard once it is done. Refuses to replace a manifest unless ``force``.

    ``features`` declares what some features' bytes are instead of inferring it: `Feature`s, specs
    ``"NAME=ENCODING[:DTYPE[:SHAPE]]"`` (`parse_feature`), or a TensorFlow feature spec dict
    (``tf.io.FixedLenFeature``/``VarLenFeature`` values, read by attribute: TensorFlow is not
    imported). Every record is checked against the declarations (a misfit names shard and offset).

    A directory of Parquet files (``*.parquet``) is adopted in place (`crossfeed.write.adopt_parquet`):
    with ``features`` (declarations, or bare column names whose feature is inferred) only those
    columns are indexed.
    """
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        raise DatasetNotFoundError(f"{root}: not a directory; pass the directory that holds the TFRecord shards")
    if not split:
        raise ConfigError("split must be a non-empty name, e.g. --split train")
    manifest_path = os.path.join(root, MANIFEST)
    old = None
    if os.path.exists(manifest_path):
        if not force:
            raise ConfigError(
                f"{manifest_path}: the dataset is already indexed; pass --force to rebuild its index and manifest"
            )
        with contextlib.suppress(ManifestError, SchemaError, OSError):
            with open(manifest_path, "rb") as f:
                old = loads(f.read(), manifest_path)
    names = sorted(n for n in os.listdir(root) if is_shard_name(n) and os.path.isfile(os.path.join(root, n)))
    parquet = sorted(n for n in os.listdir(root) if is_parquet_name(n) and os.path.isfile(os.path.join(root, n)))
    if names and parquet:
        raise ConfigError(
            f"{root}: holds both TFRecord shards and Parquet files ({names[0]}, {parquet[0]}); index them from "
            f"separate directories"
        )
    names = names or parquet
    if not names:
        raise DatasetNotFoundError(
            f"{root}: no TFRecord shards (files named *.tfrecord, *.tfrecords, *.tfrec[.gz] or "
            f"<split>-SSSSS-of-NNNNN) and no Parquet files (*.parquet); point `crossfeed index` at the directory "
            f"that holds them"
        )
    for n in names:
        check_name(n, root)  # a manifest names plain files only
    groups: dict[str, list[tuple[int, str]]] = {}
    for n in names:
        s, i = split_of(n, split) if split_from_name else (split, 0)
        groups.setdefault(s, []).append((i, n))
    if parquet:  # read in place: row groups from the footers, features from the columns
        specs = [] if isinstance(features, dict) else list(features or ())
        picked = [f for f in specs if isinstance(f, str) and "=" not in f]  # a column NAME alone: inferred
        declared = declared_features(features if isinstance(features, dict) else [f for f in specs if f not in picked])
        schema, splits = index_parquet(
            root,
            {s: [n for _, n in sorted(m)] for s, m in sorted(groups.items())},
            declared=declared,
            picked=picked,
            sha256=file_sha256,
            progress=progress,
        )
        return _commit(root, Manifest(schema, splits, _metadata(old), old.generation + 1 if old else 0))
    inference = _Inference(declared_features(features))
    splits = {}
    for s, members in sorted(groups.items()):
        shards = []
        for _, n in sorted(members):
            info = _index_shard(os.path.join(root, n), inference)
            shards.append(ShardInfo(n, info.num_records, info.num_bytes, info.sha256, info.index_sha256))
            if progress is not None:
                progress(info.num_bytes)
        declared = {int(m["n"]) for _, n in members if (m := _SHARDED.match(n))} if split_from_name else set()
        if declared and declared != {len(members)}:
            log.warning(
                "split %r: the file names say %s shards, %d are present in %s", s, sorted(declared), len(members), root
            )
        splits[s] = SplitInfo(s, tuple(shards))
    if inference.names is None:
        raise ConfigError(
            f"{root}: the shards hold no records, so there is no schema to infer; write some records first"
        )
    manifest = Manifest(inference.schema(old), splits, _metadata(old), old.generation + 1 if old else 0)
    return _commit(root, manifest)


def _metadata(old: Manifest | None) -> dict:
    metadata = dict(old.metadata) if old else {}
    metadata.setdefault("source", "crossfeed index")
    return metadata


def _commit(root: str, manifest: Manifest) -> Manifest:
    with dataset_lock(root):
        write_manifest(root, manifest)
    return manifest


def declared_features(features) -> dict[str, Feature]:
    """``{name: Feature}`` from `index_dataset`'s ``features`` argument (see there)."""
    if not features:
        return {}
    if isinstance(features, dict):
        return {
            name: _from_tf_spec(name, spec)
            if not isinstance(spec, (Feature, str))
            else (parse_feature(f"{name}={spec}") if isinstance(spec, str) else spec)
            for name, spec in features.items()
        }
    out = {}
    for f in features:
        f = parse_feature(f) if isinstance(f, str) else f
        if not isinstance(f, Feature):
            raise ConfigError(f"features: expected a Feature or 'NAME=ENCODING[:DTYPE[:SHAPE]]', got {f!r}")
        out[f.name] = f
    return out


def _from_tf_spec(name: str, spec) -> Feature:
    """A ``tf.io.FixedLenFeature``/``VarLenFeature`` (duck-typed: ``dtype``, ``shape``) as a Feature."""
    dtype = getattr(getattr(spec, "dtype", None), "name", None)
    if dtype is None:
        raise ConfigError(f"features[{name!r}]: expected a tf.io.FixedLenFeature/VarLenFeature or a spec string")
    shape = getattr(spec, "shape", None)
    fixed = shape is not None and type(spec).__name__ == "FixedLenFeature"
    dims = tuple(int(d) for d in shape) if fixed else (None,)
    if dtype == "string":
        return Feature(name, "bytes", dims if fixed else (None,), Encoding.BYTES)
    if dtype == "int64":
        return Feature(name, "int64", dims, Encoding.INT64)
    if dtype == "float32":
        return Feature(name, "float32", dims, Encoding.FLOAT)
    raise ConfigError(f"features[{name!r}]: a tf.train.Example holds bytes, int64 or float32, not {dtype}")
