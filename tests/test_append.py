"""Growing datasets: shards appended as a new version (`write_dataset(..., append=True)`, `crossfeed
convert --append`). The old version stays readable, byte for byte the same manifest (``path@v1``,
``open_dataset(path, version=1)``), so its stream identity and a state saved under it still hold; a
plan over the new version is a new identity; a reader open during the append is unaffected; a
schema that differs is refused naming the feature; the version chain is parsed strictly."""

from __future__ import annotations

import hashlib
import json
import os
import signal

import numpy as np
import pytest
from recipe_helpers import day, xs
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import ConfigError, ManifestError, SchemaError
from crossfeed.format.manifest import MANIFEST, check_name, loads


@pytest.fixture()
def grown(tmp_path):
    root = str(tmp_path / "ds")
    crossfeed.write_dataset(root, day(0, 12), num_shards=2).close()
    with open(os.path.join(root, MANIFEST), "rb") as f:
        v1 = f.read()
    crossfeed.write_dataset(root, day(100, 5), num_shards=1, append=True).close()
    return root, v1


def test_an_appended_version_keeps_the_old_one_readable_as_it_was(grown):
    root, v1 = grown
    with crossfeed.open_dataset(root) as now, crossfeed.open_dataset(root + "@v1") as old:
        assert now.version == 2 and old.version == 1
        assert xs(now) == list(range(12)) + list(range(100, 105))
        assert xs(old) == list(range(12))
        assert old.manifest_sha256 == hashlib.sha256(v1).hexdigest()  # the same bytes: the same identity
        assert old.path == os.path.abspath(root) + "@v1"
        assert now.manifest.versions == ((1, old.manifest_sha256),)
        stats = now.manifest.splits["train"].statistics["x"]
        assert stats["count"] == 17 and stats["min"] == 0 and stats["max"] == 104
    with crossfeed.open_dataset(root, version=1) as old:
        assert xs(old) == list(range(12))
    crossfeed.write_dataset(root, day(200, 3), append=True).close()  # v3: v1 and v2 both kept
    crossfeed.write_dataset(root, day(300, 2), split="val", add_split=True).close()  # a versioned dataset: v4
    with crossfeed.open_dataset(root) as now:
        assert now.version == 4 and [v for v, _ in now.manifest.versions] == [1, 2, 3]
    assert [xs(crossfeed.open_dataset(f"{root}@v{v}")) for v in (1, 2, 3)] == [
        list(range(12)),
        list(range(12)) + list(range(100, 105)),
        list(range(12)) + list(range(100, 105)) + list(range(200, 203)),
    ]
    with pytest.raises(ConfigError, match="versions 1 to 4"):
        crossfeed.open_dataset(root + "@v9")


def test_a_state_of_the_old_version_resumes_on_it_and_the_new_version_is_another_stream(tmp_path):
    root = str(tmp_path / "ds")
    crossfeed.write_dataset(root, day(0, 12), num_shards=2).close()
    kw = dict(batch_size=3, seed=4)
    with crossfeed.Loader(root, **kw) as loader:
        whole = [b["x"].tolist() for b in loader]
    loader = crossfeed.Loader(root, **kw)
    it = iter(loader)
    head = [next(it)["x"].tolist()]
    crossfeed.write_dataset(root, day(100, 5), append=True).close()  # while the Loader reads
    head += [b["x"].tolist() for b in it]  # unaffected: its version's files all stay
    assert head == whole
    with crossfeed.Loader(root, **kw) as loader:
        it = iter(loader)
        next(it)
        state = json.loads(json.dumps(loader.state_dict()))  # saved on v2
    loader = crossfeed.Loader(root + "@v1", **kw)
    it = iter(loader)
    next(it)
    old_state = json.loads(json.dumps(loader.state_dict()))
    with crossfeed.Loader(root + "@v1", **kw) as again:
        again.load_state_dict(old_state)
        assert [next(iter(again))["x"].tolist()] == whole[1:2]
    with crossfeed.Loader(root + "@v1", **kw) as v1, pytest.raises(ConfigError, match="dataset was dataset"):
        v1.load_state_dict(state)
    assert old_state["identity"]["settings"]["dataset"] != state["identity"]["settings"]["dataset"]


def test_an_append_is_not_a_rewrite_to_an_open_reader_but_an_overwrite_is(tmp_path):
    root = str(tmp_path / "ds")
    crossfeed.write_dataset(root, day(0, 4)).close()
    ds = crossfeed.open_dataset(root)
    crossfeed.write_dataset(root, day(100, 2), append=True).close()
    ds.check_version("a shard")  # the manifest changed, but keeps this version: no error
    assert ds.rewritten("a shard", "gone") is None and xs(ds) == [0, 1, 2, 3]
    crossfeed.write_dataset(root, day(200, 2), overwrite=True).close()
    assert "rewritten while this reader had it open" in str(ds.rewritten("a shard", "gone"))
    ds.close()


def test_a_mixture_combines_versions(grown):
    root, _ = grown
    mix = [crossfeed.Source(root + "@v1", weight=1), crossfeed.Source(root, weight=1)]
    with crossfeed.Loader(mix, batch_size=4, samples_per_epoch=34, return_index=True) as loader:
        got = [(int(s), int(x)) for b in loader for s, x in zip(b["__source__"], b["x"])]
    assert {x for s, x in got if s == 0} <= set(range(12))
    assert {x for s, x in got if s == 1} == set(range(12)) | set(range(100, 105))
    assert sum(1 for s, _ in got if s == 0) == 17


