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

What a hostile or damaged input can do is bounded, and each such input is one bad record naming
its file and line/row (the ``on_error`` policy: raised as one line, or skipped, counted, logged):

* a document (a JSONL, CSV or .txt line, a .txt file, a Parquet value) holds at most
  ``max_document_bytes`` (16 MiB unless told, ``--max-document-bytes``), checked while reading:
  lines are read with a bounded ``readline`` (a 1 GiB line, or a small ``.gz`` holding one, is
  never in memory whole), the rest of a longer line is read past in small pieces;
* JSON nested too deep or with an integer past Python's digit limit, text that is not UTF-8, a
  CSV field past the bound (an ordinary field of a few hundred KB is fine: the csv module's
  field limit is raised to the bound), a damaged gzip stream;
* a Parquet file whose footer does not parse with crossfeed's own bounded reader
  (`crossfeed.format.parquet.footer_row_groups`, before pyarrow trusts it), or a row group
  pyarrow cannot read;
* a token id that does not fit the tokens' dtype: the width comes from the tokenizer's id space
  (its vocabulary, added tokens and post-processor special tokens) unless ``token_dtype`` forces
  one; a document whose ids do not fit is a bad record naming the id and ``--token-dtype``.

Tokenizing is a Beam step of its own (`TokenizeDoFn`): the tokenizer's JSON travels with the
job (its sha256 recorded in the metadata), is loaded once per worker in ``setup`` (on the
in-process runner the tokenizer built when the job was planned: `Tokenizers`) and encodes a
batch of documents at a time (``encode_batch_fast``: the Rust tokenizer's threads). By default
the tokenizer's post-processor adds its special tokens, as ``tokenizer.encode(text)`` does;
``eos`` appends a token (e.g. ``"</s>"``) to every document.
"""

from __future__ import annotations

import array
import contextlib
import csv
import dataclasses
import gzip
import hashlib
import json
import mmap
import os
import threading
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
import numpy as np

from crossfeed.beam_jobs.policy import ErrorPolicy, OnError, Skips
from crossfeed.beam_jobs.records import Ragged, SampleBatch
from crossfeed.beam_jobs.sources import list_files
from crossfeed.config import parse_size
from crossfeed.errors import BadInputError, ConfigError, CorruptRecordError, require
from crossfeed.format import codecs
from crossfeed.format.parquet import check_footer, footer_row_groups
from crossfeed.format.schema import Feature, Schema

JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
TEXT = (".txt", ".txt.gz")
PARQUET = (".parquet", ".pq")
CSV = (".csv", ".tsv")
EMPTY = "empty_documents"  # the reason documents are dropped, in the manifest's dropped_records
TOKENS, ID = "tokens", "id"
BATCH_DOCS = 1024  # documents per batch (one encode_batch call) …
BATCH_TEXT = 16 << 20  # … or fewer, once they hold this many characters (a larger document: a batch of its own)
FILES_PER_UNIT = 256  # whole-file text documents read per work unit
# The default bound of one document (line, row, value or file), in bytes. The Rust tokenizer holds
# about 85 bytes per byte of text while it encodes (5.6 GB for 64 MiB of English), so 16 MiB — a
# long book is 1-2 MiB — keeps one document's encoding near 1.4 GB.
MAX_DOCUMENT_BYTES = 16 << 20
_PAST = 4 << 20  # the piece size in which the rest of an over-long line is read past
TOKEN_DTYPES = ("uint16", "uint32")
_U32 = next(c for c in "IL" if array.array(c).itemsize == 4)  # the array typecode of a native uint32


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
    token_dtype: str | None = None  # forced (``--token-dtype``); None: from ``vocab_size``
    held: bool = False  # its tokenizer is held in this process's memory (`Tokenizers.hold`); no ``text``

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ConfigError(f"tokenizer {self.name}: an empty vocabulary")
        if self.token_dtype is not None and self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(f"--token-dtype {self.token_dtype!r}: use one of {', '.join(TOKEN_DTYPES)}")
        if self.eos_id is not None and not 0 <= self.eos_id < self.vocab_size:
            raise ConfigError(f"tokenizer {self.name}: eos id {self.eos_id} is outside its {self.vocab_size} ids")

    @property
    def dtype(self) -> str:
        """``token_dtype`` when forced, else ``uint16`` when every id fits in 16 bits, else ``uint32``."""
        if self.token_dtype is not None:
            return self.token_dtype
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    @property
    def id_limit(self) -> int:
        """The first id the tokens' dtype cannot hold."""
        return 1 << (16 if self.dtype == "uint16" else 32)

    @classmethod
    def load(
        cls,
        path,
        *,
        add_special_tokens: bool = True,
        eos: str | int | None = None,
        token_dtype: str | None = None,
    ) -> TokenizerSpec:
        """The tokenizer saved at ``path`` (``tokenizer.save(path)``, a ``tokenizer.json``);
        ``eos``: a token (or id) appended to every document; ``token_dtype``: ``uint16`` or
        ``uint32`` forced (default: the narrowest that holds the tokenizer's id space)."""
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
        sha256 = hashlib.sha256(data).hexdigest()
        tok = TOKENIZERS.build(text, sha256, path)
        ids = list(tok.get_vocab(with_added_tokens=True).values()) + _post_processor_ids(text)
        vocab = max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))
        eos_id = None
        if isinstance(eos, str) and not eos.isdigit():
            eos_id = tok.token_to_id(eos)
            if eos_id is None:
                special = [t.content for t in tok.get_added_tokens_decoder().values()][:10]
                raise ConfigError(f"--eos {eos!r}: {path} has no such token; its added tokens are {special}")
        elif eos is not None:
            eos_id = int(eos)
        return cls(
            os.path.basename(path),
            sha256,
            vocab,
            add_special_tokens,
            eos_id,
            text,
            token_dtype,
        )

    def open(self):
        """The tokenizer itself (what a worker's `TokenizeDoFn.setup` calls once): built from
        ``text``, or the one this process built already from the same JSON."""
        if self.held:
            return TOKENIZERS.held(self)
        return TOKENIZERS.build(self.text, self.sha256, self.name)

    def __reduce__(self):
        """Pickled with its JSON zlib-compressed: the runner pickles each step's DoFn and
        bz2-compresses it, which takes about 0.1 s a MB of JSON (a tokenizer's is 1-10 MB)."""
        fields = {
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "add_special_tokens": self.add_special_tokens,
            "eos_id": self.eos_id,
            "token_dtype": self.token_dtype,
            "held": self.held,
        }
        return _unpack_spec, (fields, zlib.compress(self.text.encode("utf-8"), 1))

    def metadata(self) -> dict:
        return {
            "file": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "dtype_forced": self.token_dtype is not None,
            "add_special_tokens": self.add_special_tokens,
            "eos_id": self.eos_id,
        }


