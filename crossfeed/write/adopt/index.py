"""Adopting TFRecord shards written by anyone (tf.io.TFRecordWriter, Beam's WriteToTFRecord, the
``tfrecord`` package; plain or GZIP): scan every record with its CRCs, write the ``.idx`` index
beside each shard, infer the schema from the Examples and write the manifest, last.

``index_dataset(path)`` is what ``crossfeed index PATH`` runs. Shard files keep their names and are
never written to; a TFDS data directory is mapped by `crossfeed.write.adopt.tfds`, and ``index_dir``
puts the manifest and indexes elsewhere (`crossfeed.write.adopt.placement`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from crossfeed.errors import ConfigError, DatasetNotFoundError, ExampleError, ManifestError, SchemaError
from crossfeed.format import codecs, hf, tfrecord
from crossfeed.format import example as ex
from crossfeed.format import index as idx
from crossfeed.format.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo, check_name, loads, write_manifest
from crossfeed.format.parquet import is_parquet_name
from crossfeed.format.schema import NUMERIC_DTYPES, Encoding, Feature, Schema, decode_value
from crossfeed.format.tar import is_tar_name
from crossfeed.write.adopt import tfds
from crossfeed.write.adopt.lengths import RecordLengths, check_features, lengths_features, write_file
from crossfeed.write.adopt.parquet import index_parquet
from crossfeed.write.adopt.placement import Placement, placement
from crossfeed.write.commit import dataset_lock
from crossfeed.write.target import scheme_of, write_target

log = logging.getLogger(__name__)

DEFAULT_SPLIT = "train"
# `<split>-SSSSS-of-NNNNN` with any suffix: crossfeed, Beam (`data-00000-of-00004`), TFDS.
_SHARDED = re.compile(r"^(?P<split>.+?)-(?P<i>\d{5})-of-(?P<n>\d{5})(?:\..*)?$")
_EXTS = (".tfrecord", ".tfrecords", ".tfrec")
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")


def is_shard_name(name: str) -> bool:
    """Whether a file name looks like a TFRecord shard (by extension or ``-SSSSS-of-NNNNN``)."""
    if name.startswith(".") or name == MANIFEST or name.endswith((".idx", ".len", ".arrow")) or is_parquet_name(name):
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
                return Feature(name, "uint8", tuple(dims), codecs.IMAGE)
            return Feature(name, "bytes", shape, codecs.BYTES)
        if self.kind == ex.FLOAT:
            return Feature(name, "float32", shape, codecs.FLOAT)
        return Feature(name, "int64", shape, codecs.INT64)  # also a feature that is always empty


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
    dimension that varies, empty for a scalar). Natural spellings are accepted too: a dtype for the
    encoding (``x=float64``, ``x=double:3``: a tensor of it; ``x=float32``: float), ``x=string``/
    ``x=str`` (bytes:string), and ``x=float:float64`` (a float64 tensor: the float encoding holds
    float32 alone)."""
    return _parse_feature(spec)[0]


def shape_given(spec: str) -> bool:
    """Whether a `parse_feature` spec names a shape (without one, Parquet takes the column's)."""
    return _parse_feature(spec)[1]


_DTYPE_ALIASES = {"double": "float64", "float": "float32", "half": "float16", "int": "int64", "long": "int64"}


