"""Weights files: per-sample integer weights of one split, as their prefix sums, so a plan draws
each sample in proportion to its weight from integers alone (`crossfeed.read.stages.sampler.WeightedOrder`).

A weights set ``NAME`` of a dataset lies in its ``weights/`` directory, beside the manifest:

* ``weights/NAME.SPLIT.cw``: a little-endian ``uint64`` array of ``num_records`` entries in the
  split's record order (shard-major, the global sample numbering), no header: entry ``i`` is
  ``w_0 + … + w_i`` (the inclusive prefix sum). Sample ``i`` owns the ``w_i`` consecutive slots
  ``[cum[i-1], cum[i])`` of the split's *slot space* of ``total = cum[-1]`` slots; slot ``s``
  belongs to sample ``searchsorted(cum, s, side="right")``. A weight of 0 gives no slot: the
  sample is never drawn.
* ``weights/NAME.json``: what the set is and what it pins (`WeightsMeta`): the manifest's
  SHA-256 it was computed from (a set of another version of the dataset is refused), how it was
  made (a feature's values, times ``resolution``, or class balance over a feature), and per split
  the file, its record count, its total and its SHA-256 — the digest a stream's identity names.

The ``.cw`` file is memory-mapped, never read whole: a reader holds O(shards) of it (each shard's
first slot) and pages in the few entries a batch's binary searches touch. Opening it hashes it in
chunks (and checks it never decreases), O(1) memory whatever the split's size.

Weights are integers. A float feature is quantised: ``w = round(value × resolution)`` (default
resolution 1: integer weights as they are; resolution 1000 keeps three decimals). Class balance
gives every record of class ``c`` the weight ``M / count_c`` with ``M`` the least common multiple
of the classes' counts — each class then owns exactly ``M`` slots — or, when that multiple would
overflow the slot space (`MAX_TOTAL`), ``round(SCALE / count_c)``: each class within
``count_c / 2`` slots of ``SCALE`` (a relative error below ``2^-21`` for classes of up to 2^20
records).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from crossfeed.errors import ConfigError, IndexFileError

DTYPE = np.dtype("<u8")
DIR = "weights"
SUFFIX = ".cw"
FORMAT = "crossfeed.weights"
VERSION = 1
MAX_TOTAL = 1 << 62  # slots in a split's slot space (a Feistel permutation over it stays in uint64)
SCALE = 1 << 41  # class balance's slots per class when the exact multiple does not fit
MAX_META_BYTES = 1 << 20
MAX_SPLITS = 1024
MAX_RESOLUTION = 1 << 30
HASH_CHUNK = 1 << 22  # entries hashed and checked at a time
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
KINDS = ("feature", "balance")


def check_weights_name(name) -> str:
    """``name`` if it names a weights set (letters, digits, ``_ . = -``, not leading ``.``/``-``), else `ConfigError`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"a weights set is named by 1 to 128 letters, digits, '_', '.', '=' or '-' (not leading '.' or '-'), "
            f"got {name!r}"
        )
    return name


def balanced(feature: str) -> str:
    """The name of the class-balance weights set over ``feature`` (``crossfeed weights --balance``):
    pass it as ``Loader(..., weights=crossfeed.balanced("label"))``."""
    if not isinstance(feature, str) or not feature:
        raise ConfigError(f"balanced() takes a feature name, got {feature!r}")
    return check_weights_name(f"balance-{feature}")


def meta_path(root: str, name: str) -> str:
    return os.path.join(root, DIR, check_weights_name(name) + ".json")


def file_name(name: str, split: str) -> str:
    """The ``.cw`` file's name (inside ``weights/``) of set ``name`` over ``split``."""
    return f"{check_weights_name(name)}.{split}{SUFFIX}"