def _unpack_spec(fields: dict, packed: bytes) -> TokenizerSpec:
    return TokenizerSpec(**fields, text=zlib.decompress(packed).decode("utf-8"))


def _post_processor_ids(text: str) -> list[int]:
    """The ids a tokenizer JSON's post-processor adds (its special tokens: ``TemplateProcessing``'s
    ``special_tokens``, ``BertProcessing``/``RobertaProcessing``'s ``sep`` and ``cls``, those of a
    ``Sequence``): they need not be in the vocabulary, yet land in the tokens."""
    try:
        proc = json.loads(text).get("post_processor")
    except (ValueError, RecursionError, AttributeError):
        return []  # Tokenizer.from_str has the last word on the file
    out: list[int] = []
    todo, seen = [proc], 0
    while todo and seen < 10_000:
        p, seen = todo.pop(), seen + 1
        if not isinstance(p, dict):
            continue
        todo += [x for x in p.get("processors") or [] if isinstance(x, dict)]
        for pair in (p.get("sep"), p.get("cls")):
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int):
                out.append(pair[1])
        special = p.get("special_tokens")
        for tok in special.values() if isinstance(special, dict) else []:
            ids = tok.get("ids") if isinstance(tok, dict) else None
            out += [i for i in ids or [] if isinstance(i, int) and not isinstance(i, bool)]
    return out


def _from_str(text: str, where: str):
    Tokenizer = require("tokenizers", "crossfeed convert text (Hugging Face tokenizers)").Tokenizer
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises plain Exceptions for a bad file
        raise ConfigError(
            f"--tokenizer {where}: not a tokenizers JSON file ({e}); save one with tokenizer.save(path)"
        ) from e


