"""``crossfeed convert text``: documents tokenized by a real trained tokenizer in a real Beam
pipeline, read back through `crossfeed.Loader`, with the lengths files beside the shards."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from conftest import requires
from typer.testing import CliRunner

from crossfeed import Loader, open_dataset
from crossfeed.errors import ConfigError
from crossfeed.format.lengths import checked_lengths, lengths_path

pytestmark = [pytest.mark.slow, requires("apache_beam", "tokenizers")]  # slow: real Beam pipelines

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly quartz boxes".split()


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


def train_tokenizer(path, vocab_size: int = 120, added: int = 0, special=("[EOS]",)):
    """A BPE tokenizer trained on a few lines; ``added`` extra tokens push its ids past 65,536."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", *special])
    tok.train_from_iterator(corpus(200, seed=1), trainer=trainer)
    if added:
        tok.add_tokens([f"zz{i}" for i in range(added)])
    tok.save(str(path))
    return tok


@pytest.fixture
def app():
    from crossfeed.cli.main import app

    return app


def invoke(app, *args):
    r = CliRunner().invoke(app, ["convert", "text", *map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # never a traceback
    return r


def read_back(out) -> dict[str, np.ndarray]:
    """Every record of every split through the Loader, by its id."""
    got = {}
    with open_dataset(out) as ds:
        for split in ds.splits:
            for batch in Loader(out, split=split, batch_size=1, shuffle=False):
                got[batch["id"][0]] = batch["tokens"][0]
    return got


def lengths_of(out) -> dict[str, list[int]]:
    """Each shard's lengths file, checked against the manifest, as a list."""
    with open_dataset(out) as ds:
        assert ds.manifest.lengths == ("tokens",)
        return {
            sh.file: checked_lengths(open(out / lengths_path(sh.file), "rb").read(), sh.file, sh, 1)[:, 0].tolist()
            for s in ds.splits.values()
            for sh in s.shards
        }


def test_jsonl_documents_round_trip_with_their_lengths(app, tmp_path):
    tok = train_tokenizer(tmp_path / "tok.json")
    docs = corpus(60)
    (tmp_path / "in").mkdir()
    for part in range(2):
        with open(tmp_path / "in" / f"part-{part}.jsonl", "w") as f:
            for d in docs[part * 30 : (part + 1) * 30]:
                f.write(json.dumps({"text": d, "meta": part}) + "\n")
    out = tmp_path / "out"
    r = invoke(
        app,
        str(tmp_path / "in" / "part-*.jsonl"),
        out,
        "--tokenizer",
        tmp_path / "tok.json",
        "--splits",
        "train=0.7,validation=0.3",
        "--shards",
        2,
    )
    assert r.exit_code == 0, r.output
    assert "wrote 60 samples" in r.output and "verified" in r.output and "uint16" in r.output
    got = read_back(out)
    want = {f"part-{i // 30}.jsonl:{i % 30 + 1}": tok.encode(d).ids for i, d in enumerate(docs)}
    assert sorted(got) == sorted(want)
    for key, ids in want.items():
        assert got[key].dtype == np.uint16 and got[key].tolist() == ids, key
    with open_dataset(out) as ds:
        assert ds.schema["tokens"].dtype == "uint16" and ds.schema["tokens"].shape == (None,)
        assert ds.metadata["tokenizer"]["sha256"] == hashlib.sha256((tmp_path / "tok.json").read_bytes()).hexdigest()
        order = {
            sh.file: [b["id"][0] for b in Loader(out, split=name, batch_size=1, shuffle=False)]
            for name, s in ds.splits.items()
            for sh in s.shards[:1]
        }
        stats = ds.splits["train"].statistics["tokens"]["lengths"]
        train = [len(want[k]) for b in Loader(out, split="train", batch_size=1, shuffle=False) for k in b["id"]]
    assert stats["count"] == len(train) and stats["total"] == sum(train)
    assert stats["min"] == min(train) and stats["max"] == max(train)
    assert sum(stats["histogram"].values()) == len(train)
    lengths = lengths_of(out)
    assert sum(len(v) for v in lengths.values()) == 60
    for file, ids in order.items():  # each shard's lengths are its records' token counts, in order
        assert lengths[file] == [len(want[k]) for k in ids[: len(lengths[file])]]


def wide_tokenizer(path):
    """A word-level tokenizer whose words have ids past 65,535 (so tokens need uint32)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: 65_530 + 100 * i for i, w in enumerate(WORDS)}
    taken = set(words.values())
    vocab = {"[UNK]": 0, **{f"pad{i}": i for i in range(1, 70_000) if i not in taken}, **words}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


def test_text_files_parquet_and_csv_columns_with_a_wide_vocabulary(app, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tok = wide_tokenizer(tmp_path / "wide.json")
    docs = corpus(24, seed=3)
    src = tmp_path / "in"
    (src / "books").mkdir(parents=True)
    for i in range(3):  # one document per file
        (src / "books" / f"b{i}.txt").write_text(docs[i] + "\n" + docs[i + 3])
    (src / "empty.txt").write_text(" \n")  # an empty document
    table = pa.table({"text": docs[12:18] + [None], "n": list(range(7))})
    pq.write_table(table, src / "t.parquet", row_group_size=4)
    with open(src / "t.csv", "w") as f:
        f.write("k,text\n" + "".join(f"{i},{d}\n" for i, d in enumerate(docs[18:24])))
    out = tmp_path / "out"
    r = invoke(app, src, out, "--tokenizer", tmp_path / "wide.json", "--shards", 3)
    assert r.exit_code == 0, r.output
    assert "uint32" in r.output and "left out 2 empty documents" in r.output  # empty.txt and the null
    assert "wrote 15 samples" in r.output
    got = read_back(out)
    want = {f"books/b{i}.txt": docs[i] + "\n" + docs[i + 3] for i in range(3)}
    want.update({f"t.parquet:{i}": d for i, d in enumerate(docs[12:18])})
    want.update({f"t.csv:{i + 2}": d for i, d in enumerate(docs[18:24])})
    assert sorted(got) == sorted(want)
    for key, text in want.items():
        assert got[key].dtype == np.uint32 and got[key].tolist() == tok.encode(text).ids, key
    assert max(int(v.max()) for v in got.values()) > 65_535
    with open_dataset(out) as ds:
        assert ds.metadata["dropped_records"] == {"empty_documents": 2}
        assert ds.schema["tokens"].dtype == "uint32"
    assert sorted(x for v in lengths_of(out).values() for x in v) == sorted(len(v) for v in got.values())


def test_a_bad_json_line_is_named_by_file_and_line(app, tmp_path):
    train_tokenizer(tmp_path / "tok.json")
    lines = [json.dumps({"text": d}) for d in corpus(5)]
    lines[2] = '{"text": "unterminated'
    lines[3] = json.dumps({"body": "no text field"})
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    r = invoke(app, tmp_path / "a.jsonl", tmp_path / "o1", "--tokenizer", tmp_path / "tok.json")
    assert r.exit_code == 2 and "a.jsonl:3: not valid JSON" in r.output and "--on-error skip" in r.output
    assert not (tmp_path / "o1" / "crossfeed.json").exists()
    r = invoke(app, tmp_path / "a.jsonl", tmp_path / "o2", "--tokenizer", tmp_path / "tok.json", "--on-error", "skip")
    assert r.exit_code == 0 and "wrote 3 samples" in r.output and "skipped 2 bad records" in r.output, r.output
    assert sorted(read_back(tmp_path / "o2")) == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:5"]
    r = invoke(app, tmp_path / "a.jsonl", tmp_path / "o3", "--tokenizer", tmp_path / "tok.json", "--field", "body")
    assert r.exit_code == 2 and "a.jsonl:1: no field 'body'" in r.output


def test_verify_names_a_changed_or_missing_lengths_file(tmp_path):
    from crossfeed.cli.main import app as root

    tok = train_tokenizer(tmp_path / "tok.json")
    docs = corpus(20)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:10]))
    (tmp_path / "lines.txt").write_text("\n".join(docs[10:]) + "\n\n")  # --per-line: the blank line is empty
    out = tmp_path / "out"
    r = invoke(
        root,
        tmp_path / "a.jsonl",
        tmp_path / "lines.txt",
        out,
        "--tokenizer",
        tmp_path / "tok.json",
        "--shards",
        2,
        "--eos",
        "[EOS]",
        "--per-line",
    )
    assert r.exit_code == 0 and "left out 1 empty documents" in r.output, r.output
    eos = tok.token_to_id("[EOS]")
    want = {f"a.jsonl:{i + 1}": d for i, d in enumerate(docs[:10])} | {
        f"lines.txt:{i + 1}": d for i, d in enumerate(docs[10:])
    }
    got = read_back(out)
    assert sorted(got) == sorted(want)
    assert all(got[k].tolist() == tok.encode(d).ids + [eos] for k, d in want.items())
    runner = CliRunner()
    assert runner.invoke(root, ["verify", str(out)]).exit_code == 0
    with open_dataset(out) as ds:
        name = lengths_path(ds.splits["train"].shards[1].file)
    data = bytearray((out / name).read_bytes())
    data[0] ^= 1
    (out / name).write_bytes(bytes(data))
    r = runner.invoke(root, ["verify", str(out)])
    assert r.exit_code == 1 and f"{name}: sha256 differs from the manifest's lengths_sha256" in r.output
    (out / name).unlink()
    r = runner.invoke(root, ["verify", str(out)])
    assert r.exit_code == 1 and f"{name}: lengths file is missing" in r.output


def test_the_tokenizer_travels_once_and_compressed(tmp_path):
    """The read step ships the source without the tokenizer's JSON (only the tokenize step
    needs it), and a pickled tokenizer spec holds its JSON compressed, the same spec unpickled."""
    import pickle

    from crossfeed.beam_jobs.job import make_source

    tok = tmp_path / "tok.json"
    train_tokenizer(tok, added=2000)
    (tmp_path / "d.txt").write_text("the quick fox\n")
    src = make_source("text", tmp_path / "d.txt", tokenizer=tok, per_line=True, eos="[EOS]")
    text = src.tokenizer.text
    assert len(text) > 50_000
    assert pickle.loads(pickle.dumps(src)) == src
    assert len(pickle.dumps(src.tokenizer)) < len(text) / 2
    reader = src.reader()
    assert len(pickle.dumps(reader)) < 4_000 and reader.tokenizer.text == ""
    assert list(reader.read(reader.units()[0]))[0].keys == ["d.txt:1"]


def test_an_in_process_job_builds_its_tokenizer_once_and_ships_only_its_hash(tmp_path, monkeypatch):
    """On the in-process runner the tokenize step gets the tokenizer built when the job was planned
    (the pickled step carries its sha256, not its JSON); on a runner whose steps run in other
    processes the JSON travels and each worker builds its own — the same tokens either way."""
    import pickle

    from crossfeed.beam_jobs import text_source
    from crossfeed.beam_jobs.job import convert, make_source

    tok = tmp_path / "tok.json"
    train_tokenizer(tok, added=2000)
    docs = tmp_path / "d.txt"
    docs.write_text("\n".join(corpus(50)) + "\n")
    built, pickled = [], []
    monkeypatch.setattr("crossfeed.beam_jobs.text_source.TOKENIZERS", text_source.Tokenizers())  # none built yet
    from_str = text_source._from_str
    monkeypatch.setattr(
        "crossfeed.beam_jobs.text_source._from_str", lambda text, where: built.append(where) or from_str(text, where)
    )
    reduce = text_source.TokenizerSpec.__reduce__
    monkeypatch.setattr(
        text_source.TokenizerSpec, "__reduce__", lambda self: pickled.append(len(self.text)) or reduce(self)
    )
    src = make_source("text", docs, tokenizer=tok, per_line=True)
    assert len(built) == 1
    convert(src, tmp_path / "a", num_shards=2)
    assert len(built) == 1 and pickled and set(pickled) == {0}  # built once; every pickled spec without its JSON
    convert(
        src,
        tmp_path / "b",
        num_shards=2,
        beam_args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
    )
    assert max(pickled) == len(src.tokenizer.text)  # the other runner: the JSON travels
    a, b = read_back(tmp_path / "a"), read_back(tmp_path / "b")
    assert len(a) == 50 and a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    with text_source.TOKENIZERS.hold(src.tokenizer) as held:
        assert held.held and held.text == "" and held.open() is text_source.TOKENIZERS.held(held)
        blob = pickle.dumps(held)
        assert len(blob) < 1_000
    # once no job holds it, a held spec (a step unpickled after its job, or in another process) is refused
    with pytest.raises(ConfigError, match="tok.json: held in the memory of the process that planned the job"):
        pickle.loads(blob).open()


def test_the_tokenizers_kept_are_bounded_and_a_held_one_stays(tmp_path):
    from crossfeed.beam_jobs.text_source import Tokenizers, TokenizerSpec

    specs = []
    for i in range(4):
        train_tokenizer(tmp_path / f"t{i}.json", added=i + 1)
        specs.append(TokenizerSpec.load(tmp_path / f"t{i}.json"))
    assert len({s.sha256 for s in specs}) == 4
    kept = Tokenizers()
    with kept.hold(specs[0]) as held:
        for s in specs[1:]:
            assert kept.build(s.text, s.sha256, s.name).get_vocab_size() > 0
        assert kept.held(held).get_vocab_size() == specs[0].open().get_vocab_size()  # pinned while held
        assert len(kept) == 1 + Tokenizers.KEEP  # the held one and the last KEEP built
    first = kept.build(specs[3].text, specs[3].sha256, specs[3].name)
    assert kept.build(specs[3].text, specs[3].sha256, specs[3].name) is first  # built once
    changed = specs[3].text.replace('"[UNK]"', '"[unk]"', 1)  # the same sha256 claimed for another JSON
    assert kept.build(changed, specs[3].sha256, "x") is not first
