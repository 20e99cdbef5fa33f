"""The Loader end to end on small generated datasets: values, splits across ranks and workers,
exact and elastic resumption, remote sources, bad records, transforms."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from http_helpers import serving
from loader_helpers import assert_resumes_identically, epoch_batches

import crossfeed
from crossfeed import Feature, Schema
from crossfeed.errors import ConfigError, CorruptRecordError, CrossfeedError
from crossfeed.read.loader import INDEX_KEY, Loader


def _tabular(tmp_path, n=1001, shards=3, name="tab"):
    schema = Schema(
        [
            Feature("id", "int64", (), "int64"),
            Feature("x", "float32", (8,), "float"),
            Feature("t", "int16", (2, 3), "tensor"),
        ]
    )
    rng = np.random.default_rng(0)
    samples = [
        {"id": i, "x": rng.random(8, dtype=np.float32), "t": rng.integers(-999, 999, (2, 3)).astype(np.int16)}
        for i in range(n)
    ]
    root = tmp_path / name
    crossfeed.write_dataset(root, samples, num_shards=shards, schema=schema).close()
    return root, samples


@pytest.fixture
def tabular(tmp_path):
    return _tabular(tmp_path)


def test_batches_hold_the_written_values(tabular):
    root, samples = tabular
    seen = 0
    with Loader(root, batch_size=64, seed=3, return_index=True) as loader:
        assert len(loader) == 16
        for batch in loader:
            assert batch["x"].dtype == np.float32 and batch["t"].dtype == np.int16 and batch["t"].shape[1:] == (2, 3)
            for j, _i in enumerate(batch[INDEX_KEY]):
                s = samples[int(batch["id"][j])]
                np.testing.assert_array_equal(batch["x"][j], s["x"])
                np.testing.assert_array_equal(batch["t"][j], s["t"])
            seen += len(batch["id"])
    assert seen == 1001


def test_len_counts_the_batches_left_and_iter_continues_the_epoch(tabular):
    """The documented semantics (unlike DataLoader, whose len is the whole epoch and whose iter
    restarts it): ``len`` is what the next iteration yields; a broken-off iteration continues
    where it stopped; an iteration that ran to the end moves to the next epoch, whole again."""
    root, _ = tabular
    with Loader(root, batch_size=100, seed=1, return_index=True) as other:
        whole = [b[INDEX_KEY] for b in other]
    with Loader(root, batch_size=100, seed=1, return_index=True) as loader:
        assert len(loader) == 11 and loader.epoch == 0
        it = iter(loader)
        head = [next(it)[INDEX_KEY] for _ in range(4)]
        it.close()
        assert len(loader) == 7 and loader.epoch == 0  # the batches left of epoch 0
        tail = [b[INDEX_KEY] for b in loader]  # a new iter() continues: no sample twice, none missed
        assert [a.tolist() for a in head + tail] == [a.tolist() for a in whole]
        assert len(loader) == 11 and loader.epoch == 1  # the next epoch, whole
        loader.set_epoch(0)  # DataLoader's restart: start an epoch from its beginning
        assert [b[INDEX_KEY].tolist() for b in loader] == [a.tolist() for a in whole]
    ds = crossfeed.open_dataset(root)
    assert len(ds.splits["train"]) == len(ds["train"]) == 1001


def test_generic_path_strings_and_ragged_lists(mixed_dataset):
    root, samples = mixed_dataset
    with Loader(root, batch_size=7, shuffle="none") as loader:
        batches = list(loader)
    labels = np.concatenate([b["label"] for b in batches])
    assert sorted(labels.tolist()) == list(range(30))
    b = batches[0]
    assert b["name"].dtype == object and isinstance(b["name"][0], str)
    assert b["tokens"].dtype == object  # ragged: one array per sample
    for j, label in enumerate(b["label"]):
        assert b["name"][j] == f"sample-{label}"
        np.testing.assert_array_equal(b["tokens"][j], np.arange(label % 4))
        np.testing.assert_array_equal(b["image"][j], samples[label]["image"])


def test_index_of_every_sample_matches_random_access(tabular):
    root, _ = tabular
    split = crossfeed.open_dataset(root)["train"]
    with Loader(root, batch_size=50, shuffle="block", block_shards=2, seed=1, return_index=True) as loader:
        for batch in loader:
            for j, i in enumerate(batch[INDEX_KEY][:5]):
                assert split[int(i)]["id"] == batch["id"][j]


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resumes_identically_from_every_batch(tmp_path, shuffle, world, rank, drop_last):
    root, _ = _tabular(tmp_path, n=203, shards=4)
    assert_resumes_identically(
        root, batch_size=16, shuffle=shuffle, seed=5, rank=rank, world_size=world, drop_last=drop_last
    )


def test_resume_is_o1_and_the_state_is_small(tabular):
    root, _ = tabular
    with Loader(root, batch_size=100, seed=2) as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = loader.state_dict()
    assert state["position"] == 400 and len(repr(state)) < 1000  # its identity included: O(1) in the data
    with Loader(root, batch_size=100, seed=2) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == 7  # only the rest of the epoch is planned (and read)


def test_resume_in_a_new_process(tabular, tmp_path):
    from conftest import run_python

    root, _ = tabular
    with Loader(root, batch_size=64, seed=9, return_index=True) as loader:
        full = [b[INDEX_KEY].tolist() for b in loader]
    code = f"""
        import json, sys
        from crossfeed.read.loader import Loader
        with Loader({str(root)!r}, batch_size=64, seed=9, return_index=True) as l:
            it = iter(l)
            for _ in range(5):
                next(it)
            print(json.dumps(l.state_dict()))
    """
    state = __import__("json").loads(run_python(code).stdout)
    with Loader(root, batch_size=64, seed=9, return_index=True) as loader:
        loader.load_state_dict(state)
        rest = [b[INDEX_KEY].tolist() for b in loader]
    assert rest == full[5:]


def test_ranks_cover_the_epoch_exactly_once(tabular):
    root, _ = tabular
    seen, lengths = [], set()
    for rank in range(7):  # 1001 = 7 * 143: divides
        batches = epoch_batches(root, batch_size=11, seed=4, rank=rank, world_size=7, remainder="drop")
        lengths.add(len(batches))
        seen += np.concatenate(batches).tolist()
    assert lengths == {13} and sorted(seen) == list(range(1001))


def test_uneven_split_fewer_shards_than_ranks_times_workers(tmp_path):
    root, _ = _tabular(tmp_path, n=1001, shards=2)
    steps = set()
    seen = []
    for rank in range(2):
        total = 0
        for w in range(3):
            b = epoch_batches(root, batch_size=32, seed=1, rank=rank, world_size=2, worker=w, num_workers=3)
            total += len(b)
            seen += np.concatenate(b).tolist() if b else []
        steps.add(total)
    assert steps == {16}  # ceil(501 / 32) on each rank
    counts = np.bincount(seen, minlength=1001)
    assert counts.min() == 1 and counts.sum() == 1002  # one sample padded for the odd count


def test_elastic_resume_with_another_world_size(tabular):
    root, _ = tabular
    kw = dict(batch_size=10, seed=8, remainder="drop")
    before = []
    loaders = [Loader(root, rank=r, world_size=2, return_index=True, **kw) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    for _ in range(20):  # 20 lockstep steps on 2 ranks
        for it in its:
            before += next(it)[INDEX_KEY].tolist()
    state = loaders[0].state_dict()  # any one rank's state resumes every rank
    for loader in loaders:
        loader.close()
    after = []
    for r in range(3):
        with Loader(root, rank=r, world_size=3, return_index=True, **kw) as loader:
            loader.load_state_dict(state)
            after += [i for b in loader for i in b[INDEX_KEY].tolist()]
    together = before + after
    assert len(together) == len(set(together)), "no sample repeated"
    assert len(together) >= 1001 - 2, "at most the world-size remainder dropped"


def test_epochs_advance_and_set_epoch_replays(tabular):
    root, _ = tabular
    with Loader(root, batch_size=100, seed=1, return_index=True) as loader:
        e0 = [b[INDEX_KEY].tolist() for b in loader]
        e1 = [b[INDEX_KEY].tolist() for b in loader]
        assert loader.epoch == 2 and e0 != e1
        loader.set_epoch(0)
        assert [b[INDEX_KEY].tolist() for b in loader] == e0


def test_rank_and_world_from_the_environment(tabular, monkeypatch):
    root, _ = tabular
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with Loader(root, batch_size=10) as loader:
        assert (loader.rank, loader.world_size) == (1, 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv(
        "TF_CONFIG", '{"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]}, "task": {"type": "worker", "index": 1}}'
    )
    with Loader(root, batch_size=10) as loader:
        assert (loader.rank, loader.world_size) == (2, 3)


def test_bad_options_are_named(tabular):
    root, _ = tabular
    with pytest.raises(ConfigError, match="shuffle='yes'"):
        Loader(root, batch_size=4, shuffle="yes")
    with pytest.raises(ConfigError, match="features: .*'nope'"):
        Loader(root, batch_size=4, features=["nope"])
    with pytest.raises(ConfigError, match="rank 3"):
        Loader(root, batch_size=4, rank=3, world_size=2)
    with pytest.raises(KeyError, match="no split 'test'"):
        Loader(root, batch_size=4, split="test")


def _flip_byte_of_record(root, shard_file, record, where=20):
    from crossfeed.format.index import read_index

    off, length = read_index(str(root / shard_file) + ".idx")[record]
    at = int(off) + (where if where >= 0 else int(length) + where)
    with open(root / shard_file, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    return int(off)


# length header, length CRC, payload, payload CRC
@pytest.mark.parametrize("where", [2, 9, 20, -2])
def test_corrupt_record_raises_naming_file_and_offset_or_is_skipped(tabular, where):
    root, _ = tabular
    off = _flip_byte_of_record(root, "train-00001-of-00003.tfrecord", 7, where)
    with Loader(root, batch_size=64, shuffle="none") as loader:
        with pytest.raises(CorruptRecordError) as err:
            list(loader)
    assert err.value.path.endswith("train-00001-of-00003.tfrecord") and err.value.offset == off
    with Loader(root, batch_size=64, shuffle="none", on_error="skip", return_index=True) as loader:
        got = np.concatenate([b["id"] for b in loader])
        assert loader.skipped == 1 and len(got) == 1000
    with Loader(root, batch_size=64, on_error="skip", max_skips=0) as loader:
        with pytest.raises(CrossfeedError, match="max_skips"):
            list(loader)


def test_transforms_run_per_sample_and_per_batch(tabular):
    root, _ = tabular

    def per_sample(s):
        return {"id": s["id"], "x2": s["x"] * 2}

    def per_batch(b):
        b["n"] = np.full(len(b["id"]), len(b["id"]))
        return b

    with Loader(root, batch_size=10, features=["id", "x"], transform=per_sample, batch_transform=per_batch) as loader:
        b = next(iter(loader))
    assert set(b) == {"id", "x2", "n"} and b["x2"].shape == (10, 8) and b["n"].tolist() == [10] * 10


def test_jpeg_images_decode_in_the_loader(tmp_path):
    from PIL import Image

    def jpeg(i):
        buf = io.BytesIO()
        Image.fromarray(np.full((16, 12, 3), i * 20, np.uint8)).save(buf, format="JPEG", quality=95)
        return buf.getvalue()

    schema = Schema([Feature("image", "uint8", (None, None, 3), "image"), Feature("label", "int64", (), "int64")])
    crossfeed.write_dataset(
        tmp_path / "img", [{"image": jpeg(i), "label": i} for i in range(10)], schema=schema
    ).close()
    with Loader(tmp_path / "img", batch_size=5, shuffle="none") as loader:
        b = next(iter(loader))
    assert b["image"].shape == (5, 16, 12, 3) and b["image"].dtype == np.uint8
    assert abs(int(b["image"][3].mean()) - int(b["label"][3]) * 20) <= 2


def test_memory_filesystem_source(tabular):
    import fsspec

    root, _ = tabular
    fs = fsspec.filesystem("memory")
    for name in os.listdir(root):
        fs.pipe_file(f"/cfmem/{name}", (root / name).read_bytes())
    local = epoch_batches(root, batch_size=100, seed=3)
    for shuffle in ("global", "block"):
        remote = epoch_batches("memory://cfmem", batch_size=100, seed=3, shuffle=shuffle)
        if shuffle == "global":
            assert [a.tolist() for a in remote] == [a.tolist() for a in local]
        assert sorted(np.concatenate(remote).tolist()) == list(range(1001))


@pytest.mark.slow
def test_http_source_with_range_reads(tabular):
    pytest.importorskip("aiohttp")
    root, samples = tabular
    with serving(root) as url:
        with Loader(url, batch_size=128, seed=6, shuffle="global") as loader:  # record-by-record range reads
            ids = np.concatenate([b["id"] for b in loader])
        assert sorted(ids.tolist()) == list(range(1001))
        with Loader(url, batch_size=128, seed=6, shuffle="block", return_index=True) as loader:  # whole shards
            b = next(iter(loader))
        for j, _i in enumerate(b[INDEX_KEY][:10]):
            np.testing.assert_array_equal(b["x"][j], samples[int(b["id"][j])]["x"])
