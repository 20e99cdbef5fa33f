"""TFDS prepared datasets, read from their JSON alone (no tensorflow, no tensorflow_datasets).

A TFDS data directory (``~/tensorflow_datasets/NAME/CONFIG/VERSION``) holds
``dataset_info.json`` (splits, shard lengths, the shard file template), ``features.json``
(the feature tree), ``<feature>.labels.txt`` (class names) and TFRecord shards of
``tf.train.Example`` named like ``NAME-SPLIT.tfrecord-00000-of-00004``. `read_layout` turns that
into what `crossfeed.write.adopt.index.index_dataset` needs: the shards of each split, in order, and
the crossfeed `Feature` of every Example key, so every record is checked against TFDS's own
declaration while indexing.

How TFDS serializes each feature (``example_serializer.py``) and what crossfeed makes of it:

==========================  ===========================  ====================================
TFDS feature                Example field                crossfeed feature
==========================  ===========================  ====================================
Image(shape, uint8/16)      bytes_list: 1 PNG/JPEG       image, dtype and shape as declared
ClassLabel                  int64_list: 1 value          int64 scalar; names in metadata
Tensor/Scalar, ints, bool   int64_list (cast)            int64 of the shape (TFDS dtype kept
Tensor/Scalar, floats       float_list (cast)            float32 of the shape  in metadata)
Tensor/Scalar, string       bytes_list                   bytes of the shape
Tensor(encoding="bytes")    bytes_list: 1 raw value      tensor, dtype and (fixed) shape
Text                        bytes_list: 1 UTF-8 value    string (``str``)
Sequence(f, length)         f's list, flattened          f with a leading dimension ``length``
FeaturesDict                keys ``parent/child``        one feature per leaf
==========================  ===========================  ====================================

Layouts crossfeed cannot read as TFDS means them are refused with the feature's name: zlib
tensors, tensors with several unknown dimensions, a variable-length dimension that is not the
only one of a list (crossfeed returns such lists flat), sequences of images or of bytes tensors,
nested sequences (TFDS's ragged layout), uint64 (bit-cast), float32 images, unknown classes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from crossfeed.errors import ConfigError, DatasetNotFoundError, SchemaError
from crossfeed.format.manifest import SplitInfo
from crossfeed.format.schema import NUMERIC_DTYPES, Encoding, Feature

DATASET_INFO = "dataset_info.json"
FEATURES = "features.json"
DEFAULT_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
_TENSOR_DTYPES = NUMERIC_DTYPES - {"uint64"}  # what TFDS Tensor features store


@dataclass(frozen=True)
class TfdsLayout:
    """What a TFDS data directory holds: ``splits`` maps each split to its shard file names in
    shard order, ``lengths`` to TFDS's record count of each shard; ``features`` are the
    crossfeed features of the Example keys; ``metadata`` goes into the manifest."""

    name: str
    splits: dict[str, tuple[str, ...]]
    lengths: dict[str, tuple[int, ...]]
    features: tuple[Feature, ...]
    metadata: dict


def is_tfds(names) -> bool:
    """Whether a directory listing is a TFDS data directory."""
    names = set(names)
    return DATASET_INFO in names and FEATURES in names


def read_layout(place) -> TfdsLayout:
    """The layout of the TFDS data directory of a `Placement` (its JSON read, shards not opened)."""
    info = _json(place, DATASET_INFO)
    tree = _json(place, FEATURES)
    where = place.data_url(DATASET_INFO)
    fmt = info.get("fileFormat", "tfrecord")
    if fmt != "tfrecord":
        raise ConfigError(
            f"{where}: the dataset is stored as {fmt!r}; crossfeed adopts TFDS datasets stored as TFRecord "
            f"(prepare it with download_and_prepare(file_format='tfrecord'))"
        )
    name = info.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: no dataset name; is this a TFDS dataset_info.json?")
    splits, lengths = {}, {}
    for s in info.get("splits") or ():
        split = s.get("name")
        counts = tuple(int(n) for n in s.get("shardLengths") or ())
        if not split or not counts:
            continue  # an empty split has no shards
        template = s.get("filepathTemplate") or DEFAULT_TEMPLATE
        files = tuple(_shard_file(template, name, split, fmt, i, len(counts), where) for i in range(len(counts)))
        for f in files:
            if not place.exists(f):
                raise DatasetNotFoundError(
                    f"{place.data_url(f)}: shard {f} of split {split!r} named by {DATASET_INFO} is missing"
                )
        splits[split], lengths[split] = files, counts
    if not splits:
        raise ConfigError(f"{where}: no split with shards; prepare the dataset first")
    mapper = _Mapper(place)
    features = tuple(mapper.features(tree))
    tfds_meta = {"name": name, "version": info.get("version")}
    if info.get("configName"):
        tfds_meta["config"] = info["configName"]
    if mapper.class_names:
        tfds_meta["class_names"] = mapper.class_names
    if mapper.dtypes:
        tfds_meta["dtypes"] = mapper.dtypes  # TFDS's dtype where crossfeed returns the stored one
    return TfdsLayout(name, splits, lengths, features, {"source": "tfds", "tfds": tfds_meta})


def check_lengths(layout: TfdsLayout, splits: dict[str, SplitInfo], place) -> None:
    """Every shard holds the records ``dataset_info.json`` says it does."""
    for split, counts in layout.lengths.items():
        for shard, n in zip(splits[split].shards, counts):
            if shard.num_records != n:
                raise SchemaError(
                    f"{place.data_url(shard.file)}: holds {shard.num_records} records, {DATASET_INFO} says {n}; "
                    f"the dataset was changed after TFDS prepared it (prepare it again)"
                )


def _json(place, name: str) -> dict:
    try:
        d = json.loads(place.read(name).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{place.data_url(name)}: not valid JSON ({e}); the TFDS dataset is damaged") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{place.data_url(name)}: expected a JSON object")
    return d


def _shard_file(template: str, name: str, split: str, fmt: str, i: int, n: int, where: str) -> str:
    out = (
        template.replace("{DATASET}", name)
        .replace("{SPLIT}", split)
        .replace("{FILEFORMAT}", fmt)
        .replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{n:05d}")
        .replace("{SHARD_INDEX}", f"{i:05d}")
        .replace("{NUM_SHARDS}", f"{n:05d}")
    )
    if "{" in out or "/" in out:
        raise ConfigError(f"{where}: shard file template {template!r} is not one crossfeed knows")
    return out


def _dims(spec: dict) -> tuple:
    return tuple(None if int(d) < 0 else int(d) for d in (spec.get("shape") or {}).get("dimensions") or ())


class _Mapper:
    """Walks ``features.json``; collects class names and TFDS dtypes on the way."""

    def __init__(self, place):
        self.place = place
        self.class_names: dict[str, list[str]] = {}
        self.dtypes: dict[str, str] = {}

    def features(self, tree: dict) -> list[Feature]:
        return self.node("", tree, (), None)

    def node(self, name: str, spec: dict, seq: tuple, file_name: str | None) -> list[Feature]:
        kind = str(spec.get("pythonClassName", "")).rsplit(".", 1)[-1]
        shown = name or "(top level)"
        if kind == "FeaturesDict":
            out = []
            for child, sub in sorted(((spec.get("featuresDict") or {}).get("features") or {}).items()):
                child_file = child.replace("/", ".") if not file_name else "-".join([*file_name.split("/"), child])
                out += self.node(f"{name}/{child}" if name else child, sub, seq, child_file)
            if not out:
                raise SchemaError(f"{FEATURES}: feature {shown!r} has no features")
            return out
        if kind == "Sequence":
            if seq:
                raise SchemaError(self.refuse(name, kind, "a sequence of sequences is stored ragged"))
            sub = spec.get("sequence") or {}
            length = int(sub.get("length", -1))
            return self.node(name, sub.get("feature") or {}, (None if length < 0 else length,), file_name)
        if kind in ("Tensor", "Scalar"):
            t = spec.get("tensor") or {}
            return [self.tensor(name, kind, str(t.get("dtype")), seq + _dims(t), str(t.get("encoding", "none")), seq)]
        if kind == "ClassLabel":
            self.labels(name, file_name)
            return [self.listed(name, kind, "int64", seq)]
        if kind == "Text":
            return [self.listed(name, kind, "string", seq)]
        if kind == "Image":
            img = spec.get("image") or {}
            dtype = str(img.get("dtype", "uint8"))
            if seq:
                raise SchemaError(self.refuse(name, kind, "a sequence of images is several values per record"))
            if dtype not in ("uint8", "uint16"):
                raise SchemaError(self.refuse(name, kind, f"{dtype} images are bit-cast into PNG channels"))
            return [Feature(name, dtype, _dims(img) or (None, None, None), Encoding.IMAGE)]
        raise SchemaError(
            self.refuse(
                name,
                kind or "unknown",
                "crossfeed maps Image, ClassLabel, Tensor, Scalar, Text, Sequence and FeaturesDict",
            )
        )

    def refuse(self, name: str, kind: str, why: str) -> str:
        return (
            f"TFDS feature {name!r} ({kind}) has a layout crossfeed cannot read: {why}; declare what its bytes are "
            f"with --feature {name}=ENCODING[:DTYPE[:SHAPE]], or prepare the dataset without it"
        )

    def listed(self, name: str, kind: str, dtype: str, dims: tuple) -> Feature:
        """A feature stored as one plain list (int64, float or bytes) of ``dims``."""
        if None in dims and len(dims) > 1:
            raise SchemaError(self.refuse(name, kind, f"shape {list(dims)} has a variable dimension among others"))
        shape = tuple(dims)
        if dtype == "string":
            return Feature(name, "string", shape, Encoding.BYTES)
        if dtype in ("bytes", "object", "str"):
            return Feature(name, "bytes", shape, Encoding.BYTES)
        np_dtype = np.dtype(dtype)
        if np_dtype.kind in "biu":
            if dtype == "uint64":
                raise SchemaError(self.refuse(name, kind, "uint64 is stored bit-cast into int64"))
            if dtype != "int64":
                self.dtypes[name] = dtype
            return Feature(name, "int64", shape, Encoding.INT64)
        if np_dtype.kind == "f":
            if dtype != "float32":
                self.dtypes[name] = dtype
            return Feature(name, "float32", shape, Encoding.FLOAT)
        raise SchemaError(self.refuse(name, kind, f"dtype {dtype} has no tf.train.Example list"))

    def tensor(self, name: str, kind: str, dtype: str, dims: tuple, encoding: str, seq: tuple) -> Feature:
        if encoding == "none" and dtype in ("string", "object", "str", "bytes"):
            return self.listed(name, kind, "bytes", dims)  # TFDS hands string tensors out as bytes
        if encoding == "none":
            try:
                return self.listed(name, kind, dtype, dims)
            except TypeError as e:
                raise SchemaError(self.refuse(name, kind, f"unknown dtype {dtype!r}")) from e
        if encoding != "bytes":
            raise SchemaError(self.refuse(name, kind, f"encoding {encoding!r} (crossfeed reads 'none' and 'bytes')"))
        if seq:
            raise SchemaError(self.refuse(name, kind, "a sequence of bytes-encoded tensors is several values"))
        if None in dims:
            raise SchemaError(self.refuse(name, kind, f"a bytes-encoded tensor of shape {list(dims)} varies"))
        if dtype not in _TENSOR_DTYPES:
            raise SchemaError(self.refuse(name, kind, f"dtype {dtype} is not a numeric dtype crossfeed stores"))
        return Feature(name, dtype, dims, Encoding.TENSOR)

    def labels(self, name: str, file_name: str | None) -> None:
        label_file = f"{file_name or name}.labels.txt"
        if not self.place.exists(label_file):
            return  # names kept in the builder's code only; the labels are still ints
        text = self.place.read(label_file).decode("utf-8")
        self.class_names[name] = [line for line in text.splitlines() if line]