class Tokenizers:
    """The tokenizers built in this process, by the sha256 of their JSON: the last `KEEP` built,
    and those a job holds. A job whose every step runs in this process (`job.convert` on the
    in-process runner) holds its tokenizer (`hold`): its tokenize step gets the tokenizer built when
    the job was planned, and the step the runner pickles carries the sha256, not the JSON (a
    tokenizer's 1-10 MB, which Beam's pickler compresses with bz2 each time it pickles the step)."""

    KEEP = 2

    def __init__(self):
        self._lock = threading.Lock()
        self._built: OrderedDict[str, tuple[str, Any]] = OrderedDict()  # sha256 -> (JSON, tokenizer)
        self._holds: Counter[str] = Counter()

    def __len__(self) -> int:
        """How many tokenizers are kept."""
        with self._lock:
            return len(self._built)

    def build(self, text: str, sha256: str, where: str):
        """The tokenizer of JSON ``text`` (sha256 ``sha256``): the one built already, or a new one."""
        with self._lock:
            got = self._built.get(sha256)
        if got is not None and got[0] == text:
            return got[1]
        tok = _from_str(text, where)
        with self._lock:
            self._built[sha256] = (text, tok)
            self._built.move_to_end(sha256)
            spare = [s for s in self._built if not self._holds[s]]
            for s in spare[: max(0, len(spare) - self.KEEP)]:
                del self._built[s]
        return tok

    def held(self, spec: TokenizerSpec):
        with self._lock:
            got = self._built.get(spec.sha256) if self._holds[spec.sha256] else None
        if got is None:
            raise ConfigError(
                f"tokenizer {spec.name}: held in the memory of the process that planned the job, which this step "
                f"does not share; run the job on the in-process runner, or ship the tokenizer (TokenizerSpec.load)"
            )
        return got[1]

    @contextlib.contextmanager
    def hold(self, spec: TokenizerSpec):
        """``spec`` as a held `TokenizerSpec` (no JSON) while the block runs, its tokenizer kept here."""
        with self._lock:
            self._holds[spec.sha256] += 1
        try:
            self.build(spec.text, spec.sha256, spec.name)
            yield dataclasses.replace(spec, text="", held=True)
        finally:
            with self._lock:
                self._holds[spec.sha256] -= 1
                if not self._holds[spec.sha256]:
                    del self._holds[spec.sha256]


