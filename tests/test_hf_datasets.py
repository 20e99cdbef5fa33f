"""Hugging Face ``datasets`` folders (real `save_to_disk` output, made from local data): named as
what they are — by the Loader, ``crossfeed info`` and ``crossfeed index`` — with one message saying
how crossfeed reads them (``to_parquet``, then ``crossfeed index``), and that route keeps typed
columns, token lists and images stored as bytes."""

from __future__ import annotations

import io

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import DatasetNotFoundError

datasets = pytest.importorskip("datasets")


def _png(shade: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (shade, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


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
        "label": [0, 1, 1],
        "x": [1e6 + 0.125, -2.5, 3.0000001],
        "tokens": [[1, 2, 3], [4], [5, 6]],
        "text": ["a", "bé", "c"],
        "image": [{"bytes": _png(s), "path": None} for s in (10, 20, 30)],
    }
    return datasets.Dataset.from_dict(rows, features=features), rows


def test_a_save_to_disk_folder_is_named_with_what_to_do(tmp_path):
    ds, _ = _hf_dataset()
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    for folder, kind in (("saved", "Dataset saved with save_to_disk"), ("dict", "DatasetDict saved")):
        root = str(tmp_path / folder)
        with pytest.raises(DatasetNotFoundError, match=f"Hugging Face `datasets` {kind}.*to_parquet.*crossfeed index"):
            crossfeed.Loader(root, batch_size=2)
        for args in (["info", root], ["index", root]):
            r = CliRunner().invoke(app, args)
            assert r.exit_code == 2 and "CRC" not in r.output, r.output
            lines = r.output.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"error: {root}: a Hugging Face `datasets`")
    assert not (tmp_path / "saved" / "crossfeed.json").exists()


def test_the_parquet_route_keeps_typed_columns_tokens_and_images(tmp_path):
    ds, rows = _hf_dataset()
    ds.save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "out"
    out.mkdir()
    # what the message says to run
    datasets.load_from_disk(str(tmp_path / "saved")).to_parquet(str(out / "train-00000-of-00001.parquet"))
    r = CliRunner().invoke(app, ["index", str(out), "--lengths", "tokens"])
    assert r.exit_code == 0, r.output
    with crossfeed.Loader(str(out), batch_size=3, shuffle=False) as ld:
        (batch,) = list(ld)
        features = {f.name: f for f in ld.features}
    assert batch["x"].dtype == np.float64 and batch["x"].tolist() == rows["x"]
    assert batch["label"].tolist() == rows["label"]
    assert [list(t) for t in batch["tokens"]] == rows["tokens"] and features["tokens"].dtype == "int32"
    assert list(batch["text"]) == rows["text"]
    assert batch["image"].shape == (3, 4, 5, 3) and batch["image"][:, 0, 0, 0].tolist() == [10, 20, 30]
    with crossfeed.Loader(str(out), batch_size=2, pack=crossfeed.Pack(length=4), features=["tokens"]) as ld:
        packed = list(ld)
    assert sorted(int(t) for b in packed for t in b["tokens"][b["segment_ids"] > 0]) == [1, 2, 3, 4, 5, 6]
