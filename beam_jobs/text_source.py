"""Text for language models, tokenized: one record per document, its token ids in the tensor
feature ``tokens`` (little-endian ``uint16`` when the tokenizer's ids all fit, else ``uint32``)
and its key in ``id`` (``file:line``, ``file:row``, or ``file``), with the tokens' per-record
lengths kept beside each shard (``NAME.len``, `crossfeed.format.lengths`) for sequence packing.

Inputs, by extension (any mix, any number of files, folders and globs):

* JSONL (``.jsonl``, ``.ndjson``, optionally ``.gz``): one JSON object per line, the document in
  ``field`` (default ``"text"``); a line that is not JSON, not an object, lacks the field or
  holds no string there is a bad record named ``file:line`` (the ``on_error`` policy). Blank
  lines are no documents.
* plain text (``.txt``, optionally ``.gz``): one document per file, or one per line with
  ``per_line`` (keys ``file:line``); text that is not UTF-8 is a bad record.
* Parquet (``.parquet``, ``.pq``): a string ``column`` (default ``"text"``), one unit per row
  group (keys ``file:row``, rows counted from 0 as ``crossfeed convert parquet`` does).
* CSV (``.csv``, ``.tsv``): a ``column`` named by the header (keys ``file:line``).

A document that is empty or whitespace only (a null too), or that tokenizes to no ids, is not
written: it is counted (``dropped_records.empty_documents`` in the manifest) and reported.

Tokenizing is a Beam step of its own (`TokenizeDoFn`): the tokenizer's JSON travels with the
job (its sha256 recorded in the metadata), is loaded once per worker in ``setup`` and encodes a
batch of documents at a time (``encode_batch_fast``: the Rust tokenizer's threads). By default
the tokenizer's post-processor adds its special tokens, as ``tokenizer.encode(text)`` does;
``eos`` appends a token (e.g. ``"</s>"``) to every document.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
import numpy as np

from crossfeed.beam_jobs.policy import ErrorPolicy, Skips
from crossfeed.beam_jobs.records import SampleBatch
from crossfeed.beam_jobs.sources import list_files
from crossfeed.errors import ConfigError
from crossfeed.format.schema import Encoding, Feature, Schema

JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
TEXT = (".txt", ".txt.gz")
PARQUET = (".parquet", ".pq")
CSV = (".csv", ".tsv")
EMPTY = "empty_documents"  # the reason documents are dropped, in the manifest's dropped_records
TOKENS, ID = "tokens", "id"
BATCH_DOCS = 1024  # documents per batch (one encode_batch call)
FILES_PER_UNIT = 256  # whole-file text documents read per work unit


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, exts in (("jsonl", JSONL), ("text", TEXT), ("parquet", PARQUET), ("csv", CSV)):
        if low.endswith(exts):
            return kind
    raise ConfigError(f"{name}: not a text input ({', '.join(JSONL + TEXT + PARQUET + CSV)})")


@dataclass(frozen=True)
class TokenizerSpec:
    """A Hugging Face ``tokenizers`` tokenizer as the job ships it: its JSON (``text``), sha256
    and the size of its id space (``vocab_size``: the largest id + 1, added tokens included)."""

    name: str
    sha256: str
    vocab_size: int
    add_special_tokens: bool = True
    eos_id: int | None = None
    text: str = field(default="", repr=False)

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ConfigError(f"tokenizer {self.name}: an empty vocabulary")
        if self.eos_id is not None and not 0 <= self.eos_id < self.vocab_size:
            raise ConfigError(f"tokenizer {self.name}: eos id {self.eos_id} is outside its {self.vocab_size} ids")

    @property
    def dtype(self) -> str:
        """``uint16`` when every id fits in 16 bits, else ``uint32``."""
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    @classmethod
    def load(cls, path, *, add_special_tokens: bool = True, eos: str | int | None = None) -> TokenizerSpec:
        """The tokenizer saved at ``path`` (``tokenizer.save(path)``, a ``tokenizer.json``);
        ``eos``: a token (or id) appended to every document."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConfigError(f"--tokenizer {path}: cannot read it ({e.strerror or e})") from e
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--tokenizer {path}: not UTF-8 JSON (byte {e.start}); save one with tokenizer.save(path)"
            ) from e
        tok = _from_str(text, path)
        ids = list(tok.get_vocab(with_added_tokens=True).values())
        vocab = max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))
        eos_id = None
        if isinstance(eos, str) and not eos.isdigit():
            eos_id = tok.token_to_id(eos)
            if eos_id is None:
                special = [t.content for t in tok.get_added_tokens_decoder().values()][:10]
                raise ConfigError(f"--eos {eos!r}: {path} has no such token; its added tokens are {special}")
        elif eos is not None:
            eos_id = int(eos)
        return cls(os.path.basename(path), hashlib.sha256(data).hexdigest(), vocab, add_special_tokens, eos_id, text)

    def open(self):
        """The tokenizer itself (what a worker's `TokenizeDoFn.setup` calls once)."""
        return _from_str(self.text, self.name)

    def metadata(self) -> dict:
        return {
            "file": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "add_special_tokens": self.add_special_tokens,
            "eos_id": self.eos_id,
        }