def _parse_feature(spec: str) -> tuple[Feature, bool]:
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(
            f"--feature {spec!r}: expected NAME=ENCODING[:DTYPE[:SHAPE]], e.g. image=tensor:uint8:224,224,3"
        )
    parts = rest.split(":")
    head = parts[0].strip().lower()
    if head in ("string", "str"):
        parts = ["bytes", "string", *parts[1:]]
    elif head not in {e.value for e in Encoding}:  # a dtype for the encoding: x=float64[:SHAPE]
        dtype = _DTYPE_ALIASES.get(head, head)
        if dtype in NUMERIC_DTYPES:
            parts = ["float" if dtype == "float32" else "tensor", dtype, *parts[1:]]
    if len(parts) > 3:
        raise ConfigError(f"--feature {spec!r}: expected NAME=ENCODING[:DTYPE[:SHAPE]]")
    try:
        enc = Encoding(parts[0])
    except ValueError:
        raise ConfigError(
            f"--feature {spec!r}: encoding {parts[0]!r} is not one of {', '.join(e.value for e in Encoding)} "
            f"(or a numeric dtype, e.g. {name}=float64)"
        ) from None
    codec = codecs.codec_of(enc)
    dtype = parts[1].strip() if len(parts) > 1 and parts[1].strip() else codec.default_dtype or "bytes"
    dtype = _DTYPE_ALIASES.get(dtype, dtype) if not codec.text else dtype
    if codec is codecs.FLOAT and dtype in NUMERIC_DTYPES and dtype != "float32":
        codec = codecs.TENSOR  # float:float64 means float64 numbers
    given = len(parts) > 2
    if given:
        try:
            shape = tuple(None if d.strip() == "?" else int(d) for d in parts[2].split(",") if d.strip())
        except ValueError:
            raise ConfigError(
                f"--feature {spec!r}: SHAPE must be comma-separated integers or ?, got {parts[2]!r}"
            ) from None
    else:
        shape = codec.default_shape
    if codec.default_dtype is None and dtype == "bytes":
        raise ConfigError(
            f"--feature {spec!r}: a {codec.encoding.value} needs a dtype, e.g. {name}=tensor:uint8:224,224,3"
        )
    try:
        return Feature(name, dtype, shape, codec), given
    except (SchemaError, ValueError, TypeError) as e:
        raise ConfigError(f"--feature {spec!r}: {e}") from e


class _Inference:
    def __init__(self, declared: dict[str, Feature] | None = None):
        self.names: list[str] | None = None
        self.seen: dict[str, _Seen] = {}
        self.declared = dict(declared or {})

    def add(self, payload, path: str, offset: int) -> dict:
        """Check one record against what the others said; its decoded features."""
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
        return parsed

    def schema(self, old: Manifest | None) -> Schema:
        names = set(self.names or ())
        if old is not None:  # re-indexing a crossfeed dataset: its schema knows tensor dtypes
            expected = set(old.schema.names) | {s for f in old.schema for s in f.codec.slots(f)[1:]}
            if expected == names:
                return old.schema
        names -= {s for f in self.declared.values() for s in f.codec.slots(f)[1:]}  # tensors' /shape entries
        return Schema(self.declared[k] if k in self.declared else self.seen[k].feature(k) for k in sorted(names))


def _index_shard(place: Placement, name: str, inference: _Inference, lengths: RecordLengths | None) -> ShardInfo:
    """Check every record of data file ``name``, write its index into ``place.root``; note what
    each record says of the ``lengths`` features' lengths."""
    offsets = []
    where = place.data_url(name)
    with place.open_records(name) as (records, size, sha):
        for offset, payload in records:
            parsed = inference.add(payload, where, offset)
            if lengths is not None:
                lengths.add(parsed)
            offsets.append((offset, tfrecord.HEADER + len(payload) + tfrecord.FOOTER))
            del payload, parsed
    index_sha = idx.write_index(place.index_path(name), offsets)
    return ShardInfo(name, len(offsets), size, sha, index_sha)


