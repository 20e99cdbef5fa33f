"""Typed columns shared by the CSV and Parquet sources.

A column is ``int64``, ``float`` (stored as float32, the Example float list) or ``string``. Missing
values: an empty float is NaN, an empty string is ``""``, an empty int64 is a bad row (declare the
column ``float`` to keep such rows). The chosen ``label`` column becomes the feature ``label``; its
original name is kept in the metadata (``label_column``).
"""

from __future__ import annotations

import enum

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.format.schema import Encoding, Feature, Schema


class ColumnType(str, enum.Enum):
    INT64 = "int64"
    FLOAT = "float"
    STRING = "string"


_ALIASES = {"int": "int64", "int64": "int64", "float": "float", "float32": "float", "float64": "float",
            "double": "float", "str": "string", "string": "string"}
_FEATURE = {ColumnType.INT64: ("int64", Encoding.INT64), ColumnType.FLOAT: ("float32", Encoding.FLOAT),
            ColumnType.STRING: ("string", Encoding.BYTES)}


def parse_types(text: str | dict | None) -> dict[str, ColumnType]:
    """``"age:int64,score:float"`` (or a dict) → ``{name: ColumnType}``."""
    if not text:
        return {}
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for item in (t.strip() for t in text.split(",") if t.strip()):
            name, sep, typ = item.rpartition(":")
            if not sep or not name:
                raise ConfigError(f"--types: {item!r} is not NAME:TYPE (TYPE one of int64, float, string)")
            items.append((name, typ))
    out = {}
    for name, typ in items:
        try:
            out[name] = ColumnType(_ALIASES[str(typ).strip().lower()])
        except KeyError:
            raise ConfigError(f"column {name!r}: type {typ!r} is not one of int64, float, string") from None
    return out


def infer_type(values: list[str]) -> ColumnType:
    """The narrowest type all non-empty ``values`` parse as."""
    present = [v for v in values if v.strip()]
    if not present:
        return ColumnType.STRING
    for typ, conv in ((ColumnType.INT64, int), (ColumnType.FLOAT, float)):
        try:
            for v in present:
                conv(v)
            return typ
        except ValueError:
            continue
    return ColumnType.STRING


def convert_strings(values: list[str], typ: ColumnType, name: str) -> tuple[object, dict[int, str]]:
    """Text cells → a typed column, and ``{row: why}`` for cells that do not parse."""
    if typ is ColumnType.STRING:
        return list(values), {}
    dtype = np.int64 if typ is ColumnType.INT64 else np.float64
    try:
        return np.array(values, dtype=dtype), {}
    except (ValueError, OverflowError):
        pass
    out = np.zeros(len(values), dtype=dtype)
    bad = {}
    for i, v in enumerate(values):
        if typ is ColumnType.FLOAT and not v.strip():
            out[i] = np.nan
            continue
        try:
            out[i] = int(v) if typ is ColumnType.INT64 else float(v)
        except (ValueError, OverflowError):
            bad[i] = (f"column {name!r}: empty value in an int64 column (declare it float to keep the row as NaN)"
                      if not v.strip() else f"column {name!r}: {v!r} is not {'an int64' if typ is ColumnType.INT64 else 'a float'}")
    return out, bad


def feature_name(name: str, label: str | None) -> str:
    return "label" if label is not None and name == label else name


def table_schema(columns: list[tuple[str, ColumnType]], label: str | None) -> Schema:
    names = [n for n, _ in columns]
    if label is not None:
        if label not in names:
            raise ConfigError(f"label column {label!r} is not among the columns {names}")
        if "label" in names and label != "label":
            raise ConfigError(f"--label {label!r} would be stored as 'label', but a column is already named 'label'")
    feats = []
    for name, typ in columns:
        dtype, enc = _FEATURE[typ]
        feats.append(Feature(feature_name(name, label), dtype, (), enc))
    return Schema(feats)


def table_metadata(kind: str, label: str | None) -> dict:
    meta = {"source": kind}
    if label is not None:
        meta["label_column"] = label
    return meta


def drop_rows(columns: dict[str, object], keys: list[str], bad: set[int]) -> tuple[dict[str, object], list[str]]:
    """The columns and keys without the rows in ``bad``."""
    if not bad:
        return columns, keys
    keep = np.array([i for i in range(len(keys)) if i not in bad], dtype=np.int64)
    ids = keep.tolist()
    cols = {k: (v[keep] if isinstance(v, np.ndarray) else [v[i] for i in ids]) for k, v in columns.items()}
    return cols, [keys[i] for i in ids]
