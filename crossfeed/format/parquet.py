"""Parquet columns as crossfeed features: which Arrow types map to which `Feature`, and one row
group's column → numpy values of that feature. Shared by adoption (`crossfeed index`), the
Loader's Parquet reader and ``crossfeed verify``.

pyarrow is imported lazily (`pyarrow_modules`): ``import crossfeed`` stays light.

=============================================  =============================================
Arrow column type                              feature (read back as)
=============================================  =============================================
int64                                          int64 scalar (``int64`` encoding)
float32                                        float32 scalar (``float`` encoding)
other int*/uint*, float16/64, bool             ``tensor`` scalar of that dtype (never narrowed)
dictionary (pandas Categorical)                int64 codes, the categories ``class_names`` in
                                               the manifest (a null: -1, as pandas' codes);
                                               declared ``bytes:string`` (or the values'
                                               type): the values
timestamp[unit, tz]                            int64 since the epoch (UTC), the unit and time
                                               zone in the manifest
fixed_size_list (nested) of numbers            ``tensor`` of the leaf dtype, shape the sizes
list of numbers, every row the same length     ``tensor`` of that shape (else ``(None, ...)``:
                                               one array per row)
binary / fixed_size_binary                     ``bytes`` (``image`` or ``tensor`` by declaration)
string                                         ``bytes`` with dtype ``string`` (``str`` values)
struct<bytes: binary, path: string>            ``image`` (what HF ``datasets.Image`` writes)
=============================================  =============================================

Other types (decimals, maps, other structs) are not features: indexing names every such column
at once and says how to pick the columns to read. Nulls: a float null is NaN; a column of other
values with nulls reads them as 0/""/False and gets a mask feature ``<name>/valid`` (bool, False
where the file holds a null). Adoption reports each of these decisions, one line per column.

How a feature is read from a column that is not plainly its value (codes, epoch integers, a
filled column, a mask) is a small JSON dict, kept in the manifest's metadata under
``parquet.columns`` (`column_maps`): ``{"column": source column, "as": "codes"|"epoch"|"valid",
"class_names": [...], "unit": "us", "timezone": "UTC", "fill": true}``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from crossfeed.errors import CorruptRecordError, SchemaError, require
from crossfeed.format import codecs
from crossfeed.format.schema import Feature

PARQUET_EXTS = (".parquet", ".pq", ".parq")
FORMAT = "parquet"  # the shard ``format`` of a Parquet file in the manifest
MAGIC = b"PAR1"
MAX_ROWS = 1 << 62  # rows a row group may claim (what a manifest accepts)
_MAX_THRIFT_DEPTH = 32


def is_parquet_name(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(PARQUET_EXTS)


def pyarrow_modules():
    """``(pyarrow, pyarrow.parquet)``, imported on first use; a clear error when missing."""
    return require("pyarrow", "reading Parquet"), require("pyarrow.parquet", "reading Parquet")


def _is_list(pa, t) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_number(pa, t) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_binary(pa, t) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _is_string(pa, t) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_hf_image(pa, t) -> bool:
    return pa.types.is_struct(t) and "bytes" in {t.field(i).name for i in range(t.num_fields)}


def _is_plain(pa, t) -> bool:
    return _is_number(pa, t) or _is_string(pa, t) or _is_binary(pa, t)


def is_float(f: Feature) -> bool:
    """Whether ``f`` holds floating-point numbers (a null read into it is NaN)."""
    return f.codec.value_kind == "numeric" and np.dtype(f.dtype).kind == "f"


def is_categorical(t) -> bool:
    """A dictionary of strings or integers (pandas Categorical): read as codes, its categories
    the ``class_names``."""
    pa, _ = pyarrow_modules()
    return pa.types.is_dictionary(t) and (_is_string(pa, t.value_type) or pa.types.is_integer(t.value_type))


def column_maps(metadata) -> dict[str, dict]:
    """``{feature: how it is read}`` from a manifest's metadata (see the module doc)."""
    maps = (metadata or {}).get("parquet", {})
    maps = maps.get("columns", {}) if isinstance(maps, dict) else {}
    return maps if isinstance(maps, dict) else {}