TOKENIZERS = Tokenizers()  # this process's


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
    max_document_bytes: int = MAX_DOCUMENT_BYTES

    def __post_init__(self):
        if isinstance(self.max_document_bytes, bool) or not isinstance(self.max_document_bytes, int):
            raise ConfigError(f"--max-document-bytes must be a whole number of bytes, got {self.max_document_bytes!r}")
        if self.max_document_bytes < 1:
            raise ConfigError(f"--max-document-bytes must be at least 1, got {self.max_document_bytes}")

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
        token_dtype: str | None = None,
        on_error: ErrorPolicy = ErrorPolicy(),
        max_document_bytes: int | str = MAX_DOCUMENT_BYTES,
    ) -> TextSource:
        """``src``: files, folders (every text input under them), globs, or a list of these;
        ``max_document_bytes``: the most bytes of one document (``"16MiB"`` or a number)."""
        if not field or not column:
            raise ConfigError("--field and --column name a JSON field and a column; they cannot be empty")
        limit = parse_size(max_document_bytes, "--max-document-bytes")
        spec = (
            tokenizer
            if isinstance(tokenizer, TokenizerSpec)
            else TokenizerSpec.load(tokenizer, add_special_tokens=add_special_tokens, eos=eos, token_dtype=token_dtype)
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
            else:
                try:
                    if kind == "csv":
                        _csv_column(path, column, limit)  # the header names it
                        units.append(("csv", number, rel))
                    else:
                        units += [("parquet", number, rel, g, start) for g, start in _row_groups(path, column)]
                except BadInputError as e:  # damaged: one bad record (raised now, or skipped when read)
                    if on_error.mode is OnError.RAISE:
                        raise BadInputError(f"{e} (pass --on-error skip to leave such files out)") from e
                    units.append(("bad", number, rel, str(e)))
        for c in range(0, len(whole), FILES_PER_UNIT):
            units.append(("files", len(files) + c, tuple(whole[c : c + FILES_PER_UNIT])))
        return cls(root, tuple(units), spec, field, column, per_line, on_error, max_document_bytes=limit)

    @property
    def schema(self) -> Schema:
        return Schema(
            [
                Feature(TOKENS, self.tokenizer.dtype, (None,), codecs.TENSOR),
                Feature(ID, "string", (), codecs.BYTES),
            ]
        )

    @property
    def metadata(self) -> dict:
        kinds = sorted({u[0] for u in self.units_} - {"bad"})
        return {
            "source": "text",
            "text": {
                "field": self.field,
                "column": self.column,
                "per_line": self.per_line,
                "inputs": kinds,
                "max_document_bytes": self.max_document_bytes,
            },
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
                for k in sorted({u[0] for u in self.units_} - {"bad"})
            ),
            f"a document holds at most {self.max_document_bytes:,} bytes (--max-document-bytes)",
        ]

    def describe(self) -> str:
        return f"text {self.root} ({len(self.units_)} work units)"

    def units(self) -> list[tuple]:
        return list(self.units_)

    def reader(self) -> TextSource:
        """This source as its read step needs it: without the tokenizer's JSON (its step has it)."""
        return dataclasses.replace(self, tokenizer=dataclasses.replace(self.tokenizer, text=""))

    def steps(self) -> list[tuple[str, beam.DoFn]]:
        return [("Tokenize", TokenizeDoFn(self.tokenizer, self.on_error))]

    @contextlib.contextmanager
    def held(self):
        """This source with its tokenizer held in this process's memory while the block runs, for
        a job whose every step runs in this process (`Tokenizers.hold`)."""
        if self.tokenizer.held:
            yield self
            return
        with TOKENIZERS.hold(self.tokenizer) as spec:
            yield dataclasses.replace(self, tokenizer=spec)

    def read(self, unit):
        """Batches of ``{"text", "id"}`` (tokenized by the next step) with their skips and drops."""
        kind, number = unit[0], unit[1]
        skips = Skips(self.on_error)
        if kind == "files":
            docs = self._files(unit[2], skips)
        elif kind == "bad":  # a file the scan found damaged (under skip)
            skips.bad(unit[3])
            docs = iter(())
        elif kind == "parquet":
            docs = self._parquet(unit[2], unit[3], unit[4], skips)
        elif kind == "csv":
            docs = self._csv(unit[2], skips)
        else:
            docs = self._lines(unit[2], kind == "jsonl", skips)
        sub = f"{unit[3]:06d}" if kind == "parquet" else "0"
        chunk, keys, texts, empty, reported, size = 0, [], [], 0, 0, 0
        for key, text in docs:
            if not text or text.isspace():  # None, empty or whitespace only (strip's whitespace, without its copy)
                empty += 1
            else:
                keys.append(key)
                texts.append(text)
                size += len(text)
            if len(keys) >= BATCH_DOCS or size >= BATCH_TEXT:  # the tokenizer's memory follows a batch's text
                yield _batch(f"text-{number:05d}-{sub}-{chunk:06d}", keys, texts, skips.count - reported, empty)
                chunk, keys, texts, empty, reported, size = chunk + 1, [], [], 0, skips.count, 0
        if keys or empty or skips.count - reported:
            yield _batch(f"text-{number:05d}-{sub}-{chunk:06d}", keys, texts, skips.count - reported, empty)

    def _lines(self, rel: str, jsonl: bool, skips: Skips):
        path = os.path.join(self.root, rel)
        limit = self.max_document_bytes
        with _open(path) as f:
            lines = Lines(f, limit, path) if isinstance(f, gzip.GzipFile) else BlockLines(f, limit, path)
            for raw in _good_lines(lines, skips):
                line = lines.line
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
        limit = self.max_document_bytes
        for rel in rels:
            path = os.path.join(self.root, rel)
            try:
                with _open(path) as f:
                    data = f.read(limit + 1)  # bounded: a small .gz may inflate to GBs
            except (OSError, EOFError, zlib.error) as e:
                skips.bad(f"{path}: not readable ({e})")
                continue
            if len(data) > limit:
                skips.bad(
                    f"{path}: more than {limit:,} bytes of text, the most a document holds (--max-document-bytes)"
                )
                continue
            try:
                yield rel, data.decode("utf-8")
            except UnicodeDecodeError as e:
                skips.bad(f"{path}: not UTF-8 text (byte {e.start}); convert it to UTF-8 or leave it out")

    def _parquet(self, rel: str, group: int, start: int, skips: Skips):
        import pyarrow as pa
        import pyarrow.parquet as pq

        path, limit = os.path.join(self.root, rel), self.max_document_bytes
        try:
            with pq.ParquetFile(path) as pf:
                table = pf.read_row_group(group, columns=[self.column])
            texts = table.column(self.column).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as e:
            skips.bad(f"{path}: row group {group} (rows from {start}) is not readable ({e})")
            return
        for i, text in enumerate(texts):
            if text is not None and len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
                skips.bad(f"{path}:{start + i}: a document of more than {limit:,} bytes (--max-document-bytes)")
                continue
            yield f"{rel}:{start + i}", text

    def _csv(self, rel: str, skips: Skips):
        path = os.path.join(self.root, rel)
        _raise_csv_field_limit(self.max_document_bytes)
        with open(path, "rb") as f:
            lines = Lines(f, self.max_document_bytes, path, decode=True)
            reader = csv.reader(lines, delimiter="\t" if rel.lower().endswith(".tsv") else ",")
            try:
                head = next(reader, None) or []
            except (_BadLine, csv.Error) as e:
                skips.bad(f"{path}:1: the header is not readable ({e})")
                return
            names = [h.strip() for h in head]
            if self.column not in names:
                skips.bad(f"{path}: no column {self.column!r} in the header {head[:20]}")
                return
            at, width = names.index(self.column), len(head)
            while True:
                first = lines.line + 1
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except _BadLine as e:
                    skips.bad(f"{path}:{lines.line}: {e}")
                    continue
                except csv.Error as e:
                    skips.bad(f"{path}:{first}: not valid CSV ({e})")
                    continue
                if not row:
                    continue
                if len(row) != width:
                    skips.bad(f"{path}:{first}: expected {width} fields, got {len(row)}")
                    continue
                yield f"{rel}:{first}", row[at]


