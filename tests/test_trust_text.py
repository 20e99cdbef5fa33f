"""``crossfeed convert text`` against hostile and damaged inputs (issue 35, items 10 and 12): a
document is bounded while it is read (a 3 GiB line, plain or inflating out of a 3 MB ``.gz``, is
never in memory whole: the conversion runs in an address space smaller than the line), and every
bad input — JSON nested 100,000 deep, a 5,000-digit integer, text that is not UTF-8, a damaged
Parquet footer or gzip stream, a token id its dtype cannot hold — is one line naming the file and
record, or, under ``--on-error skip``, one skipped record, counted, the rest converted. An
ordinary 200 KB document in a CSV (past Python's default 128 KiB field limit) simply converts.
Hypothesis then throws arbitrary bytes at each input kind, and damage at a Parquet file."""

from __future__ import annotations

import gzip
import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest
from conftest import lazy_import, requires
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

tokenizers = lazy_import("tokenizers")

from crossfeed import CrossfeedError, Loader  # noqa: E402

_policy = lazy_import("crossfeed.beam_jobs.policy")
_records = lazy_import("crossfeed.beam_jobs.records")
_text_source = lazy_import("crossfeed.beam_jobs.text_source")

pytestmark = [
    pytest.mark.slow,
    requires("tokenizers", "apache_beam"),
    pytest.mark.timeout(300),
]  # Beam jobs, 3 GiB lines under RLIMIT_AS

WORDS = ["[UNK]", "the", "quick", "brown", "fox", "a", "b"]
LIMIT_AS = 5 << 29  # 2.5 GiB: the address space of a hostile conversion, smaller than its line
LINE = 3 << 30  # the hostile line: 3 GiB