def _from_str(text: str, where: str):
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ConfigError("crossfeed convert text needs Hugging Face tokenizers: pip install 'crossfeed[text]'") from e
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises plain Exceptions for a bad file
        raise ConfigError(
            f"--tokenizer {where}: not a tokenizers JSON file ({e}); save one with tokenizer.save(path)"
        ) from e


@dataclass(frozen=True)
class TextSource:
    root: str
    units_: tuple  # ("jsonl"|"lines"|"parquet"|"csv", number, rel[, group, start]) or ("files", number, rels)
    tokenizer: TokenizerSpec
    field: str = "text"
    column: str = "text"
    per_line: bool = False
    on_error: ErrorPolicy = ErrorPolicy()
    length_features: tuple[str, ...] = (TOKENS,)

    @classmethod
    def scan(
        cls,
        src,
        *,
        tokenizer,
        field: str = "text",
        column: str = "text",
        per_line: bool = False,
        add_special_tokens: bool = True,
        eos: str | int | None = None,
        on_error: ErrorPolicy = ErrorPolicy(),
    ) -> TextSource:
        """``src``: files, folders (every text input under them), globs, or a list of these."""
        if not field or not column:
            raise ConfigError("--field and --column name a JSON field and a column; they cannot be empty")
        spec = (
            tokenizer
            if isinstance(tokenizer, TokenizerSpec)
            else TokenizerSpec.load(tokenizer, add_special_tokens=add_special_tokens, eos=eos)
        )
        root, files = list_files(src, JSONL + TEXT + PARQUET + CSV, "text")
        units: list[tuple] = []
        whole: list[str] = []
        for number, rel in enumerate(files):
            kind = kind_of(rel)
            path = os.path.join(root, rel)
            if kind == "jsonl":
                units.append(("jsonl", number, rel))
            elif kind == "text" and per_line:
                units.append(("lines", number, rel))
            elif kind == "text":
                whole.append(rel)
            elif kind == "csv":
                _csv_column(path, column)  # the header names it
                units.append(("csv", number, rel))
            else:
                units += [("parquet", number, rel, g, start) for g, start in _row_groups(path, column)]
        for c in range(0, len(whole), FILES_PER_UNIT):
            units.append(("files", len(files) + c, tuple(whole[c : c + FILES_PER_UNIT])))
        return cls(root, tuple(units), spec, field, column, per_line, on_error)

    @property
    def schema(self) -> Schema:
        return Schema(
            [
                Feature(TOKENS, self.tokenizer.dtype, (None,), Encoding.TENSOR),
                Feature(ID, "string", (), Encoding.BYTES),
            ]
        )

    @property
    def metadata(self) -> dict:
        kinds = sorted({u[0] for u in self.units_})
        return {
            "source": "text",
            "text": {"field": self.field, "column": self.column, "per_line": self.per_line, "inputs": kinds},
            "tokenizer": self.tokenizer.metadata(),
        }

    def report(self) -> list[str]:
        t = self.tokenizer
        eos = f", then eos id {t.eos_id}" if t.eos_id is not None else ""
        special = "with its post-processor's special tokens" if t.add_special_tokens else "without special tokens"
        return [
            f"tokenizer {t.name} (sha256 {t.sha256[:12]}…): {t.vocab_size:,} ids, tokens stored as {t.dtype}; "
            f"encoded {special}{eos}",
            "documents: "
            + ", ".join(
                {
                    "jsonl": f"JSONL field {self.field!r} per line",
                    "lines": "a line of a .txt file",
                    "files": "a whole .txt file",
                    "parquet": f"Parquet column {self.column!r} per row",
                    "csv": f"CSV column {self.column!r} per row",
                }[k]
                for k in sorted({u[0] for u in self.units_})
            ),
        ]

    def describe(self) -> str:
        return f"text {self.root} ({len(self.units_)} work units)"

    def units(self) -> list[tuple]:
        return list(self.units_)

    def steps(self) -> list[tuple[str, beam.DoFn]]:
        return [("Tokenize", TokenizeDoFn(self.tokenizer))]

    def read(self, unit):
        """Batches of ``{"text", "id"}`` (tokenized by the next step) with their skips and drops."""
        kind, number = unit[0], unit[1]
        skips = Skips(self.on_error)
        if kind == "files":
            docs = self._files(unit[2], skips)
        elif kind == "parquet":
            docs = self._parquet(unit[2], unit[3], unit[4])
        elif kind == "csv":
            docs = self._csv(unit[2], skips)
        else:
            docs = self._lines(unit[2], kind == "jsonl", skips)
        sub = f"{unit[3]:06d}" if kind == "parquet" else "0"
        chunk, keys, texts, empty, reported = 0, [], [], 0, 0
        for key, text in docs:
            if text is None or not text.strip():
                empty += 1
            else:
                keys.append(key)
                texts.append(text)
            if len(keys) >= BATCH_DOCS:
                yield _batch(f"text-{number:05d}-{sub}-{chunk:06d}", keys, texts, skips.count - reported, empty)
                chunk, keys, texts, empty, reported = chunk + 1, [], [], 0, skips.count
        if keys or empty or skips.count - reported:
            yield _batch(f"text-{number:05d}-{sub}-{chunk:06d}", keys, texts, skips.count - reported, empty)

    def _lines(self, rel: str, jsonl: bool, skips: Skips):
        path = os.path.join(self.root, rel)
        with _open(path) as f:
            for line, raw in enumerate(f, 1):
                if jsonl:
                    if not raw.strip():
                        continue
                    text, why = _json_text(raw, self.field)
                else:
                    try:
                        text, why = raw.decode("utf-8").rstrip("\r\n"), None
                    except UnicodeDecodeError as e:
                        text, why = None, f"not UTF-8 text (byte {e.start} of the line)"
                if why is not None:
                    skips.bad(f"{path}:{line}: {why}")
                    continue
                yield f"{rel}:{line}", text

    def _files(self, rels: tuple[str, ...], skips: Skips):
        for rel in rels:
            path = os.path.join(self.root, rel)
            with _open(path) as f:
                data = f.read()
            try:
                yield rel, data.decode("utf-8")
            except UnicodeDecodeError as e:
                skips.bad(f"{path}: not UTF-8 text (byte {e.start}); convert it to UTF-8 or leave it out")

    def _parquet(self, rel: str, group: int, start: int):
        import pyarrow.parquet as pq

        table = pq.ParquetFile(os.path.join(self.root, rel)).read_row_group(group, columns=[self.column])
        for i, text in enumerate(table.column(self.column).to_pylist()):
            yield f"{rel}:{start + i}", text

    def _csv(self, rel: str, skips: Skips):
        path = os.path.join(self.root, rel)
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter="\t" if rel.lower().endswith(".tsv") else ",")
            head = next(reader, None) or []
            at, width = [h.strip() for h in head].index(self.column), len(head)
            line = reader.line_num
            for row in reader:
                first, line = line + 1, reader.line_num
                if not row:
                    continue
                if len(row) != width:
                    skips.bad(f"{path}:{first}: expected {width} fields, got {len(row)}")
                    continue
                yield f"{rel}:{first}", row[at]


