"""Hostile input at adoption (issue 22 item 14): a TFDS data directory written by
tensorflow-datasets itself (``tests/tfds_builder.py``) whose ``dataset_info.json``,
``features.json`` or labels file is then damaged, and Parquet files written by pyarrow whose
footer is then damaged. Only `CrossfeedError` subclasses may escape ``index_dataset``; ``crossfeed
index`` prints one ``error:`` line and exits 2; a refused dataset gets no manifest."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parquet_data import write_pyarrow_files
from typer.testing import CliRunner

from crossfeed.cli.main import EXIT_ERROR, app
from crossfeed.errors import CorruptRecordError, CrossfeedError
from crossfeed.format.manifest import MANIFEST
from crossfeed.write.adopt.index import index_dataset

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
needs_tfds = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow_datasets") is None, reason="needs tensorflow-datasets to build the data"
)


# ---- TFDS -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The data directory TFDS prepared (two splits, three shards each), built in a process of its own."""
    base = tmp_path_factory.mktemp("tfds")
    proc = subprocess.run(
        [sys.executable, str(HERE / "tfds_builder.py"), str(base / "data"), str(base / "expected.pkl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return base / "data" / "tiny_tfds" / "1.0.0"


@pytest.fixture
def tfds_dir(prepared, tmp_path) -> Path:
    data = tmp_path / "tiny_tfds" / "1.0.0"
    shutil.copytree(prepared, data)
    return data


def _load(data: Path, name: str) -> dict:
    return json.loads((data / name).read_text())


def _damage(data: Path, pristine: Path, name: str, text: str | bytes) -> None:
    """``data`` as TFDS prepared it (``pristine``), with file ``name`` replaced by ``text``."""
    for p in data.iterdir():
        if p.name == MANIFEST or p.name.endswith(".idx") or not (pristine / p.name).exists():
            p.unlink()
    for n in ("dataset_info.json", "features.json", "label.labels.txt"):
        shutil.copyfile(pristine / n, data / n)
    (data / name).write_bytes(text if isinstance(text, bytes) else text.encode())


def _only_crossfeed_errors(data: Path) -> CrossfeedError | None:
    """Index ``data``; a refusal must be a `CrossfeedError` and leave no manifest."""
    try:
        index_dataset(data)
    except CrossfeedError as e:
        assert not (data / MANIFEST).exists()
        return e
    return None


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _set(path: tuple, value):
    def mutate(d: dict) -> dict:
        d = copy.deepcopy(d)
        at = d
        for k in path[:-1]:
            at = at[k]
        at[path[-1]] = value
        return d

    return mutate


_F = ("featuresDict", "features")
# (file, mutation of its parsed JSON or the file's raw text): the shapes issue 22 lists, and wrong types
# at every level of both files.
MUTATIONS = {
    "splits a string": ("dataset_info.json", _set(("splits",), "train")),
    "splits a dict": ("dataset_info.json", _set(("splits",), {"name": "train"})),
    "split a list": ("dataset_info.json", _set(("splits", 0), ["train"])),
    "split name an int": ("dataset_info.json", _set(("splits", 0, "name"), 7)),
    "split listed twice": ("dataset_info.json", lambda d: {**d, "splits": [d["splits"][0]] * 2}),
    "shardLengths 'abc'": ("dataset_info.json", _set(("splits", 0, "shardLengths"), "abc")),
    "shardLengths null": ("dataset_info.json", _set(("splits", 0, "shardLengths"), None)),
    "shard length 'abc'": ("dataset_info.json", _set(("splits", 0, "shardLengths", 0), "abc")),
    "shard length '١٢'": ("dataset_info.json", _set(("splits", 0, "shardLengths", 0), "١٢")),
    "shard length -5": ("dataset_info.json", _set(("splits", 0, "shardLengths", 0), "-5")),
    "shard length 2^70": ("dataset_info.json", _set(("splits", 0, "shardLengths", 0), 1 << 70)),
    "shard length true": ("dataset_info.json", _set(("splits", 0, "shardLengths", 0), True)),
    "shard length 8.0": ("dataset_info.json", _set(("splits", 0, "shardLengths", 0), 8.0)),
    "template a list": ("dataset_info.json", _set(("splits", 0, "filepathTemplate"), ["x"])),
    "template ../": ("dataset_info.json", _set(("splits", 0, "filepathTemplate"), "../{SPLIT}-{SHARD_INDEX}")),
    "name an object": ("dataset_info.json", _set(("name",), {"a": 1})),
    "name with NUL": ("dataset_info.json", _set(("name",), "tiny\0tfds")),
    "fileFormat a list": ("dataset_info.json", _set(("fileFormat",), ["tfrecord"])),
    "version nested": ("dataset_info.json", _set(("version",), [[[["1"]]]])),
    "info a list": ("dataset_info.json", lambda d: [d]),
    "info 5000 deep": ("dataset_info.json", lambda d: _deep(5000)),
    "info not UTF-8": ("dataset_info.json", lambda d: b'{"name": "\xff\xfe"}'),
    "features a list": ("features.json", _set((*_F,), [1, 2])),
    "feature a string": ("features.json", _set((*_F, "label"), "ClassLabel")),
    "featuresDict a string": ("features.json", _set(("featuresDict",), "x")),
    "class name an int": ("features.json", _set((*_F, "label", "pythonClassName"), 5)),
    "dims 'x'": ("features.json", _set((*_F, "counts", "tensor", "shape", "dimensions", 0), "x")),
    "dims a string": ("features.json", _set((*_F, "counts", "tensor", "shape", "dimensions"), "3")),
    "dim 2^50": ("features.json", _set((*_F, "counts", "tensor", "shape", "dimensions", 0), str(1 << 50))),
    "dim -7": ("features.json", _set((*_F, "counts", "tensor", "shape", "dimensions", 0), "-7")),
    "40 dims": ("features.json", _set((*_F, "counts", "tensor", "shape", "dimensions"), ["1"] * 40)),
    "shape a list": ("features.json", _set((*_F, "counts", "tensor", "shape"), [3])),
    "tensor a string": ("features.json", _set((*_F, "counts", "tensor"), "int32")),
    "dtype a dict": ("features.json", _set((*_F, "counts", "tensor", "dtype"), {"x": 1})),
    "dtype 'i4,i4'": ("features.json", _set((*_F, "counts", "tensor", "dtype"), "i4,i4")),
    "dtype '(2,)i4'": ("features.json", _set((*_F, "counts", "tensor", "dtype"), "(2,)i4")),
    "encoding an int": ("features.json", _set((*_F, "patch", "tensor", "encoding"), 1)),
    "sequence length 'x'": ("features.json", _set((*_F, "tokens", "sequence", "length"), "x")),
    "sequence a list": ("features.json", _set((*_F, "tokens", "sequence"), [])),
    "image dims 5": ("features.json", _set((*_F, "mask", "image", "shape", "dimensions"), ["1"] * 5)),
    "image dtype an int": ("features.json", _set((*_F, "mask", "image", "dtype"), 8)),
    "label file ../": (
        "features.json",
        lambda d: {**d, **_set((*_F, "../../etc/passwd"), d[_F[0]][_F[1]]["label"])(d)},
    ),
    "features 5000 deep": ("features.json", lambda d: _deep(5000)),
    "FeaturesDict 200 deep": ("features.json", lambda d: _nested_dicts(200)),
    "labels not UTF-8": ("label.labels.txt", lambda d: b"cat\n\xff\xfedog\n"),
}


def _nested_dicts(n: int) -> dict:
    node: dict = {"pythonClassName": "Text", "text": {}}
    for _ in range(n):
        node = {"pythonClassName": "FeaturesDict", "featuresDict": {"features": {"a": node}}}
    return node


def _mutated(pristine: Path, name: str, mutate) -> str | bytes:
    if name.endswith(".txt"):
        return mutate(None)
    out = mutate(_load(pristine, name))
    return out if isinstance(out, (str, bytes)) else json.dumps(out)


@pytest.mark.slow
@needs_tfds
@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_hostile_tfds_json_is_refused_by_index_and_cli(prepared, tfds_dir, case):
    name, mutate = MUTATIONS[case]
    _damage(tfds_dir, prepared, name, _mutated(prepared, name, mutate))
    err = _only_crossfeed_errors(tfds_dir)
    if err is None:  # a damage TFDS itself would read the same way
        (tfds_dir / MANIFEST).unlink()
        result = CliRunner().invoke(app, ["index", str(tfds_dir)])
        assert result.exit_code == 0, result.output
        return
    result = CliRunner().invoke(app, ["index", str(tfds_dir)])
    assert result.exit_code == EXIT_ERROR, (result.exception, result.output)
    assert result.output.count("error:") == 1 and "Traceback" not in result.output, result.output
    assert str(tfds_dir) in str(err) or name in str(err) or "TFDS feature" in str(err), err


@pytest.mark.slow
@needs_tfds
@pytest.mark.parametrize("case", ["shardLengths 'abc'", "features 5000 deep", "labels not UTF-8", "dims 'x'"])
def test_the_real_cli_prints_one_line(prepared, tfds_dir, case):
    name, mutate = MUTATIONS[case]
    _damage(tfds_dir, prepared, name, _mutated(prepared, name, mutate))
    proc = subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", "index", str(tfds_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_ERROR, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert name in lines[0]  # names the file


def _paths(node, at: tuple = ()) -> list[tuple]:
    """Every node of a JSON document, as the key path that reaches it."""
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["abc", "-5", "x", "", "3", "-1", "1e3", "١", "../x", "{SPLIT}", "a/b", "uint64", "Tensor"])
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_DEEP = "\0deep\0"  # stands for arrays nested thousands deep, spliced into the JSON text


@needs_tfds
@FUZZ
@given(
    which=st.sampled_from(["dataset_info.json", "features.json"]),
    pick=st.integers(0, 10**6),
    value=_JSON | st.just(_DEEP),
    depth=st.integers(100, 5000),
)
def test_any_json_node_replaced_by_any_value(prepared, tfds_dir, which, pick, value, depth):
    doc = _load(prepared, which)
    paths = _paths(doc)
    path = paths[pick % len(paths)]
    mutated = value if not path else _set(path, value)(doc)
    text = json.dumps(mutated).replace(json.dumps(_DEEP), _deep(depth))
    _damage(tfds_dir, prepared, which, text)
    _only_crossfeed_errors(tfds_dir)


# ---- Parquet ----------------------------------------------------------------------------------------


def _footer(data: bytes) -> tuple[int, int]:
    n = int.from_bytes(data[-8:-4], "little")
    return len(data) - 8 - n, n


def _varint(v: int) -> bytes:
    z = (v << 1) ^ (v >> 63)
    z &= (1 << 64) - 1
    out = bytearray()
    while True:
        if z < 0x80:
            return bytes(out + bytes([z]))
        out.append((z & 0x7F) | 0x80)
        z >>= 7


def _claiming(path: Path, rows: int) -> None:
    """Rewrite the Thrift footer of ``path`` (row groups of 300 and 7 rows) so that row group 0
    claims ``rows`` rows: its ``num_rows`` field (header 0x16, zigzag varint) is replaced and the
    footer length fixed; pyarrow itself then reads the claim back."""
    data = path.read_bytes()
    start, n = _footer(data)
    footer = data[start : start + n]
    # RowGroup: field 2 total_byte_size (i64), then field 3 num_rows (i64); a column's num_values
    # (also 300) follows its codec, an i32 (header 0x15)
    hits = list(re.finditer(rb"\x16[\x80-\xff]*[\x00-\x7f](\x16" + re.escape(_varint(300)) + b")", footer))
    assert len(hits) == 1, "the row group's num_rows field is not unique in the footer"
    a, b = hits[0].span(1)
    new_footer = footer[:a] + b"\x16" + _varint(rows) + footer[b:]
    path.write_bytes(data[:start] + new_footer + len(new_footer).to_bytes(4, "little") + b"PAR1")
    assert pq.ParquetFile(path).metadata.row_group(0).num_rows == rows  # pyarrow reads the claim


@pytest.mark.parametrize("rows", [-5, -(1 << 40), 1 << 40, (1 << 63) - 1])
def test_a_row_group_claiming_an_impossible_row_count_is_refused(tmp_path, rows):
    root = tmp_path / "pq"
    root.mkdir()
    f = root / "part-0.parquet"
    table = pa.table({"id": pa.array(np.arange(307)), "v": pa.array(np.arange(307) / 3)})
    pq.write_table(table, f, row_group_size=300)
    _claiming(f, rows)
    with pytest.raises(CorruptRecordError, match=r"part-0\.parquet.*row group 0"):
        index_dataset(root)
    assert not (root / MANIFEST).exists()
    result = CliRunner().invoke(app, ["index", str(root)])
    assert result.exit_code == EXIT_ERROR and "row group 0" in result.output, result.output


@pytest.fixture(scope="module")
def pq_bytes(tmp_path_factory) -> bytes:
    (path, _) = write_pyarrow_files(tmp_path_factory.mktemp("pqsrc"))
    return Path(path).read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=4))
def test_byte_mutations_of_a_real_footer_raise_only_crossfeed_errors(tmp_path_factory, pq_bytes, edits):
    root = tmp_path_factory.mktemp("pqfuzz")
    start, n = _footer(pq_bytes)
    data = bytearray(pq_bytes)
    for at, value in edits:
        data[start + at % n] = value
    (root / "part-0.parquet").write_bytes(bytes(data))
    _only_crossfeed_errors(root)
    for p in root.iterdir():
        os.unlink(p)