def word_tokenizer(path, extra: dict[str, int] | None = None, special_id: int | None = None):
    """A word-level tokenizer of `WORDS` (ids 0..6) and ``extra`` words at the ids given; with
    ``special_id``, a post-processor that appends the token [BIG] of that id (not in the vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(WORDS)} | (extra or {})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if special_id is not None:
        tok.post_processor = processors.TemplateProcessing(single="$A [BIG]", special_tokens=[("[BIG]", special_id)])
    tok.save(str(path))
    return path


@pytest.fixture
def tok(tmp_path):
    return word_tokenizer(tmp_path / "tok.json")


@pytest.fixture
def app():
    from crossfeed.cli.main import app

    return app


def convert(app, src, out, *args) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["convert", "text", str(src), str(out), "--no-verify", *map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # never a traceback
    return r.exit_code, r.output


def read_ids(out) -> dict[str, list[int]]:
    return {b["id"][0]: b["tokens"][0].tolist() for b in Loader(str(out), split="train", batch_size=1, shuffle=False)}


def error_line(output: str) -> str:
    """The one ``error:`` line of a failed run (and no traceback)."""
    assert "Traceback" not in output, output[-3000:]
    lines = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


# ---- item 10: a document's size, bounded while it is read -----------------------------------------


def _huge_line_file(folder, how: str) -> str:
    """A JSONL file whose second line is 3 GiB: a sparse plain file, or a 3 MB ``.jsonl.gz`` of
    concatenated members; good documents before and after it."""
    os.makedirs(folder)
    head, tail = b'{"text": "the fox"}\n{"text": "', b'"}\n{"text": "quick brown"}\n'
    if how == "gz":
        path = os.path.join(folder, "bomb.jsonl.gz")
        member = gzip.compress(b"a" * (16 << 20), 9)
        with open(path, "wb") as f:
            f.write(gzip.compress(head) + member * (LINE // (16 << 20)) + gzip.compress(tail))
    else:
        path = os.path.join(folder, "huge.jsonl")
        with open(path, "wb") as f:
            f.write(head)
            f.seek(len(head) + LINE)  # a hole: 3 GiB of zero bytes on no disk
            f.write(tail)
    return path


def _limited_convert(src, out, tok, *args) -> subprocess.CompletedProcess:
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))

    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "crossfeed.cli.main", "convert", "text", str(src), str(out), "--tokenizer", str(tok)]
    return subprocess.run(
        [*argv, "--no-verify", *args], preexec_fn=cap, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize(("how", "mode"), [("gz", "skip"), ("plain", "raise")])
def test_a_3gib_line_is_one_bad_record_read_in_bounded_memory(tmp_path, tok, how, mode):
    path = _huge_line_file(tmp_path / "in", how)
    run = _limited_convert(tmp_path / "in", tmp_path / "out", tok, "--on-error", mode)
    assert "MemoryError" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
    if mode == "raise":
        assert run.returncode == 2, run.stderr[-3000:]
        assert error_line(run.stderr).startswith(
            f"error: {path}:2: a line of more than {_text_source.MAX_DOCUMENT_BYTES:,} bytes"
        )
        assert "--max-document-bytes" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{path}:2: a line of more than {_text_source.MAX_DOCUMENT_BYTES:,} bytes" in run.stderr
    assert "skipped 1 bad records" in run.stdout
    name = os.path.basename(path)
    assert read_ids(tmp_path / "out") == {f"{name}:1": [1, 4], f"{name}:3": [2, 3]}


def test_max_document_bytes_bounds_every_kind_of_document(app, tmp_path, tok):
    src = tmp_path / "in"
    src.mkdir()
    (src / "docs.jsonl").write_text('{"text": "the fox"}\n' + json.dumps({"text": "a " * 60}) + "\n")
    (src / "small.txt").write_text("quick brown")
    (src / "big.txt").write_text("b " * 60)  # a whole-file document of 120 bytes
    (src / "rows.csv").write_text('id,text\n1,the\n2,"' + "fox " * 30 + '"\n')
    code, out = convert(app, src, tmp_path / "out", "--tokenizer", tok, "--max-document-bytes", "100")
    assert code == 2 and "--max-document-bytes" in error_line(out)
    code, out = convert(
        app, src, tmp_path / "out", "--tokenizer", tok, "--max-document-bytes", "100", "--on-error", "skip"
    )
    assert code == 0 and "skipped 3 bad records" in out, out
    assert sorted(read_ids(tmp_path / "out")) == ["docs.jsonl:1", "rows.csv:2", "small.txt"]
    for bad in ("0", "lots"):
        code, out = convert(app, src, tmp_path / "o3", "--tokenizer", tok, "--max-document-bytes", bad)
        assert code == 2 and "--max-document-bytes" in out, out


# ---- item 12: every bad input is one line, or one skipped record ----------------------------------


def _damaged_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["the fox", "a b"]}), path)
    data = bytearray(open(path, "rb").read())
    flen = int.from_bytes(data[-8:-4], "little")
    data[len(data) - 8 - flen + 4 : len(data) - 8 - flen + 12] = b"\xff" * 8  # inside the footer
    open(path, "wb").write(bytes(data))


HOSTILE = {
    # name: (file, how to write it, the record the error names)
    "deep json": ("x.jsonl", lambda p: p.write_text("[" * 100_000 + "]" * 100_000 + "\n"), "x.jsonl:1: JSON nested"),
    "5000 digits": ("x.jsonl", lambda p: p.write_text('{"text": "a", "n": ' + "9" * 5000 + "}\n"), "x.jsonl:1:"),
    "jsonl not utf-8": ("x.jsonl", lambda p: p.write_bytes(b'{"text": "caf\xe9"}\n'), "x.jsonl:1: not UTF-8"),
    "csv not utf-8": ("x.csv", lambda p: p.write_bytes(b"text\ncaf\xe9\n"), "x.csv:2: not UTF-8"),
    "csv header not utf-8": ("x.csv", lambda p: p.write_bytes(b"te\xffxt\ncafe\n"), "x.csv:1: the CSV header"),
    "txt not utf-8": ("x.txt", lambda p: p.write_bytes(b"caf\xe9"), "x.txt: not UTF-8"),
    "damaged gzip": (
        "x.jsonl.gz",
        lambda p: p.write_bytes(gzip.compress(b'{"text": "the"}\n' * 1000)[:10] + b"\xff" * 64),
        "x.jsonl.gz: not readable",
    ),
    "parquet footer": ("x.parquet", _damaged_parquet, "x.parquet"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_bad_input_is_one_line_or_one_skipped_record(app, tmp_path, tok, case, caplog):
    name, write, names = HOSTILE[case]
    src = tmp_path / "in"
    src.mkdir()
    write(src / name)
    (src / "good.jsonl").write_text('{"text": "the fox"}\n')
    code, out = convert(app, src, tmp_path / "out", "--tokenizer", tok)
    assert code == 2 and names in error_line(out), out[-3000:]
    code, out = convert(app, src, tmp_path / "out", "--tokenizer", tok, "--on-error", "skip")
    assert code == 0 and "Traceback" not in out, out[-3000:]
    assert "skipped 1 bad records" in out and names in caplog.text, (out[-3000:], caplog.text)
    assert read_ids(tmp_path / "out") == {"good.jsonl:1": [1, 4]}


def test_an_ordinary_200kb_csv_document_converts(app, tmp_path, tok):
    src = tmp_path / "in"
    src.mkdir()
    with open(src / "docs.csv", "w") as f:  # past Python's default 128 KiB csv field limit
        f.write('id,text\n1,"' + "the quick\nbrown fox " * 10_000 + '"\n2,a b\n')
    code, out = convert(app, src, tmp_path / "out", "--tokenizer", tok)
    assert code == 0, out
    got = read_ids(tmp_path / "out")
    assert got["docs.csv:2"] == [1, 2, 3, 4] * 10_000 and got["docs.csv:10003"] == [5, 6]


def test_token_ids_past_uint16(app, tmp_path):
    """The width comes from every id the tokenizer can give (its vocabulary, and the special
    tokens of its post-processor, which need not be in the vocabulary); forced narrower, a
    document whose ids do not fit is one line naming the id and --token-dtype, or one skip."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "docs.jsonl").write_text('{"text": "the fox"}\n{"text": "huge a"}\n')
    big_word = word_tokenizer(tmp_path / "w.json", extra={"huge": 70_000})
    big_special = word_tokenizer(tmp_path / "s.json", special_id=80_000)

    code, out = convert(app, src, tmp_path / "o1", "--tokenizer", big_special)
    assert code == 0 and "tokens stored as uint32" in out, out
    assert read_ids(tmp_path / "o1") == {"docs.jsonl:1": [1, 4, 80_000], "docs.jsonl:2": [0, 5, 80_000]}

    code, out = convert(app, src, tmp_path / "o2", "--tokenizer", big_word, "--token-dtype", "uint16")
    line = error_line(out)
    assert code == 2 and "docs.jsonl:2" in line and "70,000" in line and "--token-dtype" in line, line
    code, out = convert(
        app, src, tmp_path / "o3", "--tokenizer", big_word, "--token-dtype", "uint16", "--on-error", "skip"
    )
    assert code == 0 and "skipped 1 bad records" in out, out
    assert read_ids(tmp_path / "o3") == {"docs.jsonl:1": [1, 4]}
    with open_manifest(tmp_path / "o3") as m:
        assert m["metadata"]["tokenizer"]["dtype"] == "uint16"