class _BadLine(Exception):
    """A line that is no document: longer than the bound, or not UTF-8 (its message says which)."""


class Lines:
    """The lines of an open binary file, each read with a bounded ``readline``: a line longer than
    ``limit`` bytes is never held whole (its rest is read past in small pieces) and raises
    `_BadLine`, as does one that is not UTF-8 when ``decode``; the iteration goes on after either
    (a class, not a generator: a generator that raised is finished), which is what `csv.reader`
    needs to start its next record on the next line. ``line``: the number of the last line read."""

    def __init__(self, f, limit: int, path: str, *, decode: bool = False):
        self.f, self.limit, self.path, self.decode, self.line = f, limit, path, decode, 0
        self._inside = False  # within an over-long line (read past it first: only when going on)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            while self._inside:
                rest = self.f.readline(_PAST)
                self._inside = bool(rest) and not rest.endswith(b"\n")
            raw = self.f.readline(self.limit + 1)
            if not raw:
                raise StopIteration
            self.line += 1
            if len(raw) > self.limit and not raw.endswith(b"\n"):
                self._inside = True
                raise self._too_long()
        except (OSError, EOFError, zlib.error) as e:  # a damaged gzip stream: nothing after it can be read
            raise _Unreadable(f"{self.path}: not readable after line {self.line} ({e})") from e
        return self._text(raw)

    def _too_long(self) -> Exception:
        return _BadLine(
            f"a line of more than {self.limit:,} bytes, longer than a document may be (--max-document-bytes)"
        )

    def _text(self, raw: bytes):
        """The line as read (bytes), or as UTF-8 text with ``decode``."""
        if not self.decode:
            return raw
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _BadLine(f"not UTF-8 text (byte {e.start} of the line)") from None