def test_a_different_schema_is_refused_naming_the_feature(grown):
    root, _ = grown
    with pytest.raises(SchemaError, match="cannot append: feature 'x' is int64"):
        crossfeed.write_dataset(root, [{"x": 1.5, "v": np.zeros(2, np.float32)}], append=True)
    with pytest.raises(SchemaError, match="feature 'w' is absent in the dataset"):
        crossfeed.write_dataset(root, [{"x": 1, "v": np.zeros(2, np.float32), "w": 2}], append=True)
    with crossfeed.open_dataset(root) as ds:
        schema = ds.schema
        assert ds.version == 2  # nothing was committed
    crossfeed.write_dataset(root, [{"x": 7, "v": np.ones(2, np.float32)}], schema=schema, append=True).close()
    assert sorted(n for n in os.listdir(root) if n.startswith(".")) == []  # no staged leftovers
    with pytest.raises(ConfigError, match="not with overwrite"):
        crossfeed.write_dataset(root, day(0, 1), append=True, overwrite=True)


def test_the_version_chain_is_parsed_strictly(grown):
    root, _ = grown
    kept = os.path.join(root, "crossfeed.v1.json")
    d = json.load(open(kept))
    d["metadata"] = {"edited": True}
    open(kept, "w").write(json.dumps(d))
    with pytest.raises(ManifestError, match="sha256 is not the one the current manifest pins for version 1"):
        crossfeed.open_dataset(root + "@v1")
    os.unlink(kept)
    with pytest.raises(ManifestError, match="version 1's manifest is missing"):
        crossfeed.open_dataset(root + "@v1")
    text = json.load(open(os.path.join(root, MANIFEST)))
    for edit, says in (
        ({"versions": []}, "lists 0 earlier versions; dataset_version 2 has 1"),
        ({"versions": [{"version": 2, "sha256": "0" * 64}]}, r"versions\[0\].version: expected 1"),
        ({"versions": [{"version": 1, "sha256": "x"}]}, r"versions\[0\].sha256"),
        ({"dataset_version": 0}, "dataset_version: 0 is out of range"),
    ):
        with pytest.raises(ManifestError, match=says):
            loads(json.dumps({**text, **edit}), "m")
    with pytest.raises(ManifestError, match="not a plain file name"):
        check_name("crossfeed.v1.json", "shard")


def test_overwrite_drops_the_history(grown):
    root, _ = grown
    crossfeed.write_dataset(root, day(500, 2), overwrite=True).close()
    assert not os.path.exists(os.path.join(root, "crossfeed.v1.json"))
    with crossfeed.open_dataset(root) as ds:
        assert ds.version == 1 and xs(ds) == [500, 501]
    with pytest.raises(ConfigError, match="no version 2"):
        crossfeed.open_dataset(root + "@v2")


def test_cli_convert_appends_a_version(tmp_path):
    (tmp_path / "d1.csv").write_text("a,b\n1,x\n2,y\n3,z\n")
    (tmp_path / "d2.csv").write_text("a,b\n4,u\n5,v\n")
    (tmp_path / "d3.csv").write_text("a,b\n4.5,u\n")
    out = str(tmp_path / "out")
    run = CliRunner().invoke
    assert run(app, ["convert", "csv", str(tmp_path / "d1.csv"), out]).exit_code == 0
    r = run(app, ["convert", "csv", str(tmp_path / "d2.csv"), out, "--append"])
    assert r.exit_code == 0, r.output
    assert "wrote 2 samples" in r.output
    r = run(app, ["convert", "csv", str(tmp_path / "d3.csv"), out, "--append"])
    assert r.exit_code != 0 and "cannot append: feature 'a' is int64" in r.output, r.output
    with crossfeed.open_dataset(out) as ds, crossfeed.open_dataset(out + "@v1") as v1:
        assert ds.version == 2 and len(ds["train"]) == 5 and len(v1["train"]) == 3
    r = run(app, ["info", out])
    assert "version 2 (earlier versions kept: v1)" in r.output and "5 records" in r.output
    r = run(app, ["info", out + "@v1"])
    assert r.exit_code == 0 and "3 records" in r.output, r.output


@pytest.mark.slow
def test_an_append_killed_at_any_step_leaves_the_old_version_or_the_new(tmp_path):
    """SIGKILL after every step of an append: the dataset opens as version 1 whole or version 2
    whole (and then version 1 too), never a mix; the next append goes through."""
    for k in range(1, 100):
        root = str(tmp_path / f"{k}")
        crossfeed.write_dataset(root, day(0, 6), num_shards=2).close()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ["CROSSFEED_TEST_CRASH_AT"] = str(k)
                crossfeed.write_dataset(root, day(100, 3), num_shards=1, append=True).close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        with crossfeed.open_dataset(root) as ds:
            got = (ds.version, xs(ds))
        assert got in ((1, list(range(6))), (2, list(range(6)) + [100, 101, 102])), (k, got)
        if got[0] == 2:
            assert xs(crossfeed.open_dataset(root + "@v1")) == list(range(6))
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            assert k > 3
            break
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        crossfeed.write_dataset(root, day(200, 2), append=True).close()  # cleans up what the dead one left
        with crossfeed.open_dataset(root) as ds:
            assert xs(ds)[-2:] == [200, 201] and ds.version == got[0] + 1
    else:
        pytest.fail("the writer never finished")