def index_dataset(
    path,
    *,
    split: str = DEFAULT_SPLIT,
    split_from_name: bool = True,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    features: dict | list | None = None,
    index_dir=None,
    storage_options: dict | None = None,
    lengths=None,
) -> Manifest:
    """Adopt the TFRecord shards in directory ``path`` as a crossfeed dataset and return its manifest.
    A directory of ``.tar`` shards (and no TFRecords) is adopted as WebDataset tars read in place
    (`crossfeed.write.adopt.tar`).

    Shards are the files named ``*.tfrecord``/``*.tfrecords``/``*.tfrec`` (optionally ``.gz``) or
    ``<split>-SSSSS-of-NNNNN[...]``. With ``split_from_name`` the split comes from the latter
    pattern; other files (all files otherwise) go to ``split``. ``progress`` is called with the
    byte size of each shard once it is done. Refuses to replace a manifest unless ``force``.

    A TFDS data directory (``dataset_info.json`` + ``features.json``) is adopted as TFDS laid it
    out: its splits, its shards and its features (`crossfeed.write.adopt.tfds`).

    ``features`` declares what some features' bytes are instead of inferring it: `Feature`s, specs
    ``"NAME=ENCODING[:DTYPE[:SHAPE]]"`` (`parse_feature`), or a TensorFlow feature spec dict
    (``tf.io.FixedLenFeature``/``VarLenFeature`` values, read by attribute: TensorFlow is not
    imported). Every record is checked against the declarations (a misfit names shard and offset).

    ``index_dir``: write the manifest and index files there instead of beside the data, which
    is then only read (a read-only directory, or an fsspec URL reached with fsspec's
    ``storage_options``); see `placement`. ``index_dir`` may itself be a URL (written with the
    same ``storage_options``, manifest last: `crossfeed.write.target`).

    A directory of Parquet files (``*.parquet``) is adopted in place (`crossfeed.write.adopt.parquet`):
    with ``features`` (declarations, or bare column names whose feature is inferred) only those
    columns are indexed.

    ``lengths`` (a feature name, or several): write each shard's per-record lengths of these
    one-dimensional integer features beside its index (``NAME.len``, `crossfeed.write.adopt.lengths`),
    pinned by the manifest, for sequence packing. TFRecord and Parquet; not tars.
    """
    if index_dir is not None and scheme_of(os.fspath(index_dir)) is not None:
        # a URL: indexed into a local staging directory, published there manifest last
        with write_target(index_dir, storage_options=storage_options, overwrite=force) as target:
            return index_dataset(
                path,
                split=split,
                split_from_name=split_from_name,
                force=force,
                progress=progress,
                features=features,
                index_dir=target.root,
                storage_options=storage_options,
                lengths=lengths,
            )
    names_with_lengths = lengths_features(lengths)
    if not split:
        raise ConfigError("split must be a non-empty name, e.g. --split train")
    place = placement(path, index_dir, storage_options)
    root = place.data
    manifest_path = place.manifest_path
    old = None
    if os.path.exists(manifest_path):
        if not force:
            raise ConfigError(
                f"{manifest_path}: the dataset is already indexed; pass --force to rebuild its index and manifest"
            )
        with contextlib.suppress(ManifestError, SchemaError, OSError):
            with open(manifest_path, "rb") as f:
                old = loads(f.read(), manifest_path)
    listing = place.listdir()
    found = hf.kind(listing)
    arrow = [n for n in listing if hf.is_arrow_name(n)]
    if found == "dataset_dict":  # a folder per split: each is a dataset folder of its own
        raise ConfigError(hf.advice(root, found))
    if arrow:  # Arrow IPC files (HF datasets'), read in place as Parquet is: record batches are row groups
        if any(is_shard_name(n) or is_tar_name(n) or is_parquet_name(n) for n in listing):
            raise ConfigError(f"{root}: holds Arrow IPC files and other shards; index them from separate directories")
        named = hf.arrow_splits(arrow, place, split) if split_from_name else {n: split for n in arrow}
        return _index_parquet(
            place, arrow, split, split_from_name, features, old, progress, names_with_lengths, splits=named
        )
    layout = tfds.read_layout(place) if tfds.is_tfds(listing) else None
    if layout is not None:
        declared = declared_features(features)
        groups = {s: list(enumerate(files)) for s, files in layout.splits.items()}
        declared = {f.name: f for f in layout.features} | declared
    else:
        names = [n for n in listing if is_shard_name(n) and not is_tar_name(n)]
        tars = [n for n in listing if is_tar_name(n)]
        parquet = [n for n in listing if is_parquet_name(n)]
        if names and parquet:
            raise ConfigError(
                f"{root}: holds both TFRecord shards and Parquet files ({names[0]}, {parquet[0]}); index them from "
                f"separate directories"
            )
        if parquet:  # read in place: row groups from the footers, features from the columns
            return _index_parquet(place, parquet, split, split_from_name, features, old, progress, names_with_lengths)
        if tars and not names and names_with_lengths:
            raise ConfigError(
                f"{root}: --lengths is not supported for WebDataset tars yet; convert them, or index without it"
            )
        if tars and not names:  # WebDataset tar shards, read in place (`crossfeed.write.adopt.tar`)
            from crossfeed.write.adopt.tar import index_tars

            groups = {}
            for n in tars:
                s, i = split_of(n, split) if split_from_name else (split, 0)
                groups.setdefault(s, []).append((i, n))
            return index_tars(place, groups, old=old, declared=declared_features(features), progress=progress)
        if not names:
            raise DatasetNotFoundError(
                f"{root}: no TFRecord shards (files named *.tfrecord, *.tfrecords, *.tfrec[.gz] or "
                f"<split>-SSSSS-of-NNNNN) and no .tar or Parquet files; point `crossfeed index` at the directory that holds them"
            )
        groups = {}
        for n in names:
            s, i = split_of(n, split) if split_from_name else (split, 0)
            groups.setdefault(s, []).append((i, n))
        declared = declared_features(features)
    for members in groups.values():
        for _, n in members:
            check_name(n, root)  # a manifest names plain files only
    inference = _Inference(declared)
    splits = {}
    seen_lengths: dict[str, RecordLengths] = {}  # each shard's, when names_with_lengths
    for s, members in sorted(groups.items()):
        shards = []
        for _, n in sorted(members):
            shard_lengths = RecordLengths(names_with_lengths) if names_with_lengths else None
            if shard_lengths is not None:
                seen_lengths[n] = shard_lengths
            info = _index_shard(place, n, inference, shard_lengths)
            shards.append(info)
            if progress is not None:
                progress(info.num_bytes)
        declared_n = {int(m["n"]) for _, n in members if (m := _SHARDED.match(n))} if split_from_name else set()
        if layout is None and declared_n and declared_n != {len(members)}:
            log.warning(
                "split %r: the file names say %s shards, %d are present in %s",
                s,
                sorted(declared_n),
                len(members),
                root,
            )
        splits[s] = SplitInfo(s, tuple(shards))
    if inference.names is None:
        raise ConfigError(
            f"{root}: the shards hold no records, so there is no schema to infer; write some records first"
        )
    if layout is not None:
        tfds.check_lengths(layout, splits, place)
    metadata = _metadata(old)
    metadata.update(layout.metadata if layout is not None else {})
    schema = inference.schema(old if layout is None else None)
    if names_with_lengths:
        check_features(schema, names_with_lengths, root)
        splits = {
            s: dataclasses.replace(
                info,
                shards=tuple(
                    dataclasses.replace(
                        sh,
                        lengths_sha256=write_file(
                            place.root, sh.file, seen_lengths[sh.file].lengths(schema, place.data_url(sh.file))
                        ),
                    )
                    for sh in info.shards
                ),
            )
            for s, info in splits.items()
        }
    manifest = Manifest(schema, splits, metadata, old.generation + 1 if old else 0, place.data_root, names_with_lengths)
    return _commit(place.root, manifest)


