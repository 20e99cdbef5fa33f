"""End-to-end conversions of generated image folders, CSV, Parquet and numpy files."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from conftest import lazy_import, requires
from PIL import Image

from crossfeed import open_dataset
from crossfeed.beam_jobs.policy import BadInputError, EmptyInputError, ErrorPolicy
from crossfeed.beam_jobs.sample_data import make_image_folder
from crossfeed.errors import ConfigError

beam_job = lazy_import("crossfeed.beam_jobs.job")
pytestmark = [pytest.mark.slow, requires("apache_beam")]  # slow: real Beam pipelines

SKIP = ErrorPolicy("skip")


def raises(exc_type, match):
    """Beam may re-raise a DoFn's error as RuntimeError naming the type; accept either."""
    return pytest.raises((exc_type, RuntimeError), match=match)


def by_path(ds, split="train"):
    return {s["path"]: s for s in ds[split]}


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "img"
    make_image_folder(root, n_per_class=6, classes=("circle", "square", "triangle"), size=32)
    Image.new("L", (20, 12), 90).save(root / "square" / "grey.png")
    Image.new("L", (10, 16), 40).save(root / "circle" / "grey.jpg", format="JPEG")
    return root


def test_image_folder_keeps_bytes_and_records_shapes(folder, tmp_path):
    r = beam_job.convert(
        beam_job.make_source("images", folder), tmp_path / "out", splits="train=0.75,validation=0.25", num_shards=2
    )
    assert r.total_samples == 20 and r.skipped == 0
    ds = open_dataset(tmp_path / "out")
    assert ds.metadata["class_names"] == ["circle", "square", "triangle"]
    samples = {**by_path(ds), **by_path(ds, "validation")}
    assert len(samples) == 20
    for rel, s in samples.items():
        assert s["label"] == ["circle", "square", "triangle"].index(rel.split("/")[0])
        assert s["image"].shape == (int(s["height"]), int(s["width"]), int(s["channels"]))
    grey = samples["square/grey.png"]
    assert grey["image"].shape == (12, 20, 1) and np.all(grey["image"] == 90)
    raw = ds["train"].decode(*ds["train"].locate(0), decode_images=False)["image"]
    assert raw == (folder / ds["train"][0]["path"]).read_bytes()  # stored byte for byte
    shapes = ds.splits["train"].statistics["image"]["shapes"]
    assert sum(shapes.values()) == len(ds["train"]) and "32x32x3" in shapes


