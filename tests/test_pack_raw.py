"""Packed batches on the fast path (`crossfeed.read.stages.tokens`): token records stored as raw
tensors are checked a whole shard at a time and sliced straight out of the shards. Every property
of tests/test_pack.py holds there too (its tests run again here on raw records), the fast path
is the one taken, and what it must refuse goes the general way: a corrupt record is named (or
skipped), a lengths file that lies is named, another layout is read by the decoder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import token_data
from test_pack import *  # noqa: F403  (every packing property, again on raw records)
from test_pack import every_token, same, tokens_of
from token_data import write_tokens

import crossfeed
from crossfeed.errors import CorruptRecordError
from crossfeed.format.schema import Encoding, Feature, Schema
from crossfeed.read.options import Pack
from crossfeed.read.stages.tokens import RecordModel, TokenShards


@pytest.fixture(autouse=True)
def _raw_records(monkeypatch):
    monkeypatch.setattr(token_data, "RAW", True)


def _shards(loader) -> TokenShards | None:
    got = loader.pipeline.builder._shards
    return got if isinstance(got, TokenShards) else None


LENS = [5, 40, 1, 17, 3, 90, 12, 33, 7, 64, 2, 25]


@pytest.mark.parametrize("split", ["rows", "documents"])
def test_raw_records_take_the_fast_path_and_give_the_general_paths_rows(tmp_path, split):
    raw = write_tokens(tmp_path / "raw", LENS, num_shards=3)
    token_data.RAW = False
    listed = write_tokens(tmp_path / "list", LENS, num_shards=3)
    token_data.RAW = True
    opts = dict(batch_size=3, seed=4, pack=Pack(24, split=split, bins=3))
    with crossfeed.Loader(listed, **opts) as ld:
        want = list(ld)
        assert _shards(ld) is None  # int64 lists: the decoder's way
    with crossfeed.Loader(raw, **opts) as ld:
        got = list(ld)
        shards = _shards(ld)
        assert shards is not None and (shards._table[:, 0] >= 0).all()  # every record's block checked and sliced
    assert same(got, want)
    assert np.sort(tokens_of(got)).tolist() == every_token(LENS).tolist()


def _flip_a_value_byte(path, offset, length) -> None:
    """One byte in the middle of the payload of the record at ``offset`` (a value byte) flipped."""
    with open(path, "r+b") as f:
        f.seek(int(offset) + 12 + (int(length) - 16) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_raw_record_is_named_or_skipped(tmp_path):
    root = write_tokens(tmp_path / "t", [6, 7, 8], num_shards=1)
    with crossfeed.open_dataset(root) as ds:
        sp = ds["train"]
        path, (offset, length) = sp.file(0).path, sp.index(0)[1]
    _flip_a_value_byte(path, offset, length)  # of document 1: its payload CRC no longer matches
    with crossfeed.Loader(root, batch_size=2, shuffle="none", pack=Pack(16)) as ld:
        with pytest.raises(CorruptRecordError) as e:
            list(ld)
        assert str(int(offset)) in str(e.value)
        assert (_shards(ld)._table[:, 0] == -2).all()  # its block failed its check: never sliced
    with crossfeed.Loader(root, batch_size=2, shuffle="none", pack=Pack(16), on_error="skip") as ld:
        got = list(ld)
    docs = {int(d) for d in (tokens_of(got) >> 20) & ((1 << 20) - 1)}
    assert docs == {0, 2}  # the bad document's tokens are padding, the others all there


@pytest.mark.parametrize(
    ("features", "fits"),
    [
        ([Feature("tokens", "uint32", (None,), Encoding.TENSOR)], True),
        (
            [Feature("tokens", "uint16", (None,), Encoding.TENSOR), Feature("mask", "uint8", (None,), Encoding.TENSOR)],
            True,
        ),
        ([Feature("tokens", "int64", (None,), Encoding.INT64)], False),  # varints: no fixed layout
    ],
)
def test_the_record_model_fits_raw_tensors_only_and_rebuilds_the_encoders_bytes(features, fits):
    from crossfeed.format.encode import encoder_for

    schema = Schema(features)
    model = RecordModel.of(schema, list(schema.names))
    assert (model is not None) == fits
    if model is not None:
        for n in (0, 9, 300, 20_000):
            values = {f.name: np.arange(n).astype(f.dtype) for f in features}
            marks = [
                values[name].astype(np.dtype(schema[name].dtype).newbyteorder("<")).tobytes() for name in schema.names
            ]
            assert model.build(n, marks) == bytes(encoder_for(schema).encode(values))
    assert RecordModel.of(schema, [features[0].name, "other"]) is None  # the schema must be exactly the packed features


def test_records_with_a_document_id_beside_the_tokens_take_the_fast_path(tmp_path):
    """`crossfeed convert text`'s layout: a string id per document (of any length) before the tokens."""
    schema = Schema([Feature("tokens", "int64", (None,), Encoding.TENSOR), Feature("id", "string", (), Encoding.BYTES)])
    docs = token_data.documents(LENS)
    for d, doc in enumerate(docs):
        doc["id"] = f"doc-{d}-" + "x" * (d * 37)  # ids of 6 to 400+ bytes: one- and two-byte length prefixes
    crossfeed.write_dataset(tmp_path / "ids", docs, num_shards=2, schema=schema).close()
    token_data.RAW = False
    listed = write_tokens(tmp_path / "list", LENS, num_shards=2)
    opts = dict(batch_size=2, seed=1, pack=Pack(32, split="rows"))
    with crossfeed.Loader(listed, **opts) as ld:
        want = list(ld)
    with crossfeed.Loader(tmp_path / "ids", **opts) as ld:
        got = list(ld)
        shards = _shards(ld)
        assert shards is not None and shards.model.prefix == [b"\n\x02id"]
        assert (shards._table[:, 0] >= 0).all()
    assert same(got, want)