def source_columns(features, maps: dict) -> list[str]:
    """The Parquet columns that ``features`` are read from, each once."""
    return list(dict.fromkeys(_source(f.name, maps) for f in features))


def _source(name: str, maps: dict) -> str:
    how = maps.get(name)
    return how.get("column", name) if isinstance(how, dict) else name


def feature_columns(table, features, maps: dict, where: str) -> dict[str, np.ndarray]:
    """``{feature: column_values}`` of a table read with `source_columns`."""
    return {
        f.name: column_values(f, table.column(_source(f.name, maps)).combine_chunks(), where, maps.get(f.name))
        for f in features
    }


def _mapped(f: Feature, arr, where: str, how: dict):
    """A column as the values its map says (codes, epoch integers, a mask, filled nulls): numpy
    when done, else the Arrow array to read as usual."""
    pa, _ = pyarrow_modules()
    import pyarrow.compute as pc

    kind = how.get("as")
    if kind == "valid":
        return arr.is_valid().to_numpy(zero_copy_only=False)
    if kind == "codes":
        if not pa.types.is_dictionary(arr.type):
            raise SchemaError(
                f"{where}: column {f.name!r} is {arr.type}, not the categories indexed; re-index (--force)"
            )
        names = pa.array(how.get("class_names") or [], type=arr.type.value_type)
        lookup = pc.index_in(arr.dictionary, value_set=names).fill_null(-1).to_numpy(zero_copy_only=False)
        if (lookup < 0).any():
            missing = arr.dictionary.filter(pc.equal(pc.index_in(arr.dictionary, value_set=names).is_null(), True))
            raise SchemaError(
                f"{where}: column {f.name!r} holds categories {missing.to_pylist()[:3]} that the manifest's "
                f"class_names lack: the file changed after `crossfeed index`; re-index with --force"
            )
        codes = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = lookup.astype(np.int64)[codes] if len(lookup) else np.zeros(len(arr), np.int64)
        return np.where(arr.is_null().to_numpy(zero_copy_only=False), -1, out) if arr.null_count else out
    if pa.types.is_dictionary(arr.type):  # a categorical declared as its values
        arr = arr.dictionary_decode()
    if kind == "epoch":
        arr = arr.cast(pa.int64())
    if how.get("fill") and arr.null_count:
        t = arr.type
        value = "" if _is_string(pa, t) else b"" if _is_binary(pa, t) else False if pa.types.is_boolean(t) else 0
        arr = arr.fill_null(pa.scalar(value, t))
    return arr


def _leaf(pa, t):
    """``(leaf type, list depth)`` of a (nested) list type."""
    depth = 0
    while _is_list(pa, t):
        t, depth = t.value_type, depth + 1
    return t, depth


def _numpy_dtype(t) -> str:
    return "bool" if str(t) == "bool" else np.dtype(t.to_pandas_dtype()).name


def scalar_feature(name: str, dtype: str) -> Feature:
    """A number column's feature: its own dtype (int64 and float32 keep their Example encodings)."""
    return Feature(name, dtype, (), codecs.number_codec(dtype))


def infer_feature(name: str, t, where: str) -> Feature | None:
    """The feature a column of Arrow type ``t`` is read as, with the list dimensions that the type
    fixes (a plain list's length is None until `list_lengths` proves it constant); None if the
    type is not supported."""
    pa, _ = pyarrow_modules()
    if is_categorical(t):  # codes into the categories
        return Feature(name, "int64", (), codecs.INT64)
    if pa.types.is_dictionary(t):  # other dictionaries are read as their values
        return infer_feature(name, t.value_type, where) if _is_plain(pa, t.value_type) else None
    if pa.types.is_timestamp(t):
        return Feature(name, "int64", (), codecs.INT64)
    if _is_number(pa, t):
        return scalar_feature(name, _numpy_dtype(t))
    if _is_binary(pa, t):
        return Feature(name, "bytes", (), codecs.BYTES)
    if _is_string(pa, t):
        return Feature(name, "string", (), codecs.BYTES)
    if _is_hf_image(pa, t):
        return Feature(name, "uint8", (None, None, None), codecs.IMAGE)
    if _is_list(pa, t):
        leaf, _ = _leaf(pa, t)
        if not _is_number(pa, leaf):
            return None
        dims = []
        while _is_list(pa, t):
            dims.append(t.list_size if pa.types.is_fixed_size_list(t) else None)
            t = t.value_type
        return Feature(name, _numpy_dtype(leaf), tuple(dims), codecs.TENSOR)
    return None


