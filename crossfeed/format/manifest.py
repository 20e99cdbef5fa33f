"""The manifest: ``crossfeed.json`` at the dataset root, written last and atomically.

It holds the schema, the splits and, per shard, the file name, record count, byte size and
sha256. A directory without it is not a dataset."""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field

from crossfeed.errors import ManifestError
from crossfeed.format.schema import Schema

MANIFEST = "crossfeed.json"
FORMAT = "crossfeed.read.dataset"
VERSION = 1
_SHARD_RE = re.compile(r"^(?P<split>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.tfrecord(?P<gz>\.gz)?$")


def shard_name(split: str, i: int, n: int, *, compress: bool = False) -> str:
    """``train-00003-of-00008.tfrecord`` (``.tfrecord.gz`` when GZIP)."""
    return f"{split}-{i:05d}-of-{n:05d}.tfrecord" + (".gz" if compress else "")


def parse_shard_name(name: str):
    """``(split, i, n, gzip)`` for a conventionally named shard, else None."""
    m = _SHARD_RE.match(os.path.basename(name))
    return (m["split"], int(m["i"]), int(m["n"]), bool(m["gz"])) if m else None


@dataclass(frozen=True)
class ShardInfo:
    file: str  # relative to the dataset root
    num_records: int
    num_bytes: int
    sha256: str

    @property
    def compressed(self) -> bool:
        return self.file.endswith(".gz")


@dataclass(frozen=True)
class SplitInfo:
    name: str
    shards: tuple[ShardInfo, ...]
    statistics: dict = field(default_factory=dict)

    @property
    def num_records(self) -> int:
        return sum(s.num_records for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)


@dataclass(frozen=True)
class Manifest:
    schema: Schema
    splits: dict[str, SplitInfo]
    metadata: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "schema": self.schema.to_json(),
            "splits": {
                name: {
                    "num_records": s.num_records,
                    "num_bytes": s.num_bytes,
                    "shards": [vars(sh) for sh in s.shards],
                    "statistics": s.statistics,
                }
                for name, s in sorted(self.splits.items())
            },
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, d: dict, where: str) -> Manifest:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a crossfeed manifest (format is not {FORMAT!r})")
        if d.get("version") != VERSION:
            raise ManifestError(f"{where}: manifest version {d.get('version')!r}; this crossfeed reads version {VERSION}")
        try:
            splits = {
                name: SplitInfo(name, tuple(ShardInfo(**sh) for sh in s["shards"]), s.get("statistics", {}))
                for name, s in d["splits"].items()
            }
            for name, s in d["splits"].items():
                if s.get("num_records", splits[name].num_records) != splits[name].num_records:
                    raise ManifestError(f"{where}: split {name!r} says {s['num_records']} records, its shards add up to {splits[name].num_records}")
            return cls(Schema.from_json(d["schema"]), splits, d.get("metadata", {}))
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{where}: malformed manifest ({e!r}); rebuild it with `crossfeed index`") from e

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n"


def write_manifest(root: str | os.PathLike, manifest: Manifest) -> None:
    """Write ``crossfeed.json`` atomically: a temporary file in the same directory, fsync, rename."""
    root = os.fspath(root)
    fd, tmp = tempfile.mkstemp(prefix=".crossfeed.json.", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(manifest.dumps())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, MANIFEST))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def loads(text: str, where: str) -> Manifest:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: not valid JSON ({e}); rebuild it with `crossfeed index`") from e
    return Manifest.from_json(d, where)
