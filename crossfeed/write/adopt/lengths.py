"""``crossfeed index --lengths FEATURE``: the per-record lengths of an adopted dataset's integer
array feature (the tokens of a token dataset written by another tool), written beside each
shard as ``NAME.len`` (`crossfeed.format.lengths`: what sequence packing plans from) and pinned
by the manifest, so existing token datasets are packed in place.

A Parquet list column's lengths come from its offsets (one column read per row group, no values
decoded); a TFRecord shard's from each record's value count as the indexer decodes it anyway.
The files go where the index files go (`Placement.root`: beside the data or in ``--index-dir``).
"""

from __future__ import annotations

import array
import math
import os

import numpy as np

from crossfeed.errors import ConfigError, SchemaError
from crossfeed.format import example as ex
from crossfeed.format.lengths import lengths_path
from crossfeed.format.schema import SHAPE_SUFFIX, Schema
from crossfeed.write.staging import write_lengths


def lengths_features(lengths) -> tuple[str, ...]:
    """``--lengths`` as a tuple of feature names (one name, or several; None: none)."""
    if not lengths:
        return ()
    names = (lengths,) if isinstance(lengths, str) else tuple(lengths)
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"--lengths {list(names)}: name each feature once")
    return names


def check_features(schema: Schema, names: tuple[str, ...], where: str) -> None:
    """Each of ``names`` must be a one-dimensional array of integers (a token sequence)."""
    for name in names:
        if name not in schema.names:
            raise ConfigError(f"{where}: --lengths {name}: no such feature; the features are {schema.names}")
        f = schema[name]
        integer = f.codec.value_kind == "numeric" and f.codec.dtype(f).kind in "iu"
        if not integer or len(f.shape) != 1:
            raise SchemaError(
                f"{where}: --lengths {name}: the feature is {f.encoding.value} {f.dtype}{list(f.shape)}; lengths are "
                f"kept for one-dimensional integer arrays (token ids); name such a feature, or leave out --lengths"
            )


def write_file(root: str, shard: str, lengths: np.ndarray) -> str:
    """Write ``root/shard.len`` (``(num_records, k)``); its sha256 for the manifest."""
    return write_lengths(lengths_path(os.path.join(root, shard)), lengths)


def parquet_lengths(pa, pf, path: str, column: str, read_group) -> np.ndarray:
    """The number of values of list column ``column`` in each row of the open Parquet file ``pf``
    (``read_group(r, columns)`` reads a row group), from the list offsets; a null list is 0."""
    out = []
    for r in range(pf.metadata.num_row_groups):
        arr = read_group(r, [column]).column(column).combine_chunks()
        if pa.types.is_fixed_size_list(arr.type):
            out.append(np.full(len(arr), arr.type.list_size, dtype=np.int64))
        else:
            out.append(arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


class RecordLengths:
    """What decoding each record of a TFRecord shard tells of a feature's length: the number of
    list values, the shape a variable tensor carries, or a fixed tensor's byte size. `lengths`
    turns them into value counts once the schema is known."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.seen = [array.array("q") for _ in names]  # (values, shape's product, bytes) per record, flat

    def add(self, parsed: dict) -> None:
        for j, name in enumerate(self.names):
            kind, region = parsed.get(name, (0, b""))
            vals = ex.kind_values(kind, region)
            shape = parsed.get(name + SHAPE_SUFFIX)
            count = math.prod(ex.int64_values(shape[1]).tolist()) if shape is not None else -1
            nbytes = len(vals[0]) if kind == ex.BYTES and len(vals) == 1 else -1
            self.seen[j].extend((len(vals), count, nbytes))

    def lengths(self, schema: Schema, where: str) -> np.ndarray:
        """``(records, k)``: each record's number of values of each feature of ``schema``."""
        out = np.zeros((len(self.seen[0]) // 3 if self.seen else 0, len(self.names)), dtype=np.int64)
        for j, name in enumerate(self.names):
            f = schema[name]
            seen = np.frombuffer(self.seen[j], dtype=np.int64).reshape(-1, 3)
            if f.codec.listed:  # a list's length is its count of values
                out[:, j] = seen[:, 0]
            elif not f.fixed:
                out[:, j] = seen[:, 1]
            else:
                out[:, j] = math.prod(f.shape)
            if (out[:, j] < 0).any():
                raise SchemaError(f"{where}: --lengths {name}: a record's length cannot be told from it")
        return out