class BlockLines(Lines):
    """`Lines` of a plain (not gzip) file read a block at a time: the same lines, line numbers
    and errors, without a ``readline`` call and its copy a line. A line is cut from the block it
    lies in; one longer than ``limit`` is never held whole (at most ``limit + 1`` bytes of it, and
    a block) and its rest is read past a block at a time. ``block``: the bytes read at once."""

    block = 1 << 20

    def __init__(self, f, limit: int, path: str, *, decode: bool = False):
        super().__init__(f, limit, path, decode=decode)
        self._buf, self._at, self._eof = b"", 0, False

    def _more(self) -> bool:
        """The next block after what is left unread of this one; False at the end of the file."""
        if self._eof:
            return False
        rest = self._buf[self._at :]
        try:
            got = self.f.read(max(self.block, len(rest)))
        except OSError as e:
            raise _Unreadable(f"{self.path}: not readable after line {self.line} ({e})") from e
        if not got:
            self._eof = True
            return False
        self._buf, self._at = rest + got, 0
        return True

    def __next__(self):
        while self._inside:  # past the rest of an over-long line
            nl = self._buf.find(b"\n", self._at)
            if nl >= 0:
                self._at, self._inside = nl + 1, False
            else:
                self._buf, self._at = b"", 0
                self._inside = self._more()
        while True:
            end = self._at + self.limit + 1
            nl = self._buf.find(b"\n", self._at, end)
            if nl >= 0:
                raw, self._at = self._buf[self._at : nl + 1], nl + 1
                break
            if len(self._buf) >= end:  # limit + 1 bytes and no line end yet
                self.line += 1
                self._at, self._inside = end, True
                raise self._too_long()
            if not self._more():
                if self._at >= len(self._buf):
                    raise StopIteration
                raw, self._at = self._buf[self._at :], len(self._buf)
                break
        self.line += 1
        return self._text(raw)


class _Unreadable(Exception):
    """The rest of a file cannot be read (a damaged gzip stream)."""


def _good_lines(lines: Lines, skips: Skips):
    """The lines of ``lines`` that are not `_BadLine` (those go to ``skips``, named file:line)."""
    while True:
        try:
            yield next(lines)
        except StopIteration:
            return
        except _BadLine as e:
            skips.bad(f"{lines.path}:{lines.line}: {e}")
        except _Unreadable as e:
            skips.bad(str(e))
            return


def _raise_csv_field_limit(limit: int) -> None:
    """Let a CSV field be as long as a document may be (Python's default is 128 KiB: an ordinary
    200 KB document failed); the csv module's limit is one per process, so it only grows."""
    if csv.field_size_limit() < limit:
        csv.field_size_limit(min(limit, (1 << 31) - 1))


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
    except RecursionError:
        return None, "JSON nested too deep to read"
    except ValueError as e:  # an integer past Python's digit limit, and the like
        return None, f"not readable JSON ({e})"
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


def _csv_column(path: str, column: str, limit: int = MAX_DOCUMENT_BYTES) -> None:
    _raise_csv_field_limit(limit)
    with open(path, "rb") as f:
        try:
            head = (
                next(
                    csv.reader(
                        Lines(f, limit, path, decode=True), delimiter="\t" if path.lower().endswith(".tsv") else ","
                    ),
                    None,
                )
                or []
            )
        except (_BadLine, _Unreadable, csv.Error) as e:  # damage (a bad record), not a wrong option
            raise BadInputError(f"{path}:1: the CSV header is not readable ({e})") from None
    if column not in [h.strip() for h in head]:
        raise ConfigError(f"{path}: no column {column!r} in the header {head[:20]}; name the text column with --column")