def list_dims(arr) -> list[int | None]:
    """The length at each list level of a column chunk (a ``pyarrow.Array``): the one length every
    row has there, None where rows differ, -1 where the chunk has no rows to tell."""
    pa, _ = pyarrow_modules()
    dims: list[int | None] = []
    while _is_list(pa, arr.type):
        if pa.types.is_fixed_size_list(arr.type):
            dims.append(arr.type.list_size)
        else:
            lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
            dims.append(-1 if not len(lengths) else int(lengths[0]) if (lengths == lengths[0]).all() else None)
        arr = arr.flatten()
    return dims


def merge_dims(a: list[int | None], b: list[int | None]) -> list[int | None]:
    """`list_dims` of two chunks of one column combined."""
    return [y if x == -1 else x if y == -1 else x if x == y else None for x, y in zip(a, b)]


def _check_nulls(arr, where: str, name: str) -> None:
    if arr.null_count:
        raise SchemaError(
            f"{where}: column {name!r} holds {arr.null_count} null(s) and its feature has no mask: re-index "
            f'(`crossfeed index --force` reads them as 0/"" with a mask feature {name + "/valid"!r}), declare it '
            f"a float (--feature {name}=float64: nulls become NaN), fill them (pandas fillna) or leave the column "
            f"out (--feature picks the columns)"
        )


def column_values(f: Feature, arr, where: str, how: dict | None = None) -> np.ndarray:
    """One row group's column (a ``pyarrow.Array``) as the batch form of feature ``f``: ``(n,
    *shape)`` numbers for a fixed shape, else a 1-D object array (``bytes``/``str``/arrays/encoded
    images, one per row). ``how``: the column's map (see the module doc). Values that do not fit
    ``f`` raise `SchemaError` naming ``where``."""
    pa, _ = pyarrow_modules()
    if how:
        arr = _mapped(f, arr, where, how)
        if isinstance(arr, np.ndarray):
            return arr
    if pa.types.is_dictionary(arr.type):  # a categorical declared as its values
        arr = arr.dictionary_decode()
    name, t, n = f.name, arr.type, len(arr)
    if not (pa.types.is_floating(t) or (is_float(f) and _is_number(pa, t))):  # a null read as a float is NaN
        _check_nulls(arr, where, name)
    arrow = f.codec.arrow
    if arrow == "binary":
        if _is_hf_image(pa, t):
            arr = arr.field("bytes")
            _check_nulls(arr, where, name + ".bytes")  # HF images stored by path only have no bytes
            t = arr.type
        if f.dtype == "string" and _is_binary(pa, t):
            arr = arr.cast(pa.string())
        elif f.dtype != "string" and _is_string(pa, t):
            arr = arr.cast(pa.binary())
        elif not (_is_binary(pa, t) or _is_string(pa, t)):
            raise SchemaError(f"{where}: column {name!r} is {t}, feature {name!r} expects binary or string values")
        return arr.to_numpy(zero_copy_only=False)
    if arrow == "number" or (arrow == "tensor" and f.shape == ()):
        if _is_number(pa, t) and f.shape == ():
            return arr.to_numpy(zero_copy_only=False).astype(f.codec.dtype(f), copy=False)
        if arrow == "number" and not _is_list(pa, t):
            raise SchemaError(f"{where}: column {name!r} is {t}, feature {name!r} expects numbers")
    if arrow == "tensor" and _is_binary(pa, t):
        return _raw_tensors(f, arr, where)
    if not _is_list(pa, t) or not _is_number(pa, _leaf(pa, t)[0]):
        raise SchemaError(f"{where}: column {name!r} is {t}, feature {name!r} expects a (nested) list of numbers")
    return _lists(f, arr, where, n)


def _dtype(f: Feature) -> np.dtype:
    return f.codec.dtype(f)


