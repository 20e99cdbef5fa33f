"""The Grain adapter end to end: Grain's own pipelines (``MapDataset.source`` with a global
shuffle, thread reads with batching, the classic ``DataLoader`` with an ``IndexSampler`` and two
worker processes) read a crossfeed TFRecord dataset, a tar-adopted and a Parquet-adopted one and
give, record key by record key, exactly the values the crossfeed Loader gives for those ids; a
mixture's keys run over its sources in order and `mix` weighs them; a corrupt record raises
through Grain, naming its shard."""

from __future__ import annotations

import io
import pickle
import tarfile

import numpy as np
import pytest
from adopt_helpers import trusted_roots  # noqa: F401  (autouse: the temporary roots are allowed)
from conftest import lazy_import
from parquet_data import png, write_pyarrow_files

import crossfeed
from crossfeed import Source
from crossfeed.errors import ConfigError, CorruptRecordError
from crossfeed.format.index import read_index
from crossfeed.format.schema import INDEX_KEY, SOURCE_KEY
from crossfeed.read.loader import Loader
from crossfeed.write.adopt.index import index_dataset

grain = lazy_import("grain")
cfgrain = lazy_import("crossfeed.adapters.grain")
pytestmark = pytest.mark.slow  # Grain and JAX imported, worker processes

N_TAB = 301


def _write_tabular(root, n=N_TAB, prefix="row"):
    rng = np.random.default_rng(0)
    samples = [
        {
            "id": i,
            "x": rng.random(32, dtype=np.float32),
            "pixels": rng.integers(0, 256, (4, 5, 3), dtype=np.uint8),
            "name": f"{prefix} {i}",
            "tokens": list(range(i % 5)),
        }
        for i in range(n)
    ]
    crossfeed.write_dataset(root, samples, num_shards=3).close()
    return root


@pytest.fixture
def tabular(tmp_path):
    return _write_tabular(tmp_path / "tab")


@pytest.fixture
def dense(tmp_path):
    """Fixed-shape numbers only: the Loader's columnar (rows) path."""
    rng = np.random.default_rng(1)
    samples = [{"id": i, "x": rng.random(32, dtype=np.float32)} for i in range(N_TAB)]
    crossfeed.write_dataset(tmp_path / "dense", samples, num_shards=3).close()
    return tmp_path / "dense"


