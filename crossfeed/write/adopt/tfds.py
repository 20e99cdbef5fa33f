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

The JSON is a trust boundary, read strictly (`_Fields`): every field is type-checked where it is
read (a protobuf int64 is a JSON integer or a string of ASCII digits), counts, dimensions, nesting
and file sizes are bounded, file names built from it are plain names inside the directory; a
damaged file is a `ConfigError` naming the file and the field, never a Python error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError, DatasetNotFoundError, SchemaError
from crossfeed.format import codecs
from crossfeed.format.manifest import (
    MAX_DEPTH,
    MAX_DIM,
    MAX_FEATURES,
    MAX_INT,
    MAX_NAME_BYTES,
    MAX_RANK,
    MAX_SHARDS,
    MAX_SPLITS,
    SplitInfo,
    json_kind,
    plain_segment,
    short_repr,
)
from crossfeed.format.schema import NUMERIC_DTYPES, Feature

DATASET_INFO = "dataset_info.json"
FEATURES = "features.json"
DEFAULT_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
_TENSOR_DTYPES = NUMERIC_DTYPES - {"uint64"}  # what TFDS Tensor features store
_BYTES_DTYPES = ("string", "object", "str", "bytes")  # TFDS's names for byte strings
MAX_JSON_BYTES = 64 << 20  # dataset_info.json, features.json: kilobytes in practice
MAX_LABELS_BYTES = 64 << 20  # a labels file: one class name a line
_INT = re.compile(r"-?[0-9]{1,19}")  # a protobuf int64 as JSON text


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
    j = _Fields(where)
    fmt = j.str_(info, "fileFormat", "fileFormat") or "tfrecord"
    if fmt != "tfrecord":
        raise ConfigError(
            f"{where}: the dataset is stored as {fmt!r}; crossfeed adopts TFDS datasets stored as TFRecord "
            f"(prepare it with download_and_prepare(file_format='tfrecord'))"
        )
    name = j.str_(info, "name", "name")
    if not name:
        raise ConfigError(f"{where}: no dataset name; is this a TFDS dataset_info.json?")
    splits, lengths = {}, {}
    items = j.list_(info, "splits", "splits", MAX_SPLITS)
    for k, s in enumerate(items):
        at = f"splits[{k}]"
        j.dict_(s, at)
        split = j.str_(s, "name", f"{at}.name")
        if len(split.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            j.fail(f"{at}.name", f"a split name of more than {MAX_NAME_BYTES} bytes")
        if split in splits:
            j.fail(f"{at}.name", f"split {split!r} is listed twice")
        counts = tuple(
            j.int_(n, f"{at}.shardLengths[{i}]", 0, MAX_INT)
            for i, n in enumerate(j.list_(s, "shardLengths", f"{at}.shardLengths", MAX_SHARDS))
        )
        if not split or not counts:
            continue  # an empty split has no shards
        template = j.str_(s, "filepathTemplate", f"{at}.filepathTemplate") or DEFAULT_TEMPLATE
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
    tfds_meta: dict[str, Any] = {"name": name, "version": j.str_(info, "version", "version") or None}
    config = j.str_(info, "configName", "configName")
    if config:
        tfds_meta["config"] = config
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
    where = place.data_url(name)
    try:
        d = json.loads(place.read(name, MAX_JSON_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: not valid JSON ({e}); the TFDS dataset is damaged (prepare it again)") from e
    except RecursionError as e:
        raise ConfigError(f"{where}: JSON nested too deeply; the TFDS dataset is damaged (prepare it again)") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {json_kind(d)}; is this a TFDS {name}?")
    return d


class _Fields:
    """Typed reads of the fields of one TFDS JSON file (``where``): a field that is absent or null
    reads as its default (as protobuf's JSON parser reads it); any other value of the wrong type or
    out of bounds is a `ConfigError` naming the file and the field's path."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, what: str):
        raise ConfigError(
            f"{self.where}: {field}: {what}; the TFDS dataset is damaged (prepare it again with tensorflow-datasets)"
        )

    def dict_(self, v, field: str) -> dict:
        if not isinstance(v, dict):
            self.fail(field, f"expected an object, got {json_kind(v)}")
        return v

    def get(self, d: dict, key: str, field: str, kind: type, what: str):
        v = d.get(key)
        if v is not None and type(v) is not kind:  # parsed JSON: exactly dict, list, str, int, float, bool
            self.fail(field, f"expected {what}, got {json_kind(v)} {short_repr(v)}")
        return v

    def obj(self, d: dict, key: str, field: str) -> dict:
        return self.get(d, key, field, dict, "an object") or {}

    def list_(self, d: dict, key: str, field: str, most: int) -> list:
        v = self.get(d, key, field, list, "a list") or []
        if len(v) > most:
            self.fail(field, f"{len(v)} entries, more than {most}")
        return v

    def str_(self, d: dict, key: str, field: str) -> str:
        return self.get(d, key, field, str, "a string") or ""

    def int_(self, v, field: str, lo: int, hi: int) -> int:
        """A protobuf integer: a JSON integer or a string of ASCII digits, in ``[lo, hi]``."""
        if isinstance(v, str) and _INT.fullmatch(v):
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(field, f"expected an integer (or a string of digits), got {json_kind(v)} {short_repr(v)}")
        if not lo <= v <= hi:
            self.fail(field, f"{v} is out of range [{lo}, {hi}]")
        return v


def _shard_file(template: str, name: str, split: str, fmt: str, i: int, n: int, where: str) -> str:
    out = (
        template.replace("{DATASET}", name)
        .replace("{SPLIT}", split)
        .replace("{FILEFORMAT}", fmt)
        .replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{n:05d}")
        .replace("{SHARD_INDEX}", f"{i:05d}")
        .replace("{NUM_SHARDS}", f"{n:05d}")
    )
    if "{" in out:
        raise ConfigError(f"{where}: shard file template {short_repr(template)} is not one crossfeed knows")
    if out.startswith(".") or len(out.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES or not plain_segment(out):
        raise ConfigError(
            f"{where}: shard file {short_repr(out)} (from the name, split and template) is not a plain file name "
            f"inside the dataset directory; the TFDS dataset is damaged (prepare it again)"
        )
    return out


class _Mapper:
    """Walks ``features.json``; collects class names and TFDS dtypes on the way."""

    def __init__(self, place):
        self.place = place
        self.j = _Fields(place.data_url(FEATURES))
        self.class_names: dict[str, list[str]] = {}
        self.dtypes: dict[str, str] = {}

    def features(self, tree: dict) -> list[Feature]:
        out = self.node("", tree, (), None, "(top level)", 0)
        if len(out) > MAX_FEATURES:
            self.j.fail("(top level)", f"{len(out)} features, more than {MAX_FEATURES}")
        seen = set()
        for f in out:  # `a/b` nested and a top-level `a/b` flatten to one Example key
            if f.name in seen:
                self.j.fail(f.name, f"feature {f.name!r} is declared twice")
            seen.add(f.name)
        return out

    def node(self, name: str, spec, seq: tuple, file_name: str | None, at: str, depth: int) -> list[Feature]:
        """The features of the feature ``name`` declared by ``spec`` (at JSON path ``at``)."""
        j = self.j
        j.dict_(spec, at)
        if depth > MAX_DEPTH:
            j.fail(at, f"features nested deeper than {MAX_DEPTH} levels")
        kind = j.str_(spec, "pythonClassName", f"{at}.pythonClassName").rsplit(".", 1)[-1]
        shown = name or "(top level)"
        if kind == "FeaturesDict":
            out = []
            children = j.obj(
                j.obj(spec, "featuresDict", f"{at}.featuresDict"), "features", f"{at}.featuresDict.features"
            )
            for child, sub in sorted(children.items()):
                full = f"{name}/{child}" if name else child
                if not child or len(full.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
                    j.fail(f"{at}.featuresDict.features", f"feature name {short_repr(full)} is empty or too long")
                child_file = child.replace("/", ".") if not file_name else "-".join([*file_name.split("/"), child])
                out += self.node(full, sub, seq, child_file, f"{at}.featuresDict.features.{child}", depth + 1)
            if not out:
                raise SchemaError(f"{FEATURES}: feature {shown!r} has no features")
            return out
        if kind == "Sequence":
            if seq:
                raise SchemaError(self.refuse(name, kind, "a sequence of sequences is stored ragged"))
            sub = j.obj(spec, "sequence", f"{at}.sequence")
            length = sub.get("length")
            length = -1 if length is None else j.int_(length, f"{at}.sequence.length", -1, MAX_DIM)
            feature = j.obj(sub, "feature", f"{at}.sequence.feature")
            return self.node(
                name, feature, (None if length < 0 else length,), file_name, f"{at}.sequence.feature", depth + 1
            )
        if kind in ("Tensor", "Scalar"):
            t = j.obj(spec, "tensor", f"{at}.tensor")
            dtype = j.str_(t, "dtype", f"{at}.tensor.dtype")
            encoding = j.str_(t, "encoding", f"{at}.tensor.encoding") or "none"
            return [self.tensor(name, kind, dtype, seq + self.dims(t, f"{at}.tensor"), encoding, seq)]
        if kind == "ClassLabel":
            self.labels(name, file_name)
            return [self.listed(name, kind, "int64", seq)]
        if kind == "Text":
            return [self.listed(name, kind, "string", seq)]
        if kind == "Image":
            img = j.obj(spec, "image", f"{at}.image")
            dtype = j.str_(img, "dtype", f"{at}.image.dtype") or "uint8"
            dims = self.dims(img, f"{at}.image")
            if seq:
                raise SchemaError(self.refuse(name, kind, "a sequence of images is several values per record"))
            if dtype not in ("uint8", "uint16"):
                raise SchemaError(self.refuse(name, kind, f"{short_repr(dtype)} images are not PNG/JPEG pixels"))
            if dims and len(dims) != 3:
                raise SchemaError(
                    self.refuse(name, kind, f"an image of shape {list(dims)} is not (height, width, channels)")
                )
            return [Feature(name, dtype, dims or (None, None, None), codecs.IMAGE)]
        raise SchemaError(
            self.refuse(
                name,
                kind or "unknown",
                "crossfeed maps Image, ClassLabel, Tensor, Scalar, Text, Sequence and FeaturesDict",
            )
        )

    def dims(self, spec: dict, at: str) -> tuple:
        """``spec.shape.dimensions``: each a size, or -1 (None) for one that varies."""
        shape = self.j.obj(spec, "shape", f"{at}.shape")
        dims = self.j.list_(shape, "dimensions", f"{at}.shape.dimensions", MAX_RANK)
        out = (self.j.int_(d, f"{at}.shape.dimensions[{i}]", -1, MAX_DIM) for i, d in enumerate(dims))
        return tuple(None if d < 0 else d for d in out)

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
            return Feature(name, "string", shape, codecs.BYTES)
        if dtype in ("bytes", "object", "str"):
            return Feature(name, "bytes", shape, codecs.BYTES)
        if dtype not in NUMERIC_DTYPES:  # only known names reach numpy
            raise SchemaError(self.refuse(name, kind, f"unknown dtype {short_repr(dtype)}"))
        np_dtype = np.dtype(dtype)
        if np_dtype.kind in "biu":
            if dtype == "uint64":
                raise SchemaError(self.refuse(name, kind, "uint64 is stored bit-cast into int64"))
            if dtype != "int64":
                self.dtypes[name] = dtype
            return Feature(name, "int64", shape, codecs.INT64)
        if np_dtype.kind == "f":
            if dtype != "float32":
                self.dtypes[name] = dtype
            return Feature(name, "float32", shape, codecs.FLOAT)
        raise SchemaError(self.refuse(name, kind, f"dtype {dtype} has no tf.train.Example list"))

    def tensor(self, name: str, kind: str, dtype: str, dims: tuple, encoding: str, seq: tuple) -> Feature:
        if encoding == "none" and dtype in _BYTES_DTYPES:
            return self.listed(name, kind, "bytes", dims)  # TFDS hands string tensors out as bytes
        if encoding == "none":
            return self.listed(name, kind, dtype, dims)
        if encoding != "bytes":
            raise SchemaError(
                self.refuse(name, kind, f"encoding {short_repr(encoding)} (crossfeed reads 'none' and 'bytes')")
            )
        if seq:
            raise SchemaError(self.refuse(name, kind, "a sequence of bytes-encoded tensors is several values"))
        if None in dims:
            raise SchemaError(self.refuse(name, kind, f"a bytes-encoded tensor of shape {list(dims)} varies"))
        if dtype not in _TENSOR_DTYPES:
            raise SchemaError(
                self.refuse(name, kind, f"dtype {short_repr(dtype)} is not a numeric dtype crossfeed stores")
            )
        return Feature(name, dtype, dims, codecs.TENSOR)

    def labels(self, name: str, file_name: str | None) -> None:
        label_file = f"{file_name or name}.labels.txt"
        if not plain_segment(label_file) or label_file.startswith("."):
            return  # no file TFDS writes: a name that is no plain file name inside the directory is not read
        if not self.place.exists(label_file):
            return  # names kept in the builder's code only; the labels are still ints
        where = self.place.data_url(label_file)
        try:
            text = self.place.read(label_file, MAX_LABELS_BYTES).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{where}: class names of feature {name!r} are not UTF-8 text ({e}); the TFDS dataset is damaged "
                f"(prepare it again, or delete the file to adopt the labels as plain integers)"
            ) from e
        self.class_names[name] = [line for line in text.splitlines() if line]