def _lists(f: Feature, arr, where: str, n: int) -> np.ndarray:
    """A (nested) list column as ``(n, *shape)`` numbers, or one array per row when the first
    dimension may vary (``None``; every other dimension must be fixed). Rows whose lists hold as
    many numbers as ``f.shape`` are reshaped to it (a flat list of 3072 → ``(32, 32, 3)``)."""
    pa, _ = pyarrow_modules()
    ragged = bool(f.shape) and f.shape[0] is None
    if None in f.shape[1:]:
        raise SchemaError(f"{where}: feature {f.name!r} shape {list(f.shape)}: only the first dimension may vary")
    dims: list[int] = []  # the fixed list lengths (under the first one, when it varies)
    outer = None
    level = 0
    while _is_list(pa, arr.type):
        lengths: np.ndarray | None = None
        if pa.types.is_fixed_size_list(arr.type):
            size = arr.type.list_size
        else:
            lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
            size = int(lengths[0]) if len(lengths) else 0
        if level == 0 and ragged:
            outer = lengths if lengths is not None else np.full(n, size, dtype=np.int64)
        elif lengths is not None and len(lengths) and (lengths != size).any():
            raise SchemaError(
                f"{where}: column {f.name!r}: lists at depth {level + 1} have lengths "
                f"{np.unique(lengths)[:3].tolist()}...; feature {f.name!r} expects shape {list(f.shape)} "
                f"(only the first dimension may vary)"
            )
        else:
            dims.append(size)
        arr = arr.flatten()
        _check_nulls(arr, where, f.name)
        level += 1
    values = arr.to_numpy(zero_copy_only=False).astype(f.dtype, copy=False)
    shape = tuple(d for d in (f.shape[1:] if ragged else f.shape) if d is not None)  # no None left (checked above)
    if len(values) and math.prod(dims) != math.prod(shape):
        raise SchemaError(
            f"{where}: column {f.name!r}: each row holds lists of {dims} numbers, feature {f.name!r} expects shape "
            f"{list(f.shape)}"
        )
    if outer is None:
        return values.reshape((n, *shape))
    values = values.reshape((int(outer.sum()), *shape))
    out = np.empty(n, dtype=object)
    for i, part in enumerate(np.split(values, np.cumsum(outer)[:-1]) if n else ()):
        out[i] = part
    return out


def _raw_tensors(f: Feature, arr, where: str) -> np.ndarray:
    """A binary column of raw little-endian tensors (``tobytes()``) as ``(n, *shape)``."""
    if not f.fixed:
        raise SchemaError(
            f"{where}: column {f.name!r} holds raw bytes; declare its full shape, e.g. tensor:uint8:28,28"
        )
    dt = np.dtype(f.dtype).newbyteorder("<")
    size = math.prod(f.fixed_shape) * dt.itemsize
    pa, _ = pyarrow_modules()
    import pyarrow.compute as pc

    if pa.types.is_fixed_size_binary(arr.type):
        lengths = np.full(len(arr), arr.type.byte_width)
    else:
        lengths = pc.binary_length(arr).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(lengths != size)[:1].tolist()
    if bad:
        raise SchemaError(
            f"{where}: column {f.name!r} row {bad[0]}: {int(lengths[bad[0]])} bytes do not fit "
            f"{f.dtype}{list(f.shape)} ({size} bytes)"
        )
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):  # one view of the data buffer
        off_t = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
        _, offs, data = arr.buffers()
        first = int(np.frombuffer(offs, dtype=off_t, count=1, offset=arr.offset * np.dtype(off_t).itemsize)[0])
        flat = np.frombuffer(data, dtype=np.uint8, count=size * len(arr), offset=first)
    else:
        flat = np.frombuffer(b"".join(arr.to_numpy(zero_copy_only=False)), dtype=np.uint8)
    return flat.view(dt).reshape((len(arr), *f.shape)).astype(f.dtype, copy=False)


# ---- the footer, read by crossfeed itself ------------------------------------------------------------
# pyarrow trusts a footer's numbers (a row group may claim -5 rows), and its Python metadata objects
# abort the process (a C++ exception, no Python one) on some damaged footers, e.g. a level histogram
# of the wrong length. So adoption reads the row groups from the Thrift bytes first, bounded, and
# hands pyarrow only footers that pass `check_footer`.