def _row_groups(path: str, column: str) -> list[tuple[int, int]]:
    """``(row group, its first row)`` of each row group, once crossfeed's bounded footer reader
    and pyarrow agree on the footer (a damaged one is a `BadInputError` naming the file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else contextlib.nullcontext(b"") as buf:
            try:  # before pyarrow: it trusts what a footer says
                groups, damage = footer_row_groups(buf, path), None
            except CorruptRecordError as e:  # kept as text: its frames hold views of the map
                groups, damage = (), str(e)
    if damage is not None:
        raise BadInputError(damage)
    try:
        with pq.ParquetFile(path) as pf:
            check_footer(groups, pf.metadata, path)
            schema = pf.schema_arrow
    except CorruptRecordError as e:
        raise BadInputError(str(e)) from e
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, FileNotFoundError | PermissionError):
            raise
        raise BadInputError(f"{path}: not a readable Parquet file ({e})") from e
    if column not in schema.names:
        raise ConfigError(f"{path}: no column {column!r}; it has {schema.names}; name the text column with --column")
    t = schema.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise ConfigError(f"{path}: column {column!r} is {t}, not text; name a string column with --column")
    out, start = [], 0
    for g, (rows, _) in enumerate(groups):
        out.append((g, start))
        start += rows
    return out


class TokenizeDoFn(beam.DoFn):
    """``{"text", "id"}`` batches → ``{"tokens", "id"}`` batches: the tokenizer is loaded once
    per worker (``setup``) and encodes each batch at once; documents with no ids are dropped and
    counted as empty."""

    def __init__(self, spec: TokenizerSpec, on_error: ErrorPolicy = ErrorPolicy()):
        self.spec = spec
        self.on_error = on_error
        self._tok: Any = None  # the tokenizer, opened by setup

    def setup(self):
        self._tok = self.spec.open()

    def process(self, batch: SampleBatch):
        spec = self.spec
        texts = batch.columns["text"]
        ids = self._encode(texts, batch.keys) if texts else []
        n = len(ids)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=n)
        wide = [x for x in ids if isinstance(x, np.ndarray)]
        flat = np.concatenate(wide) if wide else np.zeros(0, np.uint32)
        if len(wide) < n:  # an id past 32 bits: its document's ids left out of the batch's array
            narrow = np.fromiter(map(lambda x: isinstance(x, np.ndarray), ids), dtype=bool, count=n)
            flat_lengths = np.where(narrow, lengths, 0)
        else:
            narrow, flat_lengths = None, lengths
        if spec.eos_id is not None:  # the eos id after each document's ids
            flat = np.insert(flat, np.cumsum(flat_lengths), np.uint32(spec.eos_id))
            lengths, flat_lengths = lengths + 1, flat_lengths + 1
        bad = np.zeros(n, dtype=bool) if narrow is None else ~narrow
        if len(flat) and int(flat.max()) >= spec.id_limit:  # the documents holding an id the dtype cannot hold
            ends = np.cumsum(flat_lengths)
            bad[np.searchsorted(ends, np.flatnonzero(flat >= spec.id_limit), side="right")] = True
        empty = lengths == 0
        n_empty = int(np.count_nonzero(empty))
        skips = Skips(self.on_error)
        for i in np.flatnonzero(bad).tolist():
            doc = [
                *(ids[i] if isinstance(ids[i], list) else ids[i].tolist()),
                *([spec.eos_id] if spec.eos_id is not None else []),
            ]
            top = max(doc)
            how = "--token-dtype" if spec.token_dtype is not None else "chosen from its vocabulary size"
            skips.bad(
                f"{batch.keys[i]}: tokenizer {spec.name} gave id {top if top >= spec.id_limit else min(doc):,}, "
                f"which {spec.dtype} tokens cannot hold ({spec.dtype} {how}); pass --token-dtype uint32"
            )
        keep = ~(bad | empty)
        if not keep.all():
            flat = flat[np.repeat(keep, flat_lengths)]
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        tokens = Ragged(flat.astype(dtype, copy=False), lengths[keep])
        dropped = dict(batch.dropped)
        if n_empty:
            dropped[EMPTY] = dropped.get(EMPTY, 0) + n_empty
        kept = np.flatnonzero(keep).tolist()
        keys = [batch.keys[i] for i in kept]
        yield SampleBatch(
            batch.batch_id,
            keys,
            {TOKENS: tokens, ID: [batch.columns[ID][i] for i in kept]},
            skipped=batch.skipped + skips.count,
            dropped=dropped,
        )

    def _encode(self, texts: list[str], keys: list[str]) -> list:
        """Each document's ids as a ``uint32`` array (its id list where an id does not fit 32
        bits); a tokenizer that fails is named with the first document it fails on."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        try:
            encodings = encode(texts, add_special_tokens=self.spec.add_special_tokens)
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
        return [_uint32(enc.ids) for enc in encodings]


def _uint32(ids: list):
    """A document's ids (the Rust tokenizer's are u32) as a uint32 array — one C conversion,
    ``array``'s (1.6× numpy's) — or, where one is under 0 or past 32 bits, the list itself."""
    try:
        return np.frombuffer(array.array(_U32, ids), dtype=np.uint32)
    except OverflowError:
        return ids
