"""`write_dataset` writes lengths files in the same pass: a given schema's raw variable-length
tensors by default, any named features with ``lengths=``; a split added to a dataset follows the
dataset's; packing plans from them with no second pass."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.format.lengths import lengths_path
from crossfeed.format.manifest import MANIFEST
from crossfeed.format.schema import Encoding, Feature, Schema

TOKENS = Schema([Feature("tokens", "uint32", (None,), Encoding.TENSOR), Feature("label", "int64", (), Encoding.INT64)])


def _lengths(root) -> tuple[list, list[np.ndarray]]:
    with open(os.path.join(root, MANIFEST)) as f:
        m = json.load(f)
    paths = [lengths_path(os.path.join(root, sh["file"])) for sp in m["splits"].values() for sh in sp["shards"]]
    return m.get("lengths", []), [np.fromfile(p, "<u4") for p in paths if os.path.exists(p)]


@pytest.mark.parametrize("shards", [{"num_shards": 3}, {"shard_size": 200}])
def test_a_token_schema_gets_its_lengths_files_in_the_same_pass(tmp_path, shards):
    lens = [5, 0, 17, 3, 40, 1, 9]
    docs = [{"tokens": np.arange(n, dtype=np.uint32), "label": i} for i, n in enumerate(lens)]
    crossfeed.write_dataset(tmp_path / "d", docs, schema=TOKENS, **shards).close()
    listed, files = _lengths(tmp_path / "d")
    assert listed == ["tokens"] and len(files) > 1
    with crossfeed.open_dataset(tmp_path / "d") as ds:  # record order, shard by shard
        got = [len(r["tokens"]) for r in ds["train"]]
    assert np.concatenate(files).tolist() == got and sorted(got) == sorted(lens)
    with crossfeed.Loader(tmp_path / "d", batch_size=2, pack=crossfeed.Pack(16, split="rows")) as ld:
        assert sum(int((b["segment_ids"] > 0).sum()) for b in ld) == sum(lens)


def test_inferred_lists_get_lengths_only_when_named_and_added_splits_follow(tmp_path):
    docs = [{"tokens": list(range(n)), "label": n} for n in (4, 2, 7)]
    crossfeed.write_dataset(tmp_path / "a", docs, num_shards=2).close()
    assert _lengths(tmp_path / "a") == ([], [])
    crossfeed.write_dataset(tmp_path / "b", docs, num_shards=2, lengths=("tokens",)).close()
    listed, files = _lengths(tmp_path / "b")
    assert listed == ["tokens"] and sorted(np.concatenate(files).tolist()) == [2, 4, 7]
    crossfeed.write_dataset(tmp_path / "b", docs[:2], split="test", add_split=True).close()
    assert _lengths(tmp_path / "b")[0] == ["tokens"]
    with pytest.raises(ConfigError, match="'nope'"):
        crossfeed.write_dataset(tmp_path / "c", docs, lengths=("nope",))
