"""Parquet files written by the tools users have (pyarrow, HF ``datasets``), and the oracle every
Parquet test compares with: pyarrow's own ``pq.read_table``, one Python value per row."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS = (53, 47)  # rows of the two files
ROW_GROUP = 10  # rows per row group: 6 + 5 row groups, the last of each short


def write_pyarrow_files(root, *, checksums: bool = True) -> list[str]:
    """Two files of every column type crossfeed maps, several row groups each."""
    os.makedirs(root, exist_ok=True)
    paths = []
    start = 0
    for f, n in enumerate(ROWS):
        rng = np.random.default_rng(f)
        ids = np.arange(start, start + n)
        table = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "label": pa.array((ids % 7).astype(np.int32)),
                "score": pa.array(rng.random(n)),  # float64, kept
                "vec": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 3).astype(np.float32)), 3),
                "mat": pa.FixedSizeListArray.from_arrays(
                    pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 100, n * 4).astype(np.int16)), 2), 2
                ),
                "seq": pa.array([[int(i), int(i) + 1, int(i) + 2, int(i) + 3] for i in ids], pa.list_(pa.int64())),
                "ragged": pa.array([rng.random(int(i) % 5).tolist() for i in ids], pa.list_(pa.float32())),
                "blob": pa.array([bytes(rng.integers(0, 256, int(i) % 9, dtype=np.uint8)) for i in ids], pa.binary()),
                "text": pa.array([f"row {i} ünïcode" for i in ids]),
                "flag": pa.array(ids % 3 == 0),
            }
        )
        path = os.path.join(root, f"part-{f}.parquet")
        pq.write_table(table, path, row_group_size=ROW_GROUP, write_page_checksum=checksums)
        paths.append(path)
        start += n
    return paths


def png(value: int) -> bytes:
    from PIL import Image

    arr = np.full((6, 5, 3), value, dtype=np.uint8)
    arr[0, 0] = (value * 7) % 256
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_hf_file(root, n: int = 40) -> str:
    """One file written by HF ``datasets`` (``Dataset.from_dict(...).to_parquet``), with an Image column."""
    import datasets

    os.makedirs(root, exist_ok=True)
    features = datasets.Features(
        {
            "label": datasets.ClassLabel(names=["cat", "dog", "fish"]),
            "x": datasets.Value("float32"),
            "emb": datasets.Sequence(datasets.Value("float32"), length=4),
            "tokens": datasets.Sequence(datasets.Value("int32")),
            "caption": datasets.Value("string"),
            "image": datasets.Image(),
        }
    )
    rng = np.random.default_rng(3)
    ds = datasets.Dataset.from_dict(
        {
            "label": [i % 3 for i in range(n)],
            "x": rng.random(n).astype(np.float32).tolist(),
            "emb": rng.random((n, 4)).astype(np.float32).tolist(),
            "tokens": [list(range(i % 6)) for i in range(n)],
            "caption": [f"caption {i}" for i in range(n)],
            "image": [{"bytes": png(i * 5), "path": None} for i in range(n)],
        },
        features=features,
    )
    path = os.path.join(root, "train-00000-of-00001.parquet")
    ds.to_parquet(path, batch_size=12)  # row groups of 12 rows
    return path


def oracle(paths) -> dict[str, list]:
    """Every row of the files, in order, as pyarrow reads them (``pq.read_table``)."""
    tables = [pq.read_table(p) for p in paths]
    return {name: [v for t in tables for v in t.column(name).to_pylist()] for name in tables[0].column_names}


def assert_row_equal(batch_value, expected, name: str, where: str) -> None:
    """One row of a crossfeed batch equals pyarrow's Python value (numbers compared in the
    feature's dtype)."""
    if isinstance(expected, (bytes, str)):
        assert batch_value == expected, f"{where} {name}"
    elif isinstance(expected, dict):  # an HF image struct: compared by the caller
        raise AssertionError("compare images explicitly")
    else:
        got = np.asarray(batch_value)
        want = np.asarray(expected, dtype=got.dtype)
        np.testing.assert_array_equal(got, want, err_msg=f"{where} {name}")
