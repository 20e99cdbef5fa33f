"""Lengths files (`crossfeed.format.lengths`) and the manifest fields that pin them."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from crossfeed.errors import IndexFileError, ManifestError
from crossfeed.format.lengths import checked_lengths, format_lengths
from crossfeed.format.manifest import Manifest, ShardInfo


def _manifest(lengths, sha):
    return {
        "format": "crossfeed.read.dataset",
        "version": 1,
        "schema": [{"name": "tokens", "dtype": "int64", "shape": [None], "encoding": "int64"}],
        "splits": {
            "train": {
                "shards": [
                    {"file": "a.tfrecord", "num_records": 3, "num_bytes": 100, "sha256": "0" * 64}
                    | ({"lengths_sha256": sha} if sha else {})
                ]
            }
        },
        **({"lengths": lengths} if lengths is not None else {}),
    }


def test_a_lengths_file_round_trips_and_is_checked():
    data = format_lengths(np.array([5, 0, 70000]))
    shard = ShardInfo("a.tfrecord", 3, 100, "0" * 64, lengths_sha256=hashlib.sha256(data).hexdigest())
    got = checked_lengths(data, "a.tfrecord.len", shard, 1)
    assert got[:, 0].tolist() == [5, 0, 70000] and not got.flags.writeable
    with pytest.raises(IndexFileError, match="a.tfrecord.len: 8 bytes, expected 12"):
        checked_lengths(data[:8], "a.tfrecord.len", shard, 1)
    flipped = data[:4] + bytes([data[4] ^ 1]) + data[5:]
    with pytest.raises(IndexFileError, match="lengths_sha256"):
        checked_lengths(flipped, "a.tfrecord.len", shard, 1)


def test_the_manifest_lists_lengths_features_and_pins_every_file():
    data = format_lengths([1, 2, 3])
    sha = hashlib.sha256(data).hexdigest()
    m = Manifest.from_json(_manifest(["tokens"], sha), "m")
    assert m.lengths == ("tokens",) and m.splits["train"].shards[0].lengths_sha256 == sha
    assert "a.tfrecord.len" in m.files
    assert Manifest.from_json(json.loads(m.dumps()), "m") == m
    for bad, match in (
        (_manifest(["nope"], sha), "lengths\\[0\\]"),
        (_manifest(["tokens"], None), "every shard needs a lengths_sha256"),
        (_manifest(None, sha), "lists no lengths features"),
        (_manifest("tokens", sha), "expected a list"),
    ):
        with pytest.raises(ManifestError, match=match):
            Manifest.from_json(bad, "m")
