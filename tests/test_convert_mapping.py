"""``crossfeed convert parquet|csv`` keep what they are given and map columns as ``crossfeed
index`` does (one mapping): float64 stays float64, a timestamp with a time zone is int64 since the
epoch with its unit and zone in the manifest, a Categorical is int64 codes with its categories, a
nullable integer column is its values and a ``<name>/valid`` mask — equal, value for value and
dtype for dtype, to what ``index`` reads from the same file through the Loader. A narrowing is
asked for (``--types x:float32``) and said in the summary; ``--types`` given twice adds up, and
an option that takes one value is refused when given twice. (docs/convert.md, docs/adopt.md)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import lazy_import, requires
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app

pd = lazy_import("pandas")

pytestmark = [pytest.mark.slow, requires("pyarrow", "apache_beam", "pandas")]  # Beam conversions

N = 40


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _frame() -> pd.DataFrame:
    rng = np.random.default_rng(7)
    ints = pd.array([None if i % 7 == 3 else i * 3 for i in range(N)], dtype="Int64")
    return pd.DataFrame(
        {
            "id": np.arange(N, dtype=np.int64),
            "f64": 1e6 + rng.random(N),  # float32 would be off by up to 0.06
            "when": pd.date_range("2024-03-30 22:00", periods=N, freq="37min", tz="Europe/Paris"),
            "kind": pd.Categorical([["b", "a", "c"][i % 3] for i in range(N)], categories=["c", "a", "b"]),
            "count": ints,
            "small": np.arange(N, dtype=np.int32) - 5,
        }
    )


def _read_all(path, **kw) -> dict[str, np.ndarray]:
    with crossfeed.Loader(path, batch_size=N, shuffle="none", remainder="pad", **kw) as ld:
        (batch,) = list(ld)
    order = np.argsort(np.asarray(batch["id"]))
    return {k: np.asarray(v)[order] for k, v in batch.items()}


def test_convert_parquet_equals_index_for_every_column(tmp_path):
    df = _frame()
    (tmp_path / "pq").mkdir()
    df.to_parquet(tmp_path / "pq" / "t.parquet", row_group_size=16)
    r = _run("index", tmp_path / "pq", "--index-dir", tmp_path / "idx")
    assert r.exit_code == 0, r.output
    r = _run("convert", "parquet", tmp_path / "pq" / "t.parquet", tmp_path / "conv", "--shards", "2")
    assert r.exit_code == 0, r.output
    assert "narrowed" not in r.output
    indexed = _read_all(tmp_path / "idx", allowed_roots=[tmp_path / "pq"])
    converted = _read_all(tmp_path / "conv")
    assert (
        sorted(converted) == sorted(indexed) == sorted(["id", "f64", "when", "kind", "count", "count/valid", "small"])
    )
    for k in indexed:
        assert converted[k].dtype == indexed[k].dtype, k
        assert np.array_equal(converted[k], indexed[k]), k
    assert converted["f64"].dtype == np.float64 and np.array_equal(converted["f64"], df["f64"].to_numpy())
    assert converted["small"].dtype == np.int32
    codes = converted["kind"]
    with (
        crossfeed.open_dataset(tmp_path / "conv") as ds,
        crossfeed.open_dataset(tmp_path / "idx", allowed_roots=[tmp_path / "pq"]) as ix,
    ):
        maps, imaps = ds.manifest.metadata["parquet"]["columns"], ix.manifest.metadata["parquet"]["columns"]
        assert maps == imaps
        assert maps["when"]["timezone"] == "Europe/Paris"
        unit = maps["when"]["unit"]
        names = maps["kind"]["class_names"]
        assert ds.schema["f64"].dtype == "float64"
    want_when = df["when"].dt.tz_convert("UTC").dt.tz_localize(None).to_numpy().astype(f"datetime64[{unit}]")
    assert np.array_equal(converted["when"].astype(f"datetime64[{unit}]"), want_when)  # UTC, in the unit recorded
    assert [names[c] for c in codes] == list(df["kind"].astype(str))
    valid = ~df["count"].isna().to_numpy()
    assert np.array_equal(converted["count/valid"], valid)
    assert np.array_equal(converted["count"][valid], df["count"].dropna().to_numpy())


def test_convert_csv_keeps_float64_and_narrows_only_when_asked(tmp_path):
    df = _frame()[["id", "f64", "small"]]
    (tmp_path / "pq").mkdir()
    df.to_parquet(tmp_path / "pq" / "t.parquet")
    df.to_csv(tmp_path / "t.csv", index=False)  # repr of each float: round-trips
    assert _run("index", tmp_path / "pq", "--index-dir", tmp_path / "idx").exit_code == 0
    indexed = _read_all(tmp_path / "idx", allowed_roots=[tmp_path / "pq"])
    for types in ([], ["--types", "f64:float64"], ["--types", "f64:double"]):
        out = tmp_path / f"csv{len(types)}{types[-1][-3:] if types else ''}"
        r = _run("convert", "csv", tmp_path / "t.csv", out, *types)
        assert r.exit_code == 0, r.output
        got = _read_all(out)
        assert got["f64"].dtype == np.float64 and np.array_equal(got["f64"], indexed["f64"])
        assert "narrowed" not in r.output
    # asked: narrowed, and said so in the summary and the manifest
    r = _run("convert", "csv", tmp_path / "t.csv", tmp_path / "narrow", "--types", "f64:float32")
    assert r.exit_code == 0, r.output
    assert "narrowed f64: float64 narrowed to float32" in r.output
    got = _read_all(tmp_path / "narrow")
    assert got["f64"].dtype == np.float32 and np.array_equal(got["f64"], indexed["f64"].astype(np.float32))
    with crossfeed.open_dataset(tmp_path / "narrow") as ds:
        assert "f64" in ds.manifest.metadata["narrowed"]
    r = _run("convert", "parquet", tmp_path / "pq" / "t.parquet", tmp_path / "pnarrow", "--types", "f64:float32")
    assert r.exit_code == 0 and "narrowed f64: float64 narrowed to float32" in r.output, r.output


def test_repeated_options_add_up_or_are_refused(tmp_path):
    df = _frame()[["id", "f64", "small"]]
    df.to_parquet(tmp_path / "t.parquet")
    r = _run(
        "convert", "parquet", tmp_path / "t.parquet", tmp_path / "o", "--types", "small:float32", "--types", "id:string"
    )
    assert r.exit_code == 0, r.output
    with crossfeed.open_dataset(tmp_path / "o") as ds:
        assert ds.schema["small"].dtype == "float32" and ds.schema["id"].dtype == "string"
        assert ds.schema["f64"].dtype == "float64"
    r = _run(
        "convert", "parquet", tmp_path / "t.parquet", tmp_path / "o2", "--types", "id:string", "--types", "id:int64"
    )
    assert r.exit_code != 0 and "two types" in r.output
    r = _run("convert", "parquet", tmp_path / "t.parquet", tmp_path / "o3", "--columns", "id", "--columns", "f64")
    assert r.exit_code == 0, r.output
    with crossfeed.open_dataset(tmp_path / "o3") as ds:
        assert ds.schema.names == ["id", "f64"]
    for args in (
        ["convert", "parquet", tmp_path / "t.parquet", tmp_path / "o4", "--shards", "1", "--shards", "2"],
        ["convert", "parquet", tmp_path / "t.parquet", tmp_path / "o4", "--label", "id", "--label", "small"],
        ["convert", "parquet", tmp_path / "t.parquet", tmp_path / "o4", "--verify", "--no-verify"],
        ["index", tmp_path, "--split", "a", "-s", "b"],
    ):
        r = _run(*args)
        assert r.exit_code == 2 and "given more than once" in r.output, (args, r.output)
    assert not (tmp_path / "o4").exists()
    shutil.rmtree(tmp_path / "o3")
    assert json.loads((tmp_path / "o" / "crossfeed.json").read_text())["metadata"]["narrowed"]
