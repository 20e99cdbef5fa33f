"""Nothing silent: a state carries its stream's identity and a resume under anything that decides
the stream differently is refused by name; what the plan can re-split (world size, workers,
threads, executor, batch size) changes freely and the two runs together are exactly the epoch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from token_data import repin_lengths, write_tokens

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.identity import StreamIdentity

N = 60


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ident")
    a, b = root / "a", root / "b"
    crossfeed.write_dataset(a, [{"x": np.full(2, i, np.float32), "y": i} for i in range(N)], num_shards=3).close()
    crossfeed.write_dataset(
        b, [{"x": np.full(2, -i, np.float32), "y": 100 + i} for i in range(N)], num_shards=3
    ).close()
    tok = write_tokens(root / "tok", [5, 17, 3, 9, 30, 2, 11, 8, 6, 21, 4, 13] * 3)
    return {"a": str(a), "b": str(b), "tok": tok}


def _state(source, skip=2, **kw):
    with crossfeed.Loader(source, **kw) as loader:
        it = iter(loader)
        for _ in range(skip):
            next(it)
        return json.loads(json.dumps(loader.state_dict()))  # as a checkpoint keeps it


BASE = dict(batch_size=4, seed=1)
# (what changes, the setting named in the refusal)
REFUSED = [
    ({"seed": 2}, "seed was 1, is 2"),
    ({"shuffle": "block"}, "shuffle was 'global', is 'block'"),
    ({"shuffle": "none"}, "shuffle was 'global', is 'none'"),
    ({"drop_last": True}, "drop last was False, is True"),
    ({"remainder": "drop"}, "remainder was 'pad', is 'drop'"),
    ({"block_shards": 2}, "block shards was 4, is 2"),
    ({"features": ["y"]}, "features was ['x', 'y'], is ['y']"),
    ({"decode_images": False}, "decode images was True, is False"),
]


@pytest.mark.parametrize("change,named", REFUSED, ids=[n.split(" was")[0] for _, n in REFUSED])
def test_a_changed_setting_is_refused_by_name(data, change, named):
    state = _state(data["a"], **BASE)
    with crossfeed.Loader(data["a"], **{**BASE, **change}) as loader:
        with pytest.raises(ConfigError, match="belongs to another stream") as e:
            loader.load_state_dict(state)
        assert named in str(e.value)


def test_another_dataset_of_the_same_size_is_refused(data):
    state = _state(data["a"], **BASE)
    with crossfeed.Loader(data["b"], **BASE) as loader, pytest.raises(ConfigError, match="dataset was dataset"):
        loader.load_state_dict(state)


PACKS = [
    (dict(pack=crossfeed.Pack(length=32)), dict(pack=crossfeed.Pack(length=64)), "pack length was 32, is 64"),
    (dict(pack=crossfeed.Pack(length=32)), dict(pack=crossfeed.Pack(length=16)), "pack length was 32, is 16"),
    (
        dict(pack=crossfeed.Pack(length=32)),
        dict(pack=crossfeed.Pack(length=32, split="rows")),
        "pack split was 'documents', is 'rows'",
    ),
    (dict(pack=crossfeed.Pack(length=32)), dict(pack=crossfeed.Pack(length=32, bins=4)), "pack bins was 32, is 4"),
    (dict(pack=crossfeed.Pack(length=32)), {}, "pack length was 32, is None"),
    ({}, dict(pack=crossfeed.Pack(length=32)), "pack length was None, is 32"),
    (dict(pack=crossfeed.Pack(length=32)), dict(pack=crossfeed.Pack(length=32, pad_id=7)), "pack pad id was 0"),
]


@pytest.mark.parametrize("saved,now,named", PACKS, ids=[n.split(",")[0] for *_, n in PACKS])
def test_packing_changed_on_resume_is_refused_by_name(data, saved, now, named):
    kw = dict(batch_size=2, seed=3)
    state = _state(data["tok"], skip=1, **kw, **saved)
    with crossfeed.Loader(data["tok"], **kw, **now) as loader, pytest.raises(ConfigError) as e:
        loader.load_state_dict(state)
    assert named in str(e.value)


@pytest.mark.parametrize(
    "change",
    [{"world_size": 2, "rank": 0}, {"num_threads": 0}, {"num_threads": 3, "prefetch": 5}, {"batch_size": 7}],
    ids=["world", "threads0", "threads3", "batch"],
)
def test_free_settings_resume_to_exactly_the_epoch(data, change):
    """Saved after 2 batches of 4 at world 1; resumed under the change: every sample once."""
    with crossfeed.Loader(data["a"], **BASE, return_index=True) as loader:
        it = iter(loader)
        first = [next(it)["__index__"].tolist() for _ in range(2)]
        state = json.loads(json.dumps(loader.state_dict()))
    world = change.get("world_size", 1)
    rest = []
    for rank in range(world):
        opts = {**BASE, **change, "rank": rank} if world > 1 else {**BASE, **change}
        with crossfeed.Loader(data["a"], **opts, return_index=True) as loader:
            loader.load_state_dict(state)
            rest += [b["__index__"].tolist() for b in loader]
    seen = sorted(i for b in first + rest for i in b)
    assert seen == list(range(N))


def test_next_epoch_override_starts_the_next_epoch_with_the_new_setting(data):
    state = _state(data["a"], **BASE)
    with crossfeed.Loader(data["a"], batch_size=4, seed=2) as loader:
        loader.load_state_dict(state, on_change="next_epoch")
        assert loader.epoch == 1 and loader.position == 0
        assert sum(len(b["y"]) for b in loader) == N
    with crossfeed.Loader(data["a"], **BASE) as loader, pytest.raises(ConfigError, match="on_change"):
        loader.load_state_dict(state, on_change="maybe")


def test_the_identity_is_the_same_in_every_process_and_names_content_not_paths(data, tmp_path):
    import shutil
    import subprocess
    import sys

    with crossfeed.Loader(data["a"], **BASE) as loader:
        here = loader.state_dict()["identity"]
    copy = tmp_path / "copy"
    shutil.copytree(data["a"], copy)
    code = (
        "import json, crossfeed; "
        f"l = crossfeed.Loader({str(copy)!r}, batch_size=4, seed=1); print(json.dumps(l.state_dict()['identity']))"
    )
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout)
    assert there == here and len(here["fingerprint"]) == 16


def test_a_tampered_identity_is_refused_not_trusted(data):
    state = _state(data["a"], **BASE)
    bad = json.loads(json.dumps(state))
    bad["identity"]["settings"]["seed"] = 9  # the fingerprint no longer matches
    with crossfeed.Loader(data["a"], **BASE) as loader:
        with pytest.raises(ConfigError, match="does not match its settings"):
            loader.load_state_dict(bad)
        for junk in (None, 3, {"version": 1}, {"version": 1, "fingerprint": "x", "settings": {"a": {"b": 1}}}):
            bad["identity"] = junk
            with pytest.raises(ConfigError):
                loader.load_state_dict(bad)


def test_a_version_one_state_is_still_read(data, caplog):
    state = _state(data["a"], **BASE)
    old = {k: v for k, v in state.items() if k != "identity"} | {"version": 1}
    with crossfeed.Loader(data["a"], **BASE) as loader:
        loader.load_state_dict(old)
        assert loader.position == state["position"]
    assert "carries no stream identity" in caplog.text


def test_identity_differences_read_as_sentences():
    a = StreamIdentity({"pack length": 256, "seed": 0})
    b = StreamIdentity({"pack length": 512, "seed": 0, "batch by tokens": 9})
    assert a.differences(b) == ["batch by tokens was unset, is 9", "pack length was 256, is 512"]
    assert StreamIdentity.from_json(a.to_json()) == a


def test_a_dataset_rewritten_under_the_same_names_is_an_error_not_a_mix(tmp_path):
    """rm the dataset and write a fresh one there (the plain shard names, sizes and index files
    come back identical; only the values differ): a Loader that had the old one open stops with
    an error naming the shard, never mixing versions."""
    import shutil

    from crossfeed.errors import DatasetRewrittenError

    def write(path, base):
        samples = [{"x": np.full(4, base + i, np.float32)} for i in range(64)]
        crossfeed.write_dataset(path, samples, num_shards=4).close()

    path = tmp_path / "d"
    write(path, 0)
    with crossfeed.Loader(str(path), batch_size=8, shuffle="none") as loader:
        it = iter(loader)
        assert next(it)["x"].max() < 64
        shutil.rmtree(path)
        write(path, 1000)
        with pytest.raises(DatasetRewrittenError, match=r"\.tfrecord.*another version.*rewritten"):
            for batch in it:
                assert batch["x"].max() < 64, "a batch of the new version"


def test_verify_names_a_lengths_file_that_lies_even_when_it_is_pinned(tmp_path):
    """A lengths file saying 0 for documents that hold tokens (re-pinned in the manifest) makes
    packing drop them: `verify` reads every record and names each one that disagrees."""

    from crossfeed.read.tools.verify import verify_dataset

    root = write_tokens(tmp_path / "t", [5, 6, 7, 8], num_shards=1)
    assert verify_dataset(root) == []
    name = repin_lengths(root, [5, 0, 7, 0])
    problems = [str(p) for p in verify_dataset(root)]
    assert len(problems) == 2, problems
    assert "record 1" in problems[0] and "holds 6 values of 'tokens', its lengths file says 0" in problems[0]
    assert name + ".len" in problems[0]


def test_the_loader_refuses_a_lengths_file_that_says_documents_are_empty(tmp_path):
    """Documents said to hold 0 tokens fill no row, so the plan never reads them: the Loader
    reads them when it loads the lengths file and names the lie."""

    from crossfeed.errors import IndexFileError

    root = write_tokens(tmp_path / "t", [5, 6, 7, 8], num_shards=1)
    repin_lengths(root, [5, 0, 7, 8])
    with crossfeed.Loader(root, batch_size=2, pack=crossfeed.Pack(length=16)) as loader:
        with pytest.raises(IndexFileError, match=r"entry 1 says record 1 of .* holds no 'tokens' values; it holds 6"):
            list(loader)
