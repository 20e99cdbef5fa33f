"""Whole converted datasets, byte for byte: the sha256 of every file a `convert` writes (shards,
index and lengths files, manifest) for fixed small inputs, checked against digests of a known
tree (computed at 09d6ec1; the manifests' since they list each shard's CRC32C — every other file
unchanged, checked file by file). Any change to what a conversion writes — order, framing, gzip
stream, index, lengths, statistics — shows here as a changed digest."""

from __future__ import annotations

import csv
import hashlib
import os

import numpy as np
import pytest
from conftest import lazy_import, requires

beam_job = lazy_import("crossfeed.beam_jobs.job")
beam_write = lazy_import("crossfeed.beam_jobs.write")
pytestmark = [pytest.mark.slow, requires("apache_beam", "tokenizers")]  # real Beam pipelines


def digests(root) -> dict[str, str]:
    """``{file name: sha256}`` of every file under ``root`` (nothing left over: no temporaries)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return dict(sorted(out.items()))


def summary(root) -> str:
    d = digests(root)
    assert not [n for n in d if n.startswith(".tmp-")], d
    return f"{len(d)} " + hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()[:32]


def text_inputs(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]  # ids past 65,535: uint32 tokens
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)} | {"[UNK]": 70_000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok.json"))
    rng = np.random.default_rng(3)
    docs = tmp_path / "docs"
    docs.mkdir()
    for k in range(3):
        with open(docs / f"d{k}.txt", "w") as f:
            for _ in range(700):
                n = int(rng.integers(0, 60))  # some empty lines: dropped documents
                f.write(" ".join(words[j] for j in rng.integers(0, 70_000, n)) + "\n")
    return docs, tmp_path / "tok.json"


def convert_text(tmp_path, name, **options):
    docs, tok = (
        text_inputs(tmp_path) if not (tmp_path / "docs").exists() else (tmp_path / "docs", tmp_path / "tok.json")
    )
    src = beam_job.make_source("text", str(docs), tokenizer=str(tok), per_line=True, add_special_tokens=False)
    out = tmp_path / name
    beam_job.convert(src, out, **options)
    return out


GOLDEN = {
    "text-3": "10 3e6f6e546d0fac9f9cea77975ee90798",
    "text-splits-gz": "25 e9234ffa8e835b4d0f6e3fe465b14dea",
    "text-size": "31 a40c8ed09782f937104e4dedff4eabab",
    "numpy-splits-gz": "13 c60c690b5b9e190a0a574d5a181ca067",
    "numpy-empty-shards": "17 203160cc3cc05ac72301601ac791be4a",
    "csv-seed": "11 0b17309627c4ee0ea50119fd6a7f1627",
}


def test_text_converts_to_the_same_bytes(tmp_path):
    got = {
        "text-3": summary(convert_text(tmp_path, "a", num_shards=3)),
        "text-splits-gz": summary(
            convert_text(tmp_path, "b", splits="train=0.7,validation=0.3", num_shards=4, compress=True)
        ),
        "text-size": summary(convert_text(tmp_path, "c", shard_size="40KB")),
    }
    assert got == {k: GOLDEN[k] for k in got}


def test_text_with_eos_uint16_skips_and_crlf_converts_to_the_same_bytes(tmp_path):
    """JSONL and .txt lines (CRLF and LF, blank lines, lines that are not JSON), an eos id after
    every document, uint16 tokens forced and ids past them skipped (digests computed at 94d33ba,
    before the batch-at-a-time tokens step)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from crossfeed.beam_jobs.policy import ErrorPolicy

    words = [f"w{i}" for i in range(70_000)]
    vocab = {w: i for i, w in enumerate(words)} | {"[UNK]": 70_000, "[EOS]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok.json"))
    rng = np.random.default_rng(11)
    docs = tmp_path / "docs"
    docs.mkdir()
    with open(docs / "a.jsonl", "w") as f:
        for i in range(900):
            text = " ".join(
                words[j] for j in rng.integers(0, 70_000 if i % 7 == 0 else 60_000, int(rng.integers(0, 40)))
            )
            f.write(("not json" if i % 97 == 5 else "" if i % 50 == 3 else json.dumps({"text": text})) + "\n")
    with open(docs / "b.txt", "wb") as f:
        for i in range(600):
            text = " ".join(words[j] for j in rng.integers(0, 60_000, int(rng.integers(0, 30))))
            f.write((text + ("\r\n" if i % 3 else "\n")).encode())
    got = {}
    for name, dtype, eos, options in (
        ("text-u16-eos-skip", "uint16", "w5", {"num_shards": 3}),
        ("text-u32-eos-splits", None, "[EOS]", {"splits": "train=0.6,test=0.4", "num_shards": 2}),
    ):
        src = beam_job.make_source(
            "text",
            docs,
            tokenizer=str(tmp_path / "tok.json"),
            per_line=True,
            token_dtype=dtype,
            eos=eos,
            add_special_tokens=False,
            on_error=ErrorPolicy("skip", 1000),
        )
        beam_job.convert(src, tmp_path / name, max_skips=1000, **options)
        got[name] = summary(tmp_path / name)
    assert got == {
        "text-u16-eos-skip": "10 f00b05ed5cb096e255358f5a016018ea",
        "text-u32-eos-splits": "13 055ca4c919a92bf5e2b87ae06d22255f",
    }


