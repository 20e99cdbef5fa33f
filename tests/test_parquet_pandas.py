"""A DataFrame as pandas writes it (float64, Categorical, timestamps with and without a time
zone, NaN floats, nullable Int64, strings with None), adopted with ``crossfeed index`` and read
back value by value against pyarrow's own read of the file."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import lazy_import
from typer.testing import CliRunner

from crossfeed import Loader, open_dataset
from crossfeed.cli.main import app
from crossfeed.write.adopt.index import index_dataset, parse_feature

pd = lazy_import("pandas")
pytestmark = pytest.mark.slow  # pandas imported


N = 40


@pytest.fixture
def frame_dir(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "frame"
    root.mkdir()
    df = pd.DataFrame(
        {
            "x": rng.standard_normal(N),  # float64 whose float32 rounding differs in every row
            "small": np.arange(N, dtype=np.int16),
            "kind": pd.Categorical(["b", "a", "c", None] * (N // 4), categories=["z", "c", "b", "a"]),
            "when": pd.date_range("2021-03-01", periods=N, freq="37min"),
            "when_tz": pd.date_range("2021-03-01", periods=N, freq="h", tz="Europe/Paris"),
            "nan": np.where(np.arange(N) % 3 == 0, np.nan, rng.standard_normal(N)),
            "count": pd.array([i if i % 5 else None for i in range(N)], dtype="Int64"),
            "name": [f"n{i}" if i % 7 else None for i in range(N)],
        }
    )
    df.to_parquet(root / "frame.parquet", row_group_size=9)
    return root, df


def _batch(root) -> dict:
    with Loader(root, batch_size=N, shuffle="none") as loader:
        (b,) = list(loader)
    return b


def test_every_pandas_column_reads_back_as_pyarrow_reads_it(frame_dir):
    root, df = frame_dir
    manifest = index_dataset(root)
    table = pq.read_table(root / "frame.parquet")
    back = table.to_pandas()
    b = _batch(root)
    # float64 and int16 keep their dtype: equal to pyarrow's values bit for bit
    assert b["x"].dtype == np.float64 and b["small"].dtype == np.int16
    np.testing.assert_array_equal(b["x"], table.column("x").to_numpy())
    np.testing.assert_array_equal(b["small"], table.column("small").to_numpy())
    # Categorical: pandas' codes (-1 for a missing value), the categories as class_names
    cols = manifest.metadata["parquet"]["columns"]
    assert cols["kind"]["class_names"] == ["z", "c", "b", "a"]
    np.testing.assert_array_equal(b["kind"], back["kind"].cat.codes.to_numpy())
    # timestamps: integers since the epoch in the file's unit, named in the manifest with the zone
    for k in ("when", "when_tz"):
        np.testing.assert_array_equal(b[k], table.column(k).to_numpy().view(np.int64))
        assert cols[k]["as"] == "epoch" and cols[k]["unit"] == table.schema.field(k).type.unit
    assert cols["when_tz"]["timezone"] == "Europe/Paris" and cols["when"]["timezone"] is None
    # a float null is NaN, where pandas has NaN
    np.testing.assert_array_equal(np.isnan(b["nan"]), back["nan"].isna().to_numpy())
    np.testing.assert_array_equal(b["nan"], back["nan"].to_numpy())
    # nullable Int64 and strings with None: the values, and a mask feature False at each null
    np.testing.assert_array_equal(b["count/valid"], back["count"].notna().to_numpy())
    np.testing.assert_array_equal(b["count"][b["count/valid"]], back["count"].dropna().to_numpy(np.int64))
    np.testing.assert_array_equal(b["name/valid"], back["name"].notna().to_numpy())
    assert [v for v, ok in zip(b["name"], b["name/valid"]) if ok] == back["name"].dropna().tolist()


def test_every_decision_is_reported_in_one_run(frame_dir):
    root, _ = frame_dir
    r = CliRunner().invoke(app, ["index", str(root)])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("column ")]
    assert len(lines) == 8  # one line per column
    text = "\n".join(lines)
    assert "x: tensor float64[] (Parquet double), dtype kept as stored" in text
    assert "kind: int64 codes of 4 categories" in text and "class_names" in text and "-1" in text
    assert "when_tz: int64 nanoseconds since 1970-01-01" in text or "when_tz: int64 microseconds" in text
    assert "nan: " in text and "nulls become NaN" in text
    assert "mask feature 'count/valid'" in text and "--feature count=float64" in text
    assert "mask feature 'name/valid'" in text
    assert open_dataset(root).schema.names[-2:] == ["name", "name/valid"]


@pytest.mark.parametrize("spec", ["x=tensor:float64", "x=float64", "x=double", "x=float:float64", "x=tensor:float64:"])
def test_natural_spellings_of_a_float64_column(frame_dir, spec):
    root, _ = frame_dir
    index_dataset(root, features=[spec, "kind=string"])
    b = _batch(root)
    assert b["x"].shape == (N,) and b["x"].dtype == np.float64
    np.testing.assert_array_equal(b["x"], pq.read_table(root / "frame.parquet").column("x").to_numpy())
    # a Categorical declared a string: its values, pandas' None as ""
    assert list(b["kind"]) == ["b", "a", "c", ""] * (N // 4)


def test_declared_spellings_and_nulls(frame_dir):
    root, _ = frame_dir
    assert parse_feature("s=string") == parse_feature("s=bytes:string")
    assert parse_feature("v=int32:3").shape == (3,) and parse_feature("v=int32:3").dtype == "int32"
    index_dataset(root, features=["count=float64", "small=int64"])  # nulls become NaN in a float
    b = _batch(root)
    assert set(b) == {"count", "small"} and b["small"].dtype == np.int64
    assert np.isnan(b["count"]).sum() == N // 5 and b["count"][1] == 1.0
    index_dataset(root, features=["count=int64"], force=True)  # a declared int keeps the mask
    b = _batch(root)
    assert b["count/valid"].sum() == N - N // 5 and b["count"][0] == 0 and b["count"][1] == 1