def _batch(batch_id: str, keys: list[str], texts: list[str], skipped: int, empty: int) -> SampleBatch:
    return SampleBatch(
        batch_id, keys, {"text": texts, ID: list(keys)}, skipped=skipped, dropped={EMPTY: empty} if empty else {}
    )


def _json_text(raw: bytes, name: str) -> tuple[str | None, str | None]:
    """``(document, None)`` or ``(None, why the line is bad)``; a null field is an empty document."""
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte {e.start} of the line)"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    if name not in obj:
        return None, f"no field {name!r} (the object has {sorted(obj)[:5]}); name the text field with --field"
    value = obj[name]
    if value is not None and not isinstance(value, str):
        return None, f"field {name!r} holds {type(value).__name__}, not text"
    return value, None


def _open(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _csv_column(path: str, column: str) -> None:
    with open(path, newline="", encoding="utf-8") as f:
        head = next(csv.reader(f, delimiter="\t" if path.lower().endswith(".tsv") else ","), None) or []
    if column not in [h.strip() for h in head]:
        raise ConfigError(f"{path}: no column {column!r} in the header {head}; name the text column with --column")


def _row_groups(path: str, column: str) -> list[tuple[int, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    schema = pf.schema_arrow
    if column not in schema.names:
        raise ConfigError(f"{path}: no column {column!r}; it has {schema.names}; name the text column with --column")
    t = schema.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise ConfigError(f"{path}: column {column!r} is {t}, not text; name a string column with --column")
    out, start = [], 0
    for g in range(pf.num_row_groups):
        out.append((g, start))
        start += pf.metadata.row_group(g).num_rows
    return out


class TokenizeDoFn(beam.DoFn):
    """``{"text", "id"}`` batches → ``{"tokens", "id"}`` batches: the tokenizer is loaded once
    per worker (``setup``) and encodes each batch at once; documents with no ids are dropped and
    counted as empty."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._tok: Any = None  # the tokenizer, opened by setup

    def setup(self):
        self._tok = self.spec.open()

    def process(self, batch: SampleBatch):
        spec = self.spec
        texts = batch.columns["text"]
        encodings = self._encode(texts, batch.keys) if texts else []
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        keep, tokens = [], []
        for i, enc in enumerate(encodings):
            ids = enc.ids
            if spec.eos_id is not None:
                ids = [*ids, spec.eos_id]
            if not ids:
                continue
            keep.append(i)
            tokens.append(np.asarray(ids, dtype=dtype))
        dropped = dict(batch.dropped)
        if len(keep) != len(batch):
            dropped[EMPTY] = dropped.get(EMPTY, 0) + len(batch) - len(keep)
        keys = [batch.keys[i] for i in keep]
        yield SampleBatch(
            batch.batch_id,
            keys,
            {TOKENS: tokens, ID: [batch.columns[ID][i] for i in keep]},
            skipped=batch.skipped,
            dropped=dropped,
        )

    def _encode(self, texts: list[str], keys: list[str]):
        """The batch's encodings; a tokenizer that fails is named with the first document it fails on."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        try:
            return encode(texts, add_special_tokens=self.spec.add_special_tokens)
        except Exception:  # the Rust side raises plain Exceptions
            for key, text in zip(keys, texts):
                try:
                    self._tok.encode(text, add_special_tokens=self.spec.add_special_tokens)
                except Exception as e:
                    raise ConfigError(
                        f"{key}: tokenizer {self.spec.name} cannot encode this document ({e}); fix or replace the "
                        f"tokenizer"
                    ) from e
            raise