@pytest.fixture
def tar_dir(tmp_path):
    """Two plain tars of PNG photos and labels, adopted in place (`crossfeed index`)."""
    root = tmp_path / "tars"
    root.mkdir()
    for t in range(2):
        with tarfile.open(root / f"data-{t}.tar", "w") as f:
            for i in range(t * 7, t * 7 + 7):
                for name, payload in ((f"s{i:04d}.png", png(i * 9)), (f"s{i:04d}.cls", str(i).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    f.addfile(info, io.BytesIO(payload))
    index_dataset(root)
    return root


@pytest.fixture
def parquet_dir(tmp_path):
    root = tmp_path / "pq"
    write_pyarrow_files(root)
    index_dataset(root)
    return root


def _by_id(source, **fields) -> dict:
    """What the crossfeed Loader gives for each record: ``{id (or (source, id)): sample}``."""
    out = {}
    with Loader(source, batch_size=7, shuffle="none", return_index=True, **fields) as loader:
        for b in loader:
            for j, i in enumerate(b[INDEX_KEY].tolist()):
                key = (int(b[SOURCE_KEY][j]), i) if SOURCE_KEY in b else i
                out[key] = {k: v[j] for k, v in b.items() if k not in (INDEX_KEY, SOURCE_KEY)}
    return out


def _assert_same(got: dict, want: dict, where) -> None:
    assert sorted(got) == sorted(want), where
    for k, w in want.items():
        g = got[k]
        if isinstance(w, np.ndarray) and w.dtype != object or isinstance(w, np.generic):
            assert isinstance(g, np.ndarray) and g.dtype == np.asarray(w).dtype, (where, k, type(g))
            np.testing.assert_array_equal(g, w, err_msg=f"{where} {k}")
        elif isinstance(w, np.ndarray):
            assert np.array_equal(np.asarray(g), w), (where, k)
        else:
            assert type(g) is type(w) and g == w, (where, k, g, w)


def _keys_after_shuffle(n: int, seed: int) -> list[int]:
    """The record keys Grain's global shuffle visits, in order (its own permutation of range(n))."""
    return [int(k) for k in grain.MapDataset.range(n).shuffle(seed=seed)]


@pytest.mark.parametrize("kind", ["tfrecord", "dense", "tar", "parquet"])
def test_shuffled_map_dataset_gives_the_loaders_values_by_id(kind, tabular, dense, tar_dir, parquet_dir):
    root = {"tfrecord": tabular, "dense": dense, "tar": tar_dir, "parquet": parquet_dir}[kind]
    want = _by_id(root)
    src = cfgrain.GrainSource(root)
    assert len(src) == len(want)
    ds = grain.MapDataset.source(src).shuffle(seed=5)
    keys = _keys_after_shuffle(len(src), 5)
    assert sorted(keys) == list(range(len(src))) and keys != sorted(keys)
    for pos, sample in enumerate(ds):
        _assert_same(sample, want[keys[pos]], (kind, keys[pos]))


@pytest.mark.parametrize("kind", ["tfrecord", "dense", "parquet"])
def test_batched_reads_in_threads_give_the_loaders_values(kind, tabular, dense, parquet_dir):
    """``batch`` after ``to_iter_dataset``: Grain's reader threads; ``_getitems``: the batched read."""
    root = {"tfrecord": tabular, "dense": dense, "parquet": parquet_dir}[kind]
    want = _by_id(root)
    src = cfgrain.GrainSource(root, features=["id", "x"] if kind != "parquet" else ["id", "vec", "mat"])
    ds = grain.MapDataset.source(src).shuffle(seed=1).to_iter_dataset(grain.ReadOptions(num_threads=4)).batch(16)
    keys = iter(_keys_after_shuffle(len(src), 1))
    seen = 0
    for b in ds:
        for j in range(len(b["id"])):
            k = next(keys)
            _assert_same({n: np.asarray(b[n][j]) for n in b}, {n: want[k][n] for n in b}, (kind, k))
            seen += 1
    assert seen == len(src)
    some = [9, 0, 9, len(src) - 1, 3]  # repeated and unordered keys, one batched read
    for k, sample in zip(some, src._getitems(some)):
        _assert_same(sample, {n: want[k][n] for n in sample}, (kind, "getitems", k))


@pytest.fixture
def absl_flags():
    """Grain's worker processes read absl flags, parsed by ``absl.app.run`` in a program; here by hand."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def test_dataloader_with_two_worker_processes(dense, absl_flags):
    """The classic API: the source pickled to two Grain worker processes, read in the sampler's order."""
    want = _by_id(dense)
    src = cfgrain.GrainSource(dense)
    sampler = grain.samplers.IndexSampler(
        len(src), shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=3
    )
    loader = grain.DataLoader(
        data_source=src,
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size=32)],
        worker_count=2,
    )
    got = [b for b in loader]
    ids = np.concatenate([b["id"] for b in got])
    key_of = {int(w["id"]): k for k, w in want.items()}
    assert sorted(ids.tolist()) == sorted(key_of) and len(got) == -(-len(src) // 32)  # each record once
    x = np.concatenate([b["x"] for b in got])
    np.testing.assert_array_equal(x, np.stack([want[key_of[i]]["x"] for i in ids.tolist()]))
    # each worker reads every second record of the sampler's order, 32 to a batch, batches taken in turn
    first = [sampler[i].record_key for i in range(0, 64, 2)]
    assert got[0]["id"].tolist() == [int(want[k]["id"]) for k in first]


def test_pickled_source_reopens_in_its_process(tabular):
    src = cfgrain.GrainSource(tabular)
    first = src[4]
    state = pickle.dumps(src)
    assert len(state) < 4096  # the source and options, never open shards
    again = pickle.loads(state)
    assert again._pipeline is None and len(again) == len(src)
    _assert_same(again[4], first, "pickled")


def test_mixture_keys_run_over_the_sources_in_order_and_mix_weighs_them(tabular, tar_dir, tmp_path):
    other = _write_tabular(tmp_path / "other", n=40, prefix="other")
    sources = [Source(tabular, weight=3), Source(other, weight=1)]
    alone = [_by_id(tabular, features=["id", "x", "name"]), _by_id(other, features=["id", "x", "name"])]
    src = cfgrain.GrainSource(sources, features=["id", "x", "name"])
    assert src.starts.tolist() == [0, N_TAB, N_TAB + 40] and len(src) == N_TAB + 40
    for key in range(len(src)):  # key = source 0's records, then source 1's: each as that source alone gives it
        s = src.source_of(key)
        assert s == (key >= N_TAB)
        _assert_same(src[key], alone[s][key - int(src.starts[s])], key)
    assert src.where(N_TAB).startswith("source 1: ")
    names = [str(m["name"]) for m in cfgrain.mix(src, seed=0)]
    # Grain's mix, 3:1, stops when the 40 records of weight 1 are used up: 120 + 40 records
    assert len(names) == 160 and sum(n.startswith("other") for n in names) == 40
    ours = {f"row {i}" for i in range(N_TAB)} | {f"other {i}" for i in range(40)}
    assert set(names) <= ours and len(set(names)) == 160  # each record at most once
    assert [n.split()[0] for n in names[:8]] != ["row"] * 8  # interleaved, not concatenated
    with pytest.raises(ConfigError, match="2 sources"):
        cfgrain.mix(src, weights=[1.0])
    with pytest.raises(ConfigError, match="not a mixture"):
        cfgrain.mix(cfgrain.GrainSource(tabular))
    # a tar source beside a TFRecord one: each decoded by its own reader, merged under one name
    tar_mix = cfgrain.GrainSource([Source(tar_dir, rename={"cls": "label"}), Source(other, rename={"id": "label"})])
    assert [int(tar_mix[k]["label"]) for k in (0, 13, 14, 15)] == [0, 13, *(int(alone[1][k]["id"]) for k in (0, 1))]


@pytest.mark.parametrize("kind", ["dense", "tfrecord"])  # one record read directly; one as a one-record batch
def test_corrupt_record_raises_through_grain_naming_the_shard(kind, dense, tabular):
    dense = {"dense": dense, "tfrecord": tabular}[kind]
    want = _by_id(dense)
    shard = "train-00001-of-00003.tfrecord"
    off, length = read_index(str(dense / shard) + ".idx")[5]
    with open(dense / shard, "r+b") as f:  # a payload byte of the shard's sixth record
        f.seek(int(off) + 20)
        b = f.read(1)
        f.seek(int(off) + 20)
        f.write(bytes([b[0] ^ 0xFF]))
    src = cfgrain.GrainSource(dense)
    bad = int(src._open().split.starts[1]) + 5
    with pytest.raises(CorruptRecordError) as err:
        grain.MapDataset.source(src)[bad]
    assert err.value.path.endswith(shard) and err.value.offset == int(off)
    ds = grain.MapDataset.source(src).to_iter_dataset(grain.ReadOptions(num_threads=2))
    with pytest.raises(CorruptRecordError, match=shard):
        list(ds)
    _assert_same(src[bad - 1], want[bad - 1], "the record before it")  # only the bad record fails


def test_options_are_reading_options_only(tabular):
    with pytest.raises(ConfigError, match="shuffle"):
        cfgrain.GrainSource(tabular, shuffle="global")
    with pytest.raises(ConfigError, match="batch_size"):
        cfgrain.GrainSource(tabular, batch_size=8)
    with pytest.raises(ConfigError, match="'nope'"):
        cfgrain.GrainSource(tabular, features=["nope"])
    src = cfgrain.GrainSource(tabular, features=["id"])
    assert set(src[0]) == {"id"}
    with pytest.raises(IndexError, match="outside"):
        src[len(src)]