def _index_parquet(
    place: Placement,
    parquet,
    split,
    split_from_name,
    features,
    old,
    progress,
    lengths: tuple[str, ...] = (),
    splits: dict[str, str] | None = None,
) -> Manifest:
    """Parquet files adopted in place (`crossfeed.write.adopt.parquet`): with ``features``
    (declarations, or bare column names whose feature is inferred) only those columns are indexed.
    No index file is written: the manifest alone, beside the files or in the index directory.
    ``splits``: each file's split, where the caller knows it (Arrow IPC files: `hf.arrow_splits`)."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for n in parquet:
        check_name(n, place.data)  # a manifest names plain files only
        s, i = split_of(n, split) if split_from_name else (split, 0)
        if splits is not None:
            s = splits[n]
        groups.setdefault(s, []).append((i, n))
    specs = [] if isinstance(features, dict) else list(features or ())
    picked = [f for f in specs if isinstance(f, str) and "=" not in f]  # a column NAME alone: inferred
    declared = declared_features(features if isinstance(features, dict) else [f for f in specs if f not in picked])
    texts = [f"{k}={v}" for k, v in features.items() if isinstance(v, str)] if isinstance(features, dict) else specs
    unshaped = frozenset(t.partition("=")[0] for t in texts if isinstance(t, str) and "=" in t and not shape_given(t))
    schema, infos, meta = index_parquet(
        place,
        {s: [n for _, n in sorted(m)] for s, m in sorted(groups.items())},
        declared=declared,
        picked=picked,
        unshaped=unshaped,
        progress=progress,
        lengths=lengths,
    )
    metadata = _metadata(old)
    metadata.pop("parquet", None)  # this run's decisions replace an earlier index's
    metadata.update(meta)
    manifest = Manifest(schema, infos, metadata, old.generation + 1 if old else 0, place.data_root, lengths)
    return _commit(place.root, manifest)


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
    dims = tuple(int(d) for d in shape) if fixed and shape is not None else (None,)
    if dtype == "string":
        return Feature(name, "bytes", dims if fixed else (None,), codecs.BYTES)
    if dtype == "int64":
        return Feature(name, "int64", dims, codecs.INT64)
    if dtype == "float32":
        return Feature(name, "float32", dims, codecs.FLOAT)
    raise ConfigError(f"features[{name!r}]: a tf.train.Example holds bytes, int64 or float32, not {dtype}")