def quantise(values, resolution: int = 1, where: str = "weights") -> np.ndarray:
    """Integer weights from numbers: ``round(value × resolution)`` (half to even), each ``>= 0``."""
    arr = np.asarray(values)
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iuf":
        raise ConfigError(f"{where}: weights must be numbers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise ConfigError(f"{where}: a weight is not finite (NaN or infinity)")
        arr = np.rint(arr.astype(np.float64) * resolution)
        if arr.size and arr.max() >= float(MAX_TOTAL):
            raise ConfigError(f"{where}: a weight times resolution {resolution} is past {MAX_TOTAL}")
        return arr.astype(np.int64)
    if arr.size and int(arr.max()) * int(resolution) > MAX_TOTAL:  # Python ints: int64 would wrap around
        raise ConfigError(f"{where}: weight {int(arr.max())} times resolution {resolution} is past {MAX_TOTAL}")
    return arr.astype(np.int64) * int(resolution)


def check_weights(w: np.ndarray, where: str, first: int = 0) -> None:
    """`ConfigError` naming the lowest negative weight of ``w`` (records ``first``, ``first + 1``, …)."""
    if w.size and int(w.min()) < 0:
        at = first + int(np.argmin(w))
        raise ConfigError(f"{where}: weight {int(w.min())} of record {at} is negative; weights are >= 0")


def class_weights(counts: dict) -> dict:
    """``{class: weight}`` giving every class of ``counts`` (``{class: records}``, each ``> 0``)
    the same total weight: exactly (``lcm / count``) where the classes' least common multiple
    keeps the slot space within `MAX_TOTAL`, else ``round(SCALE / count)`` (module docstring)."""
    if not counts:
        raise ConfigError("class balance needs at least one class")
    m = 1
    for c in counts.values():
        m = math.lcm(m, int(c))
        if m * len(counts) > MAX_TOTAL:
            break
    if m * len(counts) <= MAX_TOTAL:
        return {k: m // int(c) for k, c in counts.items()}
    return {k: max(1, round(SCALE / int(c))) for k, c in counts.items()}


@dataclass(frozen=True)
class SplitWeights:
    file: str
    num_records: int
    total: int
    sha256: str


@dataclass(frozen=True)
class WeightsMeta:
    """``weights/NAME.json``: see the module docstring. ``kind``: "feature" (``w = value ×
    resolution``) or "balance" (each class of ``feature`` the same total weight)."""

    name: str
    kind: str
    feature: str
    resolution: int
    manifest_sha256: str
    splits: dict

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "kind": self.kind,
            "feature": self.feature,
            "resolution": self.resolution,
            "manifest_sha256": self.manifest_sha256,
            "splits": {
                k: {"file": s.file, "num_records": s.num_records, "total": s.total, "sha256": s.sha256}
                for k, s in sorted(self.splits.items())
            },
        }

    @classmethod
    def loads(cls, text: bytes, where: str) -> WeightsMeta:
        """Parsed strictly: every field's type and range; problems are `IndexFileError` naming the field."""
        fix = "write the weights again (`crossfeed weights DATASET ...`)"

        def fail(field_: str, what: str):
            raise IndexFileError(f"{where}: {field_}: {what}; {fix}")

        if len(text) > MAX_META_BYTES:
            fail("(file)", f"{len(text)} bytes, more than a weights set's description may hold ({MAX_META_BYTES})")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise IndexFileError(f"{where}: not valid JSON ({e}); {fix}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise IndexFileError(f"{where}: not a crossfeed weights set (format is not {FORMAT!r}); {fix}")
        if d.get("version") != VERSION:
            fail("version", f"{d.get('version')!r}; this crossfeed reads version {VERSION}")
        want = {"format", "version", "name", "kind", "feature", "resolution", "manifest_sha256", "splits"}
        if set(d) != want:
            extra = sorted(set(d) - want)
            fail(extra[0] if extra else sorted(want - set(d))[0], "unknown field" if extra else "missing")
        if not isinstance(d["name"], str) or not _NAME.fullmatch(d["name"]):
            fail("name", f"not a weights set name: {d['name']!r}")
        if d["kind"] not in KINDS:
            fail("kind", f"{d['kind']!r} is not one of {list(KINDS)}")
        if not isinstance(d["feature"], str) or not d["feature"]:
            fail("feature", f"expected a feature name, got {d['feature']!r}")
        res = d["resolution"]
        if type(res) is not int or not 1 <= res <= MAX_RESOLUTION:
            fail("resolution", f"expected an integer in [1, {MAX_RESOLUTION}], got {res!r}")
        if not isinstance(d["manifest_sha256"], str) or not _SHA256.fullmatch(d["manifest_sha256"]):
            fail("manifest_sha256", "expected a sha256 (64 lowercase hex digits)")
        splits_d = d["splits"]
        if not isinstance(splits_d, dict) or not splits_d or len(splits_d) > MAX_SPLITS:
            fail("splits", f"expected an object of 1 to {MAX_SPLITS} splits")
        splits = {}
        for split, s in splits_d.items():
            at = f"splits.{split}"
            if not isinstance(s, dict) or set(s) != {"file", "num_records", "total", "sha256"}:
                fail(at, "expected the fields file, num_records, total, sha256")
            if s["file"] != f"{d['name']}.{split}{SUFFIX}":
                fail(f"{at}.file", f"expected {d['name']}.{split}{SUFFIX}, got {s['file']!r}")
            for key, hi in (("num_records", 1 << 40), ("total", MAX_TOTAL)):
                if type(s[key]) is not int or not 0 <= s[key] <= hi:
                    fail(f"{at}.{key}", f"expected an integer in [0, {hi}], got {s[key]!r}")
            if not isinstance(s["sha256"], str) or not _SHA256.fullmatch(s["sha256"]):
                fail(f"{at}.sha256", "expected a sha256 (64 lowercase hex digits)")
            splits[split] = SplitWeights(s["file"], s["num_records"], s["total"], s["sha256"])
        return cls(d["name"], d["kind"], d["feature"], res, d["manifest_sha256"], splits)


class CumulativeWeights:
    """A split's weights file, memory-mapped and checked (`open`): ``total`` slots,
    ``sample_of(slots)`` the samples owning them, ``shard_slots(counts)`` each shard's slots."""

    def __init__(self, cum: np.ndarray, total: int, digest: str, where: str):
        self.cum, self.total, self.digest, self.where = cum, int(total), digest, where

    @classmethod
    def open(cls, path: str, info: SplitWeights, fix: str = "") -> CumulativeWeights:
        """The file at ``path`` checked against ``info`` (size, SHA-256, never decreasing, its
        last entry the total) in chunks; `IndexFileError` naming the file otherwise, and ``fix``
        (how to write it again)."""
        fix = fix or "write the weights again (`crossfeed weights DATASET ...`)"
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise IndexFileError(f"{path}: cannot read the weights file ({e.strerror or e}); {fix}") from None
        want = info.num_records * DTYPE.itemsize
        if size != want:
            raise IndexFileError(f"{path}: {size} bytes, expected {want} ({info.num_records} records × 8); {fix}")
        cum = np.memmap(path, dtype=DTYPE, mode="r") if want else np.zeros(0, DTYPE)
        h, prev = hashlib.sha256(), 0
        for lo in range(0, len(cum), HASH_CHUNK):
            part = np.asarray(cum[lo : lo + HASH_CHUNK])
            h.update(part.tobytes())
            if int(part[0]) < prev or (len(part) > 1 and (np.diff(part.astype(np.int64)) < 0).any()):
                raise IndexFileError(f"{path}: the prefix sums decrease near entry {lo}; {fix}")
            prev = int(part[-1])
        if h.hexdigest() != info.sha256:
            raise IndexFileError(f"{path}: sha256 differs from the weights set's; {fix}")
        if prev != info.total:
            raise IndexFileError(f"{path}: the weights add up to {prev}, the set says {info.total}; {fix}")
        return cls(cum, info.total, info.sha256, path)

    def __len__(self) -> int:
        return len(self.cum)

    def sample_of(self, slots: np.ndarray) -> np.ndarray:
        """The sample owning each slot (binary searches on the mapped prefix sums)."""
        return np.searchsorted(self.cum, np.asarray(slots, dtype=np.uint64), side="right").astype(np.int64)

    def before(self, i: int) -> int:
        """Slots of the samples before sample ``i``."""
        return 0 if i <= 0 else int(self.cum[i - 1])

    def shard_slots(self, counts) -> np.ndarray:
        """The slots of each run of ``counts`` consecutive samples (a split's shards)."""
        ends = np.cumsum(np.asarray(counts, dtype=np.int64))
        at = np.array([self.before(int(e)) for e in ends], dtype=np.int64)
        return np.diff(np.concatenate([[0], at]))

    def weights_of(self, ids: np.ndarray) -> np.ndarray:
        """The weights of samples ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        hi = self.cum[ids].astype(np.int64)
        lo = np.where(ids > 0, self.cum[np.maximum(ids - 1, 0)].astype(np.int64), 0)
        return hi - lo


def prefix_sums(chunks, where: str):
    """``(prefix-sum chunks, total)`` of integer weight chunks, as a generator of uint64 arrays
    ending with the total (the last item is an ``int``); refuses a negative weight or a total past `MAX_TOTAL`."""
    run = done = 0
    for w in chunks:
        w = np.asarray(w, dtype=np.int64)
        check_weights(w, where, done)
        done += w.size
        if w.size and run + float(w.sum(dtype=np.float64)) > MAX_TOTAL:
            raise ConfigError(f"{where}: the weights add up past {MAX_TOTAL}; lower the resolution")
        c = np.cumsum(w, dtype=np.int64) + run if w.size else w
        if w.size:
            run = int(c[-1])
            if run > MAX_TOTAL:
                raise ConfigError(f"{where}: the weights add up past {MAX_TOTAL}; lower the resolution")
        yield np.ascontiguousarray(c, dtype=DTYPE)
    yield run
