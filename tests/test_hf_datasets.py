"""Hugging Face ``datasets`` folders (real `save_to_disk` output, made from local data), read in
place: ``crossfeed index`` adopts their Arrow IPC files as Parquet files are adopted (each record
batch a row group; typed columns, ClassLabel ints, token lists with their lengths, images stored as
bytes), the Loader reads them memory-mapped, ``verify`` checks them and ``datasets`` still loads
the folder; a folder not indexed yet, or a DatasetDict, is named with what to run."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import lazy_import, requires
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import CorruptRecordError, DatasetNotFoundError

datasets = lazy_import("datasets")

pytestmark = [pytest.mark.slow, requires("datasets")]  # HF datasets and pandas imported


def _png(shade: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (shade, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


ROWS = 25


def _hf_dataset():
    features = datasets.Features(
        {
            "label": datasets.ClassLabel(names=["cat", "dog"]),
            "x": datasets.Value("float64"),
            "tokens": datasets.Sequence(datasets.Value("int32")),
            "text": datasets.Value("string"),
            "image": datasets.Image(),
        }
    )
    rows = {
        "label": [i % 2 for i in range(ROWS)],
        "x": [1e6 + i / 8 + 1e-7 for i in range(ROWS)],
        "tokens": [list(range(i, i + 1 + i % 5)) for i in range(ROWS)],
        "text": [f"doc {i} é" for i in range(ROWS)],
        "image": [{"bytes": _png(10 * (i % 20)), "path": None} for i in range(ROWS)],
    }
    return datasets.Dataset.from_dict(rows, features=features), rows


def _cli(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def _check(batch: dict, rows: dict, order) -> None:
    assert batch["x"].dtype == np.float64 and batch["x"].tolist() == [rows["x"][i] for i in order]
    assert batch["label"].tolist() == [rows["label"][i] for i in order]
    assert [list(t) for t in batch["tokens"]] == [rows["tokens"][i] for i in order]
    assert list(batch["text"]) == [rows["text"][i] for i in order]
    assert batch["image"].shape == (len(order), 4, 5, 3)
    assert batch["image"][:, 0, 0, 0].tolist() == [10 * (i % 20) for i in order]


def test_a_save_to_disk_folder_is_indexed_and_read_in_place(tmp_path):
    ds, rows = _hf_dataset()
    saved = tmp_path / "saved"
    ds.save_to_disk(str(saved), max_shard_size="2KB")  # several Arrow files
    assert len(list(saved.glob("data-*.arrow"))) > 1
    with pytest.raises(DatasetNotFoundError, match="save_to_disk.*not indexed yet.*crossfeed index"):
        crossfeed.Loader(str(saved), batch_size=2)
    r = _cli("info", saved)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "CRC" not in r.output

    r = _cli("index", saved, "--lengths", "tokens")
    assert r.exit_code == 0, r.output
    with crossfeed.open_dataset(saved) as d:
        assert d.schema["tokens"].dtype == "int32" and d.schema["tokens"].shape == (None,)
        assert d.schema["image"].encoding.value == "image" and d.schema["x"].dtype == "float64"
    with crossfeed.Loader(str(saved), batch_size=ROWS, shuffle=False) as ld:
        (batch,) = list(ld)
    _check(batch, rows, range(ROWS))
    with crossfeed.Loader(str(saved), batch_size=4, seed=3, return_index=True, drop_last=True) as ld:
        for b in ld:  # shuffled batches: every row is the row its index says
            assert [list(t) for t in b["tokens"]] == [rows["tokens"][i] for i in b["__index__"]]
    with crossfeed.Loader(str(saved), batch_size=2, pack=crossfeed.Pack(length=8), features=["tokens"]) as ld:
        packed = sorted(int(t) for b in ld for t in b["tokens"][b["segment_ids"] > 0])
    assert packed == sorted(t for row in rows["tokens"] for t in row)
    assert _cli("verify", saved).exit_code == 0
    assert datasets.load_from_disk(str(saved))["x"] == rows["x"]  # the folder still loads in datasets


def test_index_dir_leaves_the_folder_untouched_and_a_changed_file_is_refused(tmp_path):
    ds, rows = _hf_dataset()
    saved, index = tmp_path / "saved", tmp_path / "index"
    ds.save_to_disk(str(saved))
    before = sorted(p.name for p in saved.iterdir())
    r = _cli("index", saved, "--index-dir", index)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in saved.iterdir()) == before
    allowed = dict(allowed_roots=[str(saved)])  # data outside the dataset is read where allowed
    with crossfeed.Loader(str(index), batch_size=ROWS, shuffle=False, **allowed) as ld:
        _check(next(iter(ld)), rows, range(ROWS))
    arrow = next(saved.glob("data-*.arrow"))
    arrow.write_bytes(arrow.read_bytes() + b"\0" * 8)
    with pytest.raises(CorruptRecordError, match="changed after `crossfeed index`"):
        with crossfeed.Loader(str(index), batch_size=ROWS, shuffle=False, **allowed) as ld:
            list(ld)


def test_a_dataset_dict_is_named_and_each_split_folder_indexes(tmp_path):
    ds, rows = _hf_dataset()
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(str(folder))
    for args in (["info", folder], ["index", folder]):
        r = _cli(*args)
        assert r.exit_code == 2 and "DatasetDict" in r.output and f"crossfeed index {folder}/<split>" in r.output
    assert _cli("index", folder / "test").exit_code == 0
    with crossfeed.Loader(str(folder / "test"), batch_size=5, shuffle=False) as ld:
        _check(next(iter(ld)), rows, range(5))


def test_the_parquet_route_reads_the_same(tmp_path):
    ds, rows = _hf_dataset()
    out = tmp_path / "out"
    out.mkdir()
    ds.to_parquet(str(out / "train-00000-of-00001.parquet"))
    assert _cli("index", out).exit_code == 0
    with crossfeed.Loader(str(out), batch_size=ROWS, shuffle=False) as ld:
        _check(next(iter(ld)), rows, range(ROWS))


def test_the_cache_folder_of_load_dataset_reads_its_splits(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "d.jsonl").write_text('{"a": 1, "t": [1, 2]}\n{"a": 2, "t": [3]}\n{"a": 3, "t": []}\n')
    files = {"train": str(tmp_path / "d.jsonl"), "test": str(tmp_path / "d.jsonl")}
    datasets.load_dataset("json", data_files=files, cache_dir=str(tmp_path / "cache"))
    (folder,) = {p.parent for p in (tmp_path / "cache").rglob("*-train.arrow")}
    r = _cli("index", folder, "--index-dir", tmp_path / "index")
    assert r.exit_code == 0, r.output
    with crossfeed.open_dataset(tmp_path / "index", allowed_roots=[str(folder)]) as d:
        assert sorted(d.splits) == ["test", "train"]
        assert [d["test"][i]["t"].tolist() for i in range(3)] == [[1, 2], [3], []]
