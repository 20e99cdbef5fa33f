"""Typed columns shared by the CSV and Parquet sources.

A column is ``int64``, ``float`` (float64: what the text or the file holds, never narrowed
unless asked), ``float32`` (narrowed on request, and said so in the summary and the manifest's
``narrowed``) or ``string``. Missing
values: an empty float is NaN, an empty string is ``""``, an empty int64 is a bad row (declare the
column ``float`` to keep such rows). The chosen ``label`` column becomes the feature ``label``; its
original name is kept in the metadata (``label_column``). A string label becomes a class index,
its vocabulary (sorted) stored as ``class_names`` in the metadata, as for image folders, unless
``label_classes=False``.

Inference (`infer_column`) says what it decided and why, naming the cells that decided it
(``file:line``): a column of numbers with a few cells that are not (``1n/a``) stays a string column
but is reported with those cells, and the way to declare it numeric; an integer column with empty
cells becomes ``float`` (NaN), reported with the lines.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from crossfeed.errors import ConfigError
from crossfeed.format import codecs
from crossfeed.format.schema import Feature, Schema


class ColumnType(str, enum.Enum):
    INT64 = "int64"
    FLOAT = "float"  # float64
    FLOAT32 = "float32"  # narrowed on request
    STRING = "string"


_ALIASES = {
    "int": "int64",
    "int64": "int64",
    "float": "float",
    "float64": "float",
    "double": "float",
    "float32": "float32",
    "single": "float32",
    "str": "string",
    "string": "string",
}
_FEATURE = {
    ColumnType.INT64: ("int64", codecs.INT64),
    ColumnType.FLOAT: ("float64", codecs.number_codec("float64")),  # a tensor scalar, as `crossfeed index` maps it
    ColumnType.FLOAT32: ("float32", codecs.FLOAT),
    ColumnType.STRING: ("string", codecs.BYTES),
}
_TYPES = "int64, float (float64), float32, string"


def parse_types(text: str | dict | list | tuple | None) -> dict[str, ColumnType]:
    """``"age:int64,score:float"`` (or a dict, or a list of such strings: ``--types`` given more
    than once) → ``{name: ColumnType}``; a column given two types is refused."""
    if not text:
        return {}
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in [text] if isinstance(text, str) else list(text):
            for item in (t.strip() for t in str(part).split(",") if t.strip()):
                name, sep, typ = item.rpartition(":")
                if not sep or not name:
                    raise ConfigError(f"--types: {item!r} is not NAME:TYPE (TYPE one of {_TYPES})")
                items.append((name, typ))
    out: dict[str, ColumnType] = {}
    for name, typ in items:
        try:
            got = ColumnType(_ALIASES[str(typ).strip().lower()])
        except KeyError:
            raise ConfigError(f"column {name!r}: type {typ!r} is not one of {_TYPES}") from None
        if name in out and out[name] is not got:
            raise ConfigError(f"--types: column {name!r} is given two types ({out[name].value}, {got.value}); give one")
        out[name] = got
    return out


_SHOW = 3  # cells named in a report


@dataclass(frozen=True)
class Inference:
    """What `infer_column` decided for one column, and why (a line for the user)."""

    name: str
    type: ColumnType
    why: str
    warn: bool = False  # a decision the user should look at (a numeric column made string, NaNs)


def _cells(where: list[str]) -> str:
    return ", ".join(where[:_SHOW]) + (f" and {len(where) - _SHOW} more" if len(where) > _SHOW else "")


def infer_column(name: str, cells: list[tuple[str, str]]) -> Inference:
    """The type of column ``name`` from its sampled ``(where, text)`` cells (``where`` is
    ``file:line``), with the reason and the cells that decided it."""
    present = [(w, v) for w, v in cells if v.strip()]
    empty = [w for w, v in cells if not v.strip()]
    if not present:
        return Inference(name, ColumnType.STRING, f"{name}: string (all {len(cells)} sampled cells are empty)")

    def fails(conv) -> list[tuple[str, str]]:
        out = []
        for w, v in present:
            try:
                conv(v)
            except ValueError:
                out.append((w, v))
        return out

    not_int, not_float = fails(int), fails(float)
    if not not_int and not empty:
        return Inference(name, ColumnType.INT64, f"{name}: int64 (all {len(cells)} sampled cells are integers)")
    if not not_float:
        if not not_int:  # integers with holes: NaN needs a float
            return Inference(
                name,
                ColumnType.FLOAT,
                f"{name}: float, not int64, because {len(empty)} cells are empty "
                f"and become NaN ({_cells(empty)}); pass --types {name}:int64 to make them bad rows",
                warn=True,
            )
        why = f"{name}: float (all {len(present)} non-empty sampled cells are numbers)"
        if empty:
            return Inference(
                name, ColumnType.FLOAT, f"{why}; {len(empty)} empty cells become NaN ({_cells(empty)})", warn=True
            )
        return Inference(name, ColumnType.FLOAT, why)
    if len(not_float) < len(present) / 2:  # mostly numbers: say which cells made it text
        shown = ", ".join(f"{v!r} at {w}" for w, v in not_float[:_SHOW])
        more = f" and {len(not_float) - _SHOW} more" if len(not_float) > _SHOW else ""
        return Inference(
            name,
            ColumnType.STRING,
            f"{name}: string, because {len(not_float)} of {len(present)} sampled cells are not numbers: "
            f"{shown}{more}; pass --types {name}:float to read it as numbers (those rows are then bad "
            f"rows: an error, or dropped and counted with --on-error skip)",
            warn=True,
        )
    return Inference(name, ColumnType.STRING, f"{name}: string (e.g. {present[0][1]!r} at {present[0][0]})")


def vocabulary(values, name: str) -> tuple[str, ...]:
    """The sorted vocabulary of a string label column (empty cells excluded)."""
    classes = sorted({v for v in values if v != ""})
    if not classes:
        raise ConfigError(f"label column {name!r} has no non-empty value")
    return tuple(classes)


def encode_labels(values: list[str], classes: tuple[str, ...], name: str) -> tuple[np.ndarray, dict[int, str]]:
    """String labels → class indices, and ``{row: why}`` for empty or unknown ones."""
    index = {c: i for i, c in enumerate(classes)}
    out = np.zeros(len(values), dtype=np.int64)
    bad = {}
    for i, v in enumerate(values):
        k = index.get(v)
        if k is None:
            bad[i] = (
                f"label column {name!r}: empty label"
                if v == ""
                else f"label column {name!r}: {v!r} is not one of the classes found when the job started"
            )
        else:
            out[i] = k
    return out, bad


def convert_strings(values: list[str], typ: ColumnType, name: str) -> tuple[np.ndarray | list, dict[int, str]]:
    """Text cells → a typed column, and ``{row: why}`` for cells that do not parse."""
    if typ is ColumnType.STRING:
        return list(values), {}
    dtype = np.int64 if typ is ColumnType.INT64 else np.float64  # float32: narrowed by the encoder
    try:
        return np.array(values, dtype=dtype), {}
    except (ValueError, OverflowError):
        pass
    out = np.zeros(len(values), dtype=dtype)
    bad = {}
    for i, v in enumerate(values):
        if typ is not ColumnType.INT64 and not v.strip():
            out[i] = np.nan
            continue
        try:
            out[i] = int(v) if typ is ColumnType.INT64 else float(v)
        except (ValueError, OverflowError):
            bad[i] = (
                f"column {name!r}: empty value in an int64 column (declare it float to keep the row as NaN)"
                if not v.strip()
                else f"column {name!r}: {v!r} is not {'an int64' if typ is ColumnType.INT64 else 'a float'}"
            )
    return out, bad


def feature_name(name: str, label: str | None) -> str:
    return "label" if label is not None and name == label else name


def table_schema(
    columns: list[tuple[str, ColumnType]], label: str | None, classes: tuple[str, ...] | None = None
) -> Schema:
    names = [n for n, _ in columns]
    if label is not None:
        if label not in names:
            raise ConfigError(f"label column {label!r} is not among the columns {names}")
        if "label" in names and label != "label":
            raise ConfigError(f"--label {label!r} would be stored as 'label', but a column is already named 'label'")
    feats = []
    for name, typ in columns:
        dtype, enc = _FEATURE[ColumnType.INT64 if classes is not None and name == label else typ]
        feats.append(Feature(feature_name(name, label), dtype, (), enc))
    return Schema(feats)


def narrowed_lines(columns, stored: dict[str, str] | None = None) -> dict[str, str]:
    """``{column: what was narrowed}`` for the columns declared ``float32`` (``stored``: the
    file's dtype of each column, where known; CSV text is float64 until narrowed)."""
    out = {}
    for name, typ in columns:
        was = (stored or {}).get(name, "float64")
        if typ is ColumnType.FLOAT32 and was not in ("float32", "float16"):
            out[name] = f"{name}: {was} narrowed to float32, as --types {name}:float32 asks"
    return out


def table_metadata(
    kind: str,
    label: str | None,
    classes: tuple[str, ...] | None = None,
    inferred: tuple[Inference, ...] = (),
    narrowed: dict[str, str] | None = None,
) -> dict:
    meta: dict = {"source": kind}
    if narrowed:
        meta["narrowed"] = dict(narrowed)
    if label is not None:
        meta["label_column"] = label
    if classes is not None:
        meta["class_names"] = list(classes)
    if inferred:
        meta["inferred_types"] = {i.name: i.why for i in inferred}
    return meta


def drop_rows(columns: dict[str, Any], keys: list[str], bad: set[int]) -> tuple[dict[str, Any], list[str]]:
    """The columns and keys without the rows in ``bad``."""
    if not bad:
        return columns, keys
    keep = np.array([i for i in range(len(keys)) if i not in bad], dtype=np.int64)
    ids = keep.tolist()
    cols = {k: (v[keep] if isinstance(v, np.ndarray) else [v[i] for i in ids]) for k, v in columns.items()}
    return cols, [keys[i] for i in ids]