def test_rgba_is_reported_or_converted_and_corrupt_is_reported_or_skipped(folder, tmp_path):
    Image.new("RGBA", (8, 8), (255, 0, 0, 0)).save(folder / "triangle" / "alpha.png")
    with raises(BadInputError, "alpha.png.*convert"):
        beam_job.convert(beam_job.make_source("images", folder), tmp_path / "a")
    r = beam_job.convert(beam_job.make_source("images", folder, convert="png"), tmp_path / "b")
    alpha = by_path(open_dataset(tmp_path / "b"))["triangle/alpha.png"]
    assert alpha["image"].shape == (8, 8, 3) and np.all(alpha["image"] == 255)  # transparent → white
    (folder / "circle" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with raises(BadInputError, "broken.jpg"):
        beam_job.convert(beam_job.make_source("images", folder, convert="png"), tmp_path / "c")
    assert not (tmp_path / "c" / "crossfeed.json").exists()
    assert not [f for f in os.listdir(tmp_path / "c") if f.startswith(".tmp-")]
    r = beam_job.convert(beam_job.make_source("images", folder, convert="png", on_error=SKIP), tmp_path / "d")
    assert r.skipped == 1 and r.total_samples == 21
    assert open_dataset(tmp_path / "d").metadata["skipped_records"] == 1


def test_empty_inputs_are_clear_errors(tmp_path):
    (tmp_path / "img" / "cls").mkdir(parents=True)
    with pytest.raises(EmptyInputError, match="no image files"):
        beam_job.make_source("images", tmp_path / "img")
    (tmp_path / "only_header.csv").write_text("a,b\n")
    with raises(EmptyInputError, "no samples"):
        beam_job.convert(beam_job.make_source("csv", tmp_path / "only_header.csv"), tmp_path / "out")
    assert not (tmp_path / "out" / "crossfeed.json").exists()


CSV = "id,score,name,label\n1,0.5,ann,3\n2,,bob,1\n3,1.5,cy\n4,x,dee,2\n5,2.5,eve,0\n"


def test_csv_bad_row_reported_with_file_and_line(tmp_path):
    (tmp_path / "t.csv").write_text(CSV)
    with raises(BadInputError, r"t\.csv:4: expected 4 fields, got 3"):
        beam_job.convert(beam_job.make_source("csv", tmp_path / "t.csv", types="score:float"), tmp_path / "out")
    with raises(BadInputError, "more than 1 bad records"):
        beam_job.convert(
            beam_job.make_source("csv", tmp_path / "t.csv", types="score:float", on_error=ErrorPolicy("skip", 1)),
            tmp_path / "out",
        )
    r = beam_job.convert(
        beam_job.make_source(
            "csv", tmp_path / "t.csv", types="score:float", label="label", on_error=ErrorPolicy("skip", 2)
        ),
        tmp_path / "out",
    )
    assert r.skipped == 2 and r.total_samples == 3
    ds = open_dataset(tmp_path / "out")
    assert ds.schema.names == ["id", "score", "name", "label"] and ds.metadata["label_column"] == "label"
    rows = {s["name"]: s for s in ds["train"]}
    assert sorted(rows) == ["ann", "bob", "eve"]
    assert np.isnan(rows["bob"]["score"]) and rows["eve"]["score"] == 2.5 and rows["ann"]["label"] == 3
    assert ds.schema["id"].encoding.value == "int64" and ds.schema["name"].dtype == "string"
    assert ds.splits["train"].statistics["score"] == {"count": 3, "min": 0.5, "max": 2.5, "mean": 1.5}


def test_csv_headerless_and_odd_header(tmp_path):
    (tmp_path / "h.tsv").write_text("# exported 2024\n# by a tool\n7\t1.25\tq\n8\t2.5\tr\n")
    src = beam_job.make_source(
        "csv",
        tmp_path / "h.tsv",
        header=False,
        skip_rows=2,
        delimiter="\t",
        names="n,w,tag",
        label="tag",
        label_classes=False,
    )  # keep the label strings
    beam_job.convert(src, tmp_path / "out")
    ds = open_dataset(tmp_path / "out")
    assert sorted((int(s["n"]), float(s["w"]), s["label"]) for s in ds["train"]) == [(7, 1.25, "q"), (8, 2.5, "r")]
    keys = sorted(f"{s}" for s in ("h.tsv:3", "h.tsv:4"))
    assert keys == ["h.tsv:3", "h.tsv:4"]
    src = beam_job.make_source("csv", tmp_path / "h.tsv", header=False, skip_rows=2, delimiter="\t")
    assert [n for n, _ in src.columns] == ["col0", "col1", "col2"]
    with pytest.raises(ConfigError, match="unknown columns"):
        beam_job.make_source("csv", tmp_path / "h.tsv", header=False, skip_rows=2, delimiter="\t", types="nope:int64")


def test_csv_missing_int_is_a_bad_row(tmp_path):
    (tmp_path / "m.csv").write_text("a,b\n1,2\n,3\n")
    with raises(BadInputError, r"m\.csv:3: column 'a': empty value in an int64 column"):
        beam_job.convert(beam_job.make_source("csv", tmp_path / "m.csv", types={"a": "int64"}), tmp_path / "out")


def test_parquet_row_groups_types_and_nulls(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "k": pa.array([1, 2, None, 4, 5, 6], pa.int32()),
            "f": [0.5, None, 1.0, 2.0, 3.0, 4.0],
            "s": ["a", "b", "c", None, "e", "f"],
            "num": ["10", "20", "30", "40", "x", "60"],
            "y": [True, False, True, True, False, True],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    src = beam_job.make_source("parquet", tmp_path / "t.parquet", types="num:int64", label="y", on_error=SKIP)
    assert len(src.units()) == 3
    r = beam_job.convert(src, tmp_path / "out", num_shards=2)
    assert r.total_samples == 5 and r.skipped == 1  # an unparsable "x"; a null int is kept, masked (as index)
    ds = open_dataset(tmp_path / "out")
    assert ds.schema["k"].dtype == "int32" and ds.schema["f"].dtype == "float64"  # dtypes kept
    rows = sorted(
        (int(s["k"]), bool(s["k/valid"]), float(s["f"]), s["s"], bool(s["s/valid"]), int(s["num"]), int(s["label"]))
        for s in ds["train"]
    )
    assert rows[0] == (0, False, 1.0, "c", True, 30, 1)  # the null int: 0, and its mask False
    assert rows[1][:2] == (1, True) and rows[2][:4] == (2, True, rows[2][2], "b") and np.isnan(rows[2][2])
    assert rows[3] == (4, True, 2.0, "", False, 40, 1) and rows[4] == (6, True, 4.0, "f", True, 60, 1)
    ds.close()


def test_numpy_npz_stored_and_compressed_memory_mapped(tmp_path, monkeypatch):
    from crossfeed.beam_jobs import arrays

    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, size=(50, 4, 3), dtype=np.uint8)
    y = rng.integers(0, 3, 50)
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d" / "a.npz", x=x[:30], y=y[:30], w=np.linspace(0, 1, 30))
    np.savez_compressed(tmp_path / "d" / "b.npz", x=x[30:], y=y[30:], w=np.linspace(1.5, 2, 20))
    opened = []
    real = arrays.open_array

    def spy(root, where):
        a = real(root, where)
        opened.append(type(a).__name__)
        return a

    monkeypatch.setattr(arrays, "open_array", spy)
    src = beam_job.make_source("numpy", tmp_path / "d", label="y", batch_rows=8)
    beam_job.convert(src, tmp_path / "out", num_shards=3)
    assert set(opened) == {"memmap", "_StreamedArray"}  # never np.load of a whole array
    ds = open_dataset(tmp_path / "out")
    assert ds.schema["x"].shape == (4, 3) and ds.schema["w"].encoding.value == "float"
    got = {}
    for s in ds["train"]:
        got[int(round(float(s["w"]) * 1000))] = s
    assert len(got) == 50
    for i in range(30):
        s = got[int(round(np.linspace(0, 1, 30)[i] * 1000))]
        assert np.array_equal(s["x"], x[i]) and int(s["label"]) == y[i]


def test_numpy_directory_of_npy_files_is_one_feature_each(tmp_path):
    (tmp_path / "n").mkdir()
    np.save(tmp_path / "n" / "features.npy", np.arange(40, dtype=np.float32).reshape(10, 4))
    np.save(tmp_path / "n" / "target.npy", np.arange(10))
    beam_job.convert(beam_job.make_source("numpy", tmp_path / "n", label="target"), tmp_path / "out")
    ds = open_dataset(tmp_path / "out")
    assert sorted(ds.schema.names) == ["features", "label"]
    assert sorted((int(s["label"]), s["features"].tolist()) for s in ds["train"])[3] == (3, [12.0, 13.0, 14.0, 15.0])
    np.save(tmp_path / "n" / "short.npy", np.arange(9))
    with pytest.raises(ConfigError, match="same first"):
        beam_job.make_source("numpy", tmp_path / "n")


def test_inspect_image_formats():
    from crossfeed.beam_jobs.images import inspect_image

    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (1, 2, 3)).save(buf, format="GIF")
    with pytest.raises(ValueError, match="GIF"):
        inspect_image(buf.getvalue())
    data, shape = inspect_image(buf.getvalue(), "jpeg")
    assert shape == (4, 5, 3) and Image.open(io.BytesIO(data)).format == "JPEG"
    buf = io.BytesIO()
    Image.new("RGB", (6, 7)).save(buf, format="PNG")
    png = buf.getvalue()
    assert inspect_image(png) == (png, (7, 6, 3))
    with pytest.raises(ValueError, match="not a readable image"):
        inspect_image(png[: len(png) // 2])