def _varint(b, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(b) or shift > 63:
            raise ValueError("a truncated or overlong varint")
        c = b[pos]
        pos += 1
        out |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return out, pos


def _zigzag(v: int) -> int:
    return (v >> 1) ^ -(v & 1)


def _value(b, pos: int, t: int, depth: int):
    """One Thrift compact-protocol value of type ``t`` at ``pos``: ``(value, next pos)``; a struct
    is ``{field id: value}``, a list a list, a binary ``bytes``."""
    if t in (1, 2):  # bools (in a list: one byte each)
        return t == 1, pos
    if t == 3:
        if pos >= len(b):
            raise ValueError("truncated")
        return b[pos], pos + 1
    if t in (4, 5, 6):
        v, pos = _varint(b, pos)
        return _zigzag(v), pos
    if t == 7:
        if pos + 8 > len(b):
            raise ValueError("truncated")
        return None, pos + 8
    if t == 8:
        n, pos = _varint(b, pos)
        if pos + n > len(b):
            raise ValueError(f"a string of {n} bytes runs past the footer")
        return bytes(b[pos : pos + n]), pos + n
    if depth > _MAX_THRIFT_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_THRIFT_DEPTH} levels")
    if t in (9, 10):
        if pos >= len(b):
            raise ValueError("truncated")
        n, et = b[pos] >> 4, b[pos] & 0x0F
        pos += 1
        if n == 15:
            n, pos = _varint(b, pos)
        if n > len(b) - pos:  # every element takes a byte at least
            raise ValueError(f"a list of {n} elements runs past the footer")
        out = []
        for _ in range(n):
            if et in (1, 2):  # a bool element is a byte of its own
                v, pos = b[pos] == 1, pos + 1
            else:
                v, pos = _value(b, pos, et, depth + 1)
            out.append(v)
        return out, pos
    if t == 11:
        n, pos = _varint(b, pos)
        if not n:
            return [], pos
        if n > len(b) - pos:
            raise ValueError(f"a map of {n} entries runs past the footer")
        kt, vt = b[pos] >> 4, b[pos] & 0x0F
        pos += 1
        out = []
        for _ in range(n):
            k, pos = _value(b, pos, kt, depth + 1)
            v, pos = _value(b, pos, vt, depth + 1)
            out.append((k, v))
        return out, pos
    if t == 12:
        fields: dict[int, Any] = {}
        fid = 0
        while True:
            if pos >= len(b):
                raise ValueError("a struct runs past the footer")
            h = b[pos]
            pos += 1
            if h == 0:
                return fields, pos
            ft = h & 0x0F
            if h >> 4:
                fid += h >> 4
            else:
                v, pos = _varint(b, pos)
                fid = _zigzag(v)
            fields[fid], pos = _value(b, pos, ft, depth + 1)
    if t == 13:  # uuid
        if pos + 16 > len(b):
            raise ValueError("truncated")
        return None, pos + 16
    raise ValueError(f"unknown Thrift type {t}")