def _manifest(root):
    import json

    from crossfeed.format.manifest import MANIFEST

    path = root / MANIFEST if hasattr(root, "joinpath") else os.path.join(root, MANIFEST)
    with open(path) as f:
        return path, json.load(f)


def _count_payload_checks(monkeypatch) -> list[int]:
    from crossfeed.read.stages import tokens

    seen = [0]
    real = tokens.bad_payloads

    def counted(payloads, stored):
        seen[0] += len(payloads)
        return real(payloads, stored)

    monkeypatch.setattr(tokens, "bad_payloads", counted)
    return seen


LONG = [int(n) for n in np.random.default_rng(3).integers(1, 300, size=400)]  # 1- and 2-byte length prefixes


def test_a_shard_with_the_manifests_crc32c_is_checked_whole_not_record_by_record(tmp_path, monkeypatch):
    """The writer records each shard's CRC32C in the manifest; a reader's first touch of a shard
    checks it in one C call, and byte for byte only one record of each layout (plus the first and
    last): the same rows as record-by-record checking, a fraction of the per-record work."""
    import crc32c

    root = write_tokens(tmp_path / "t", LONG, num_shards=2)
    path, m = _manifest(root)
    for sh in m["splits"]["train"]["shards"]:
        with open(os.path.join(root, sh["file"]), "rb") as f:
            assert sh["crc32c"] == crc32c.crc32c(f.read())  # the file's bytes, unmasked
    opts = dict(batch_size=4, seed=2, pack=Pack(64, split="rows"))
    seen = _count_payload_checks(monkeypatch)
    with crossfeed.Loader(root, **opts) as ld:
        got = list(ld)
        assert (_shards(ld)._table[:, 0] >= 0).all()
    whole = seen[0]
    assert 0 < whole <= 2 * 8  # per shard: one record per layout (a handful) and the first and last
    for sh in m["splits"]["train"]["shards"]:  # a manifest without them (older crossfeed): block by block
        del sh["crc32c"]
    with open(path, "w") as f:
        json.dump(m, f)
    seen[0] = 0
    with crossfeed.Loader(root, **opts) as ld:
        assert same(list(ld), got)
    assert seen[0] == len(LONG)
    assert np.sort(tokens_of(got)).tolist() == every_token(LONG).tolist()


def test_a_shard_past_the_whole_check_size_is_checked_block_by_block(tmp_path, monkeypatch):
    """A shard larger than `TokenShards.WHOLE_MAX` is not read whole on a first batch: the blocks
    a batch touches are checked record by record, as without a CRC32C."""
    root = write_tokens(tmp_path / "t", LONG, num_shards=2)
    monkeypatch.setattr(TokenShards, "WHOLE_MAX", 1024)
    monkeypatch.setattr(TokenShards, "BLOCK", 16)  # blocks smaller than the shards of 200 records
    seen = _count_payload_checks(monkeypatch)
    with crossfeed.Loader(root, batch_size=1, seed=2, pack=Pack(64, split="rows")) as ld:
        next(iter(ld))
        assert 0 < seen[0] <= 4 * TokenShards.BLOCK  # the first row's blocks, not the shards
        assert (_shards(ld)._table[:, 0] == -1).any()  # the rest not checked yet


def test_a_shard_whose_bytes_miss_the_manifests_crc32c_is_checked_record_by_record(tmp_path, monkeypatch):
    root = write_tokens(tmp_path / "t", LONG, num_shards=2)
    opts = dict(batch_size=4, seed=2, pack=Pack(64, split="rows"))
    with crossfeed.Loader(root, **opts) as ld:
        want = list(ld)
    path, m = _manifest(root)
    m["splits"]["train"]["shards"][0]["crc32c"] ^= 1  # not these bytes: the shard goes block by block
    with open(path, "w") as f:
        json.dump(m, f)
    seen = _count_payload_checks(monkeypatch)
    with crossfeed.Loader(root, **opts) as ld:
        assert same(list(ld), want)
    assert seen[0] >= m["splits"]["train"]["shards"][0]["num_records"]


def test_a_damaged_shard_with_a_crc32c_still_names_its_record(tmp_path):
    root = write_tokens(tmp_path / "t", LONG, num_shards=1)
    with crossfeed.open_dataset(root) as ds:
        sp = ds["train"]
        path, (offset, length) = sp.file(0).path, sp.index(0)[200]
    _flip_a_value_byte(path, offset, length)
    with crossfeed.Loader(root, batch_size=2, shuffle="none", pack=Pack(64)) as ld:
        with pytest.raises(CorruptRecordError) as e:
            list(ld)
    assert str(int(offset)) in str(e.value)