def open_manifest(out):
    import contextlib

    @contextlib.contextmanager
    def opened():
        with open(os.path.join(out, "crossfeed.json")) as f:
            yield json.load(f)

    return opened()


# ---- hypothesis: arbitrary bytes in every input kind, damage in a Parquet file ---------------------


def _read_all(src, tok_path, mode: str, **options) -> tuple[list, int]:
    """Scan ``src`` and run every unit through reading and tokenizing, as the job does:
    ``(kept keys, skipped)``."""
    source = _text_source.TextSource.scan(
        str(src), tokenizer=str(tok_path), on_error=_policy.ErrorPolicy(mode), **options
    )
    step = _text_source.TokenizeDoFn(source.tokenizer, source.on_error)
    step.setup()
    keys, skipped = [], 0
    for unit in source.units():
        for batch in source.read(unit):
            for out in step.process(batch):
                assert isinstance(out, _records.SampleBatch)
                keys += out.keys
                skipped += out.skipped
                assert all(t.dtype == np.dtype(source.tokenizer.dtype) for t in out.columns["tokens"])
    return keys, skipped


TEXT_KINDS = ("x.jsonl", "x.csv", "x.tsv", "x.txt", "x.jsonl.gz", "x.txt.gz")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(TEXT_KINDS),
    body=st.one_of(
        st.binary(max_size=300),
        st.lists(
            st.one_of(
                st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=30)),
                st.sampled_from(['{"text": 1}', "[[[[", '{"text": "a"', "null", '"x"', "text", "a,b,c", '"']),
                st.text(max_size=40),
            ),
            max_size=8,
        ).map(lambda ls: ("text\n" + "\n".join(ls)).encode("utf-8", "surrogatepass")),
    ),
    limit=st.sampled_from([8, 64, 16 << 20]),  # 16 MiB: text_source.MAX_DOCUMENT_BYTES
)
def test_fuzzed_text_inputs_end_in_one_crossfeed_error_or_skips(tmp_path_factory, name, body, limit):
    src = tmp_path_factory.mktemp("fz")
    data = gzip.compress(body) if name.endswith(".gz") else body
    (src / name).write_bytes(data)
    tok_path = word_tokenizer(src.parent / f"{src.name}.json")
    try:
        _read_all(src, tok_path, "raise", max_document_bytes=limit)
    except CrossfeedError:
        pass  # one typed error; anything else fails the test
    try:
        keys, _ = _read_all(src, tok_path, "skip", max_document_bytes=limit)
    except CrossfeedError as e:  # only what the scan refuses in a CSV: its header names no column
        assert name.endswith((".csv", ".tsv")) and "no column" in str(e), e
        return
    assert all(k.startswith(name) for k in keys)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_parquet_damage_ends_in_one_crossfeed_error_or_skips(tmp_path_factory, data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path_factory.mktemp("pq")
    path = src / "x.parquet"
    pq.write_table(pa.table({"text": ["the fox", "a b", None, "quick"] * 3}), path, row_group_size=4)
    raw = bytearray(path.read_bytes())
    flen = int.from_bytes(raw[-8:-4], "little")
    footer = len(raw) - 8 - flen
    for _ in range(data.draw(st.integers(1, 4))):  # damage inside the footer, its length, or anywhere
        at = data.draw(st.one_of(st.integers(footer, len(raw) - 1), st.integers(0, len(raw) - 1)))
        raw[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    path.write_bytes(bytes(raw))
    tok_path = word_tokenizer(src.parent / f"{src.name}.json")
    try:
        _read_all(src, tok_path, "raise")
    except CrossfeedError:
        pass
    try:
        _read_all(src, tok_path, "skip")
    except CrossfeedError as e:  # what the scan refuses: the footer parses, the column is not text
        assert "column" in str(e), e


def test_a_batch_of_documents_is_bounded_by_its_text(tmp_path, tok, monkeypatch):
    """The tokenizer encodes a batch at once and holds ~85 bytes per byte of it: a batch closes
    once it holds `BATCH_TEXT` characters, not only at `BATCH_DOCS` documents."""
    from crossfeed.beam_jobs import text_source

    monkeypatch.setattr(text_source, "BATCH_TEXT", 100)
    src = tmp_path / "in"
    src.mkdir()
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": "the fox " * 8}) + "\n" for _ in range(7)))
    source = _text_source.TextSource.scan(str(src), tokenizer=str(tok))
    batches = [b for u in source.units() for b in source.read(u)]
    assert [len(b) for b in batches] == [2, 2, 2, 1]
    assert all(sum(map(len, b.columns["text"])) < 100 + 64 for b in batches)


def _walk_lines(lines) -> list:
    """Every line a line reader gives, or the `_BadLine` it raises, with its line number."""
    out = []
    while True:
        try:
            got = next(lines)
        except StopIteration:
            return out
        except Exception as e:  # the reader's bad line: named, and the reading goes on
            out.append((lines.line, type(e).__name__, str(e)))
        else:
            out.append((lines.line, got))


_PIECES = [b"a", b"bc", b"\n", b"\r\n", b"\r", b"\xff", b"\xc3\xa9", b"x" * 7, b"\n\n"]


@settings(max_examples=400, deadline=None)
@given(
    body=st.one_of(st.binary(max_size=120), st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join)),
    limit=st.integers(1, 12),
    block=st.integers(1, 9),
    decode=st.booleans(),
)
def test_lines_read_a_block_at_a_time_are_those_of_readline(body, limit, block, decode):
    """A plain .txt or .jsonl file's lines are read a block at a time: the same lines, line
    numbers and over-long or non-UTF-8 lines as the bounded ``readline`` gives, whatever the
    block size."""
    import io

    want = _walk_lines(_text_source.Lines(io.BytesIO(body), limit, "f.txt", decode=decode))
    fast = _text_source.BlockLines(io.BytesIO(body), limit, "f.txt", decode=decode)
    fast.block = block
    assert _walk_lines(fast) == want
