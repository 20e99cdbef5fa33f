"""``crossfeed index --lengths FEATURE``: token datasets written by other tools (pandas/pyarrow
Parquet with a list<int> column, TFRecord shards) get lengths files beside their shards, pinned
by the manifest and checked by ``crossfeed verify``."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from crossfeed import Loader, open_dataset
from crossfeed.cli.main import app
from crossfeed.format import tfrecord
from crossfeed.format.encode import encode_sample
from crossfeed.format.lengths import checked_lengths, lengths_path
from crossfeed.format.schema import Encoding, Feature, Schema


def cli(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def token_rows(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, size=int(rng.integers(0, 30))).tolist() for _ in range(n)]


def shard_lengths(root) -> dict[str, list[int]]:
    with open_dataset(root) as ds:
        k = len(ds.manifest.lengths)
        return {
            sh.file: checked_lengths((root / lengths_path(sh.file)).read_bytes(), sh.file, sh, k)[:, 0].tolist()
            for s in ds.splits.values()
            for sh in s.shards
        }


def test_parquet_list_column_lengths_come_from_its_offsets(tmp_path):
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = tmp_path / "data"
    data.mkdir()
    rows = {"a": token_rows(25, 1), "b": token_rows(17, 2)}
    pd.DataFrame({"input_ids": rows["a"], "doc": [f"a{i}" for i in range(25)]}).to_parquet(
        data / "train-00000-of-00002.parquet", row_group_size=10
    )
    table = pa.table({"input_ids": pa.array(rows["b"], pa.list_(pa.int64())), "doc": [f"b{i}" for i in range(17)]})
    pq.write_table(table, data / "train-00001-of-00002.parquet", row_group_size=6)
    r = cli("index", data, "--lengths", "input_ids")
    assert r.exit_code == 0 and "lengths of input_ids" in r.output, r.output
    got = shard_lengths(data)
    assert got == {
        "train-00000-of-00002.parquet": [len(x) for x in rows["a"]],
        "train-00001-of-00002.parquet": [len(x) for x in rows["b"]],
    }
    read = [b["input_ids"][0].tolist() for b in Loader(data, batch_size=1, shuffle=False)]
    assert read == rows["a"] + rows["b"]
    assert cli("verify", data).exit_code == 0
    (data / "train-00001-of-00002.parquet.len").write_bytes(b"\0" * (4 * 17))
    r = cli("verify", data)
    assert r.exit_code == 1 and "train-00001-of-00002.parquet.len: sha256 differs" in r.output
    r = cli("index", data, "--force", "--lengths", "doc")  # not an integer array
    assert r.exit_code == 2 and "--lengths doc" in r.output and "integer arrays" in r.output


def test_tfrecord_lengths_from_decoded_records(tmp_path):
    data = tmp_path / "tf"
    data.mkdir()
    plain = Schema([Feature("ids", "int64", (None,), Encoding.INT64), Feature("n", "int64", (), Encoding.INT64)])
    rows = token_rows(30, 3)
    for s in range(2):
        w = tfrecord.RecordWriter(data / f"train-0000{s}-of-00002.tfrecord")
        for i in range(s * 15, s * 15 + 15):
            w.write(encode_sample(plain, {"ids": np.array(rows[i], np.int64), "n": i}))
        w.close()
    r = cli("index", data, "--lengths", "ids")
    assert r.exit_code == 0, r.output
    got = shard_lengths(data)
    assert got == {f"train-0000{s}-of-00002.tfrecord": [len(x) for x in rows[s * 15 : s * 15 + 15]] for s in range(2)}
    assert cli("verify", data).exit_code == 0

    packed = tmp_path / "tensor"  # uint16 token tensors (raw bytes and their shape), declared
    packed.mkdir()
    tensor = Schema([Feature("tokens", "uint16", (None,), Encoding.TENSOR)])
    w = tfrecord.RecordWriter(packed / "part.tfrecord")
    for row in rows:
        w.write(encode_sample(tensor, {"tokens": np.array(row, np.uint16)}))
    w.close()
    r = cli("index", packed, "--lengths", "tokens", "--feature", "tokens=tensor:uint16:?")
    assert r.exit_code == 0, r.output
    assert shard_lengths(packed) == {"part.tfrecord": [len(x) for x in rows]}
    r = cli("index", data, "--force", "--lengths", "n")  # a scalar: no lengths to keep
    assert r.exit_code == 2 and "--lengths n" in r.output and "integer arrays" in r.output
