"""Encoding samples as ``tf.train.Example`` bytes: `encode_sample` for one sample, and the
compiled `Encoder` of a schema (built once, cached by `encoder_for`) with batch APIs
(`Encoder.encode_rows`, `Encoder.encode_columns`) that the writer and the Beam job use. The bytes
are always those of `encode_sample_reference`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from crossfeed.errors import SampleSchemaError, SchemaError
from crossfeed.format import example as ex
from crossfeed.format.encode_codec import FeatureCodec, reference_feature
from crossfeed.format.schema import Schema


def encode_sample(schema: Schema, sample: Mapping) -> bytes:
    """Serialise one sample as a ``tf.train.Example`` per ``schema`` (via the schema's compiled
    `Encoder`; the bytes are those of `encode_sample_reference`)."""
    return encoder_for(schema).encode(sample)


def encode_sample_reference(schema: Schema, sample: Mapping) -> bytes:
    """The plain, obviously-correct encoder: the oracle `Encoder` is tested against, and what it
    falls back to for unusual values."""
    missing = [f.name for f in schema if f.name not in sample]
    extra = [k for k in sample if k not in schema.names]
    if missing or extra:
        raise SchemaError(f"sample keys differ from the schema: missing {missing}, unexpected {extra}")
    out: dict[str, tuple[int, bytes]] = {}
    for f in schema:
        reference_feature(f, sample[f.name], out)
    return ex.encode(out)


class Encoder:
    """A schema compiled for encoding: `encode` (one sample), `encode_columns` / `encode_rows` /
    `encode_batch` (many). Bytes are exactly `encode_sample_reference`'s; so are the errors (a
    batch raises `SampleSchemaError` naming the first bad sample, in sample then schema order)."""

    def __init__(self, schema: Schema):
        self.schema = schema
        self.names = schema.names
        self._nameset = frozenset(self.names)
        self._codecs = [FeatureCodec(f) for f in schema]
        order = sorted(s for c in self._codecs for s in c.slots)
        slot = {s: i + 1 for i, s in enumerate(order)}  # entry 0 is the header
        self._nslots = len(order)
        self._plan = [
            (c.f.name, c.one, slot[c.slots[0]] if len(c.slots) == 1 else tuple(slot[s] for s in c.slots))
            for c in self._codecs
        ]
        self._multi = any(len(c.slots) > 1 for c in self._codecs)
        self._slot_index = [[slot[s] - 1 for s in c.slots] for c in self._codecs]

    def encode(self, sample: Mapping) -> bytes:
        """One sample (like `encode_sample`)."""
        if sample.keys() != self._nameset:
            return encode_sample_reference(self.schema, sample)  # raises, naming the missing and extra keys
        entries = [b""] * (self._nslots + 1)
        if self._multi:
            for name, one, slot in self._plan:
                got = one(sample[name])
                if isinstance(slot, int):
                    entries[slot] = got
                else:
                    for s, e in zip(slot, got):
                        entries[s] = e
        else:
            for name, one, slot in self._plan:
                entries[slot] = one(sample[name])  # type: ignore[index]  # not _multi: every slot is an int
        entries[0] = ex.header(sum(map(len, entries)))
        return b"".join(entries)

    def encode_batch(self, data, n: int | None = None) -> list[bytes]:
        """``data`` as ``{name: column}`` (see `encode_columns`) or a sequence of samples."""
        if isinstance(data, Mapping):
            return self.encode_columns(data, n)
        return self.encode_rows(data)

    def encode_rows(self, rows) -> list[bytes]:
        """Samples (mappings) → payloads."""
        rows = rows if isinstance(rows, list) else list(rows)
        ns = self._nameset
        if not all(r.keys() == ns for r in rows):
            self._first_error(rows)
            raise AssertionError("unreachable: a sample's keys differ from the schema")
        return self._encode(None, len(rows), rows)

    def encode_columns(self, columns: Mapping, n: int | None = None) -> list[bytes]:
        """``columns[name][i]`` is feature ``name`` of sample ``i`` (numpy arrays of the values
        stacked, or lists); numeric columns are encoded with a few numpy operations each."""
        if columns.keys() != self._nameset:
            missing = [x for x in self.names if x not in columns]
            extra = [k for k in columns if k not in self._nameset]
            raise SchemaError(f"columns differ from the schema: missing {missing}, unexpected {extra}")
        cols = {}
        for name in self.names:
            c = columns[name]
            if not isinstance(c, (list, np.ndarray)):
                c = [c[i] for i in range(len(c))]
            if n is None:
                n = len(c)
            if len(c) != n:
                raise SchemaError(f"column {name!r} has {len(c)} values, expected {n}")
            cols[name] = c
        return self._encode(cols, n or 0, None)

    def _encode(self, cols, n: int, rows) -> list[bytes]:
        if rows is not None:
            cols = {name: [r[name] for r in rows] for name in self.names}
        if not n:
            return []
        pieces: list = [None] * self._nslots
        lens = np.zeros(n, dtype=np.int64)
        try:
            for c, slots in zip(self._codecs, self._slot_index):
                for s, (plist, ln) in zip(slots, c.encode_column(cols[c.f.name], n)):
                    pieces[s] = plist
                    lens += ln
        except Exception:
            self._first_error(
                rows if rows is not None else [{name: cols[name][i] for name in self.names} for i in range(n)]
            )
            raise
        return list(map(b"".join, zip(ex.headers(lens.tolist()), *(p for plist in pieces for p in plist))))

    def _first_error(self, rows) -> None:
        """Raise what encoding ``rows`` one by one raises first (a `SchemaError` as a `SampleSchemaError`)."""
        for i, r in enumerate(rows):
            try:
                self.encode(r)
            except SchemaError as e:
                raise SampleSchemaError(f"sample {i}: {e}", i, str(e)) from None


_ENCODERS: dict = {}
_BY_ID: dict = {}


def encoder_for(schema: Schema) -> Encoder:
    """The `Encoder` of ``schema``, compiled once per distinct schema."""
    hit = _BY_ID.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    enc = _ENCODERS.get(schema)
    if enc is None:
        if len(_ENCODERS) >= 256:
            _ENCODERS.clear()
        enc = _ENCODERS[schema] = Encoder(schema)
    if len(_BY_ID) >= 256:
        _BY_ID.clear()
    _BY_ID[id(schema)] = (schema, enc)
    return enc