def test_numpy_and_csv_convert_to_the_same_bytes(tmp_path):
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "a.npz", x=rng.normal(size=(900, 2, 3)).astype(np.float32), y=rng.integers(0, 5, 900))
    got = {}
    src = beam_job.make_source("numpy", str(tmp_path / "a.npz"), label="y", batch_rows=128)
    beam_job.convert(src, tmp_path / "n1", splits="train=0.8,test=0.2", num_shards=3, compress=True)
    got["numpy-splits-gz"] = summary(tmp_path / "n1")
    np.save(tmp_path / "few.npy", np.arange(5, dtype=np.int64))
    src = beam_job.make_source("numpy", str(tmp_path / "few.npy"))
    beam_job.convert(src, tmp_path / "n2", num_shards=8)
    got["numpy-empty-shards"] = summary(tmp_path / "n2")
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "name"])
        for i in range(1500):
            w.writerow([i, float(rng.normal()), f"row {i}"])
    src = beam_job.make_source("csv", str(tmp_path / "t.csv"), batch_rows=200)
    beam_job.convert(src, tmp_path / "c1", seed=7, num_shards=5)
    got["csv-seed"] = summary(tmp_path / "c1")
    assert got == {k: GOLDEN[k] for k in got}


def test_encode_passes_on_no_record_bytes_and_a_damaged_staged_file_is_named(tmp_path):
    """What ``Encode`` hands the runner is each record's hash, key, place and lengths (a few
    dozen bytes a record), not its bytes; those are framed in the batch's staged file, where a
    shard writer that finds the file cut short names it."""
    import pickle

    from crossfeed.beam_jobs import steps
    from crossfeed.beam_jobs.records import SampleBatch
    from crossfeed.beam_jobs.splits import SplitSpec
    from crossfeed.errors import CorruptRecordError, CrossfeedError
    from crossfeed.format import tfrecord
    from crossfeed.format.schema import Encoding, Feature, Schema

    schema = Schema([Feature("v", "float32", (2048,), Encoding.TENSOR)])
    cfg = steps.WriteConfig(str(tmp_path), "t0", SplitSpec.single("train"), schema=schema)
    rng = np.random.default_rng(0)
    batch = SampleBatch("b0", [f"k{i}" for i in range(64)], {"v": rng.normal(size=(64, 2048)).astype(np.float32)})
    [(batch_id, (parts, summary))] = list(steps.EncodeDoFn(cfg).process(batch))
    [part] = parts
    path = os.path.join(cfg.batches_dir, part.name)
    size = os.path.getsize(path)
    assert batch_id == "b0" and size > 64 * 8192 and len(pickle.dumps((parts, summary))) < size / 20
    assert list(part.hashes) == sorted(part.hashes)  # in hash order: a shard's records are one range
    with open(path, "rb") as f:  # TFRecord frames (both CRCs checked), where the part says they are
        assert [at for at, _ in tfrecord.records(f.read(), path)] == part.starts.tolist()
    views, starts = steps._read_pieces(cfg.batches_dir, [part])
    assert len(views[0]) == size and starts[0] == 0
    at = int(part.starts[5]) + 100  # a byte inside the sixth record's payload, flipped on disk
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptRecordError, match=f"{part.name}: corrupt record at byte offset {int(part.starts[5])}"):
        steps._read_pieces(cfg.batches_dir, [part])
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(byte)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CrossfeedError, match=part.name):
        steps._read_pieces(cfg.batches_dir, [part])
    os.unlink(path)
    with pytest.raises(CrossfeedError, match="staged records are gone"):
        steps._read_pieces(cfg.batches_dir, [part])