def _int(v, field: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{field} is missing or not an integer")
    return v


class Chunk(NamedTuple):
    """What the footer says of one column chunk (histogram lengths 0 when absent)."""

    path: str  # ``path_in_schema``, dotted
    physical_type: int  # Thrift ``Type``: 0 BOOLEAN .. 7 FIXED_LEN_BYTE_ARRAY
    num_values: int
    null_count: int | None
    def_hist: int
    rep_hist: int


_PHYSICAL = ("BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")


def footer_row_groups(data, where: str) -> tuple[tuple[int, tuple[Chunk, ...]], ...]:
    """The row groups a Parquet file's footer declares, read from the file's bytes ``data`` with
    crossfeed's own bounded Thrift reader: ``(num_rows, column chunks)`` each. A footer that does
    not parse, or a row count outside ``[0, MAX_ROWS]``, is a `CorruptRecordError` naming the file
    and the row group."""
    n = len(data)
    if n < 12 or bytes(data[:4]) != MAGIC or bytes(data[-4:]) != MAGIC:
        raise CorruptRecordError(where, 0, "not a readable Parquet file (no PAR1 magic at both ends)")
    flen = int.from_bytes(bytes(data[-8:-4]), "little")
    start = n - 8 - flen
    if flen <= 0 or start < 4:
        raise CorruptRecordError(where, n - 8, f"the footer claims {flen} bytes; the file has {n}")
    try:
        meta, _ = _value(memoryview(data)[start : n - 8], 0, 12, 0)
        groups = meta.get(4, [])
        if not isinstance(groups, list):
            raise ValueError("row_groups is not a list")
    except ValueError as e:
        raise CorruptRecordError(where, start, f"the footer does not parse ({e}); the file is damaged") from e
    out = []
    for r, rg in enumerate(groups):
        try:
            if not isinstance(rg, dict):
                raise ValueError("not a struct")
            rows = _int(rg.get(3), "num_rows")
            if not 0 <= rows <= MAX_ROWS:
                raise ValueError(f"it claims {rows} rows (a row group holds 0 to {MAX_ROWS})")
            cols = []
            chunks = rg.get(1, [])
            for j, chunk in enumerate(chunks if isinstance(chunks, list) else [None]):
                md = chunk.get(3) if isinstance(chunk, dict) else None
                if not isinstance(md, dict):
                    raise ValueError(f"column chunk {j} has no metadata")
                sizes = md.get(16, {})
                sizes = sizes if isinstance(sizes, dict) else {}
                hist = [h if isinstance(h, list) else [] for h in (sizes.get(3, []), sizes.get(2, []))]
                stats = md.get(12, {})
                nulls = stats.get(3) if isinstance(stats, dict) else None
                parts = md.get(3)
                if not isinstance(parts, list) or not all(isinstance(x, bytes) for x in parts):
                    raise ValueError(f"column chunk {j} has no path_in_schema")
                cols.append(
                    Chunk(
                        ".".join(x.decode("utf-8", "replace") for x in parts),
                        _int(md.get(1), f"column chunk {j} type"),
                        _int(md.get(5), f"column chunk {j} num_values"),
                        nulls if isinstance(nulls, int) and not isinstance(nulls, bool) else None,
                        len(hist[0]),
                        len(hist[1]),
                    )
                )
        except ValueError as e:
            raise CorruptRecordError(where, start, f"row group {r}: {e}; the footer is damaged") from e
        out.append((rows, tuple(cols)))
    return tuple(out)


def check_footer(groups, md, where: str) -> tuple[int, ...]:
    """The row count of each row group, once `footer_row_groups`' reading agrees with pyarrow's
    metadata ``md`` (its schema's levels: a histogram of another length aborts pyarrow) and every
    flat column of a row group holds one value a row (so a row group cannot claim rows it lacks)."""
    if len(groups) != md.num_row_groups:
        raise CorruptRecordError(
            where, 0, f"the footer lists {len(groups)} row groups, pyarrow reads {md.num_row_groups}"
        )
    schema = md.schema
    levels = [
        (schema.column(j).max_definition_level, schema.column(j).max_repetition_level, schema.column(j).physical_type)
        for j in range(len(schema))
    ]
    for r, (rows, cols) in enumerate(groups):
        if len(cols) != len(levels):
            raise CorruptRecordError(where, 0, f"row group {r} has {len(cols)} column chunks, the schema {len(levels)}")
        for j, (c, (max_def, max_rep, physical)) in enumerate(zip(cols, levels)):
            values, def_len, rep_len = c.num_values, c.def_hist, c.rep_hist
            if not 0 <= c.physical_type < len(_PHYSICAL) or _PHYSICAL[c.physical_type] != physical:
                raise CorruptRecordError(
                    where,
                    0,
                    f"row group {r} column {j} is of physical type {c.physical_type}, the schema says "
                    f"{physical}; the footer is damaged",
                )
            if def_len not in (0, max_def + 1) or rep_len not in (0, max_rep + 1):
                raise CorruptRecordError(
                    where,
                    0,
                    f"row group {r} column {j}: level histograms of {def_len}/{rep_len} entries, the schema "
                    f"allows {max_def + 1}/{max_rep + 1}; the footer is damaged",
                )
            if max_rep == 0 and values != rows:
                raise CorruptRecordError(
                    where,
                    0,
                    f"row group {r} claims {rows} rows, its column {j} holds {values} values; the footer is damaged",
                )
    return tuple(rows for rows, _ in groups)
