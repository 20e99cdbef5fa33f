"""numpy arrays whose first axis is the sample axis: one ``.npz`` (each array a feature), one
``.npy`` (a feature named after the file), a directory of ``.npz`` files with the same arrays
(their samples follow each other), or a directory of ``.npy`` files (each file a feature).

Arrays are memory-mapped, never loaded whole: ``.npy`` files and uncompressed ``.npz`` members
(``np.savez``) through ``np.memmap``, compressed members (``np.savez_compressed``) by streaming
rows from the zip member. A work unit is a row range (a whole file for compressed members). A 1-D
array is a scalar per sample (int64/float/string); more dimensions make a tensor feature.
``label`` names the array stored as ``label``. Keys are ``<file>:<row>``.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import IO

import numpy as np

from crossfeed.beam_jobs.records import SampleBatch
from crossfeed.beam_jobs.sources import list_files
from crossfeed.errors import ConfigError
from crossfeed.format.schema import Schema, infer_feature

TARGET_BATCH_BYTES = 32 << 20


@dataclass(frozen=True)
class NumpySource:
    root: str
    groups: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # (group name, ((feature, "file[::member]"), …))
    lengths: tuple[int, ...]
    features: Schema
    label: str | None = None
    batch_rows: int = 8192

    @classmethod
    def scan(cls, src, *, label: str | None = None, batch_rows: int = 8192) -> NumpySource:
        root, files = list_files(src, (".npy", ".npz"), "numpy")
        npz = [f for f in files if f.endswith(".npz")]
        if npz and len(npz) != len(files):
            raise ConfigError(f"{src}: mixes .npy and .npz files; convert one kind at a time")
        if npz:
            groups = [(f, tuple((name, f"{f}::{name}") for name in _npz_names(os.path.join(root, f)))) for f in files]
        else:
            groups = [("", tuple((os.path.splitext(os.path.basename(f))[0], f) for f in files))]
        schema, lengths = None, []
        for gname, members in groups:
            arrays = {name: open_array(root, where) for name, where in members}
            sizes = {name: a.shape[0] if a.ndim else 0 for name, a in arrays.items()}
            if len(set(sizes.values())) != 1 or not min(sizes.values(), default=0):
                raise ConfigError(
                    f"{gname or src}: arrays must be non-scalar with the same first (sample) axis, got {sizes}"
                )
            lengths.append(next(iter(sizes.values())))
            names = [_name(n, label) for n in arrays]
            feats = Schema(infer_feature(_name(n, label), np.asarray(a[:1])[0]) for n, a in arrays.items())
            _close(arrays.values())
            if schema is None:
                schema = feats
            elif sorted(schema.to_json(), key=str) != sorted(feats.to_json(), key=str):
                raise ConfigError(f"{gname}: arrays {names} differ in name, dtype or shape from {groups[0][0]}'s")
        if schema is None:  # (list_files found files: a group at least)
            raise ConfigError(f"{src}: no arrays to convert")
        if label is not None and "label" not in schema.names:
            raise ConfigError(f"label array {label!r} not found; the arrays are {[n for n, _ in groups[0][1]]}")
        return cls(root, tuple(groups), tuple(lengths), schema, label, batch_rows)

    @property
    def schema(self) -> Schema:
        return self.features

    @property
    def metadata(self) -> dict:
        meta = {"source": "numpy"}
        if self.label is not None:
            meta["label_column"] = self.label
        return meta

    def describe(self) -> str:
        return f"numpy {self.root} ({sum(self.lengths)} samples)"

    def units(self) -> list[tuple[int, int, int]]:
        out = []
        for g, ((_, members), n) in enumerate(zip(self.groups, self.lengths)):
            if any(not _mappable(self.root, where) for _, where in members):
                out.append((g, 0, n))  # compressed: read sequentially in one unit
                continue
            step = self._rows_per_batch(members)
            out += [(g, a, min(a + step, n)) for a in range(0, n, step)]
        return out

    def _rows_per_batch(self, members) -> int:
        row_bytes = sum(open_array(self.root, w)[:1].nbytes for _, w in members)
        return max(1, min(self.batch_rows, TARGET_BATCH_BYTES // max(1, row_bytes)))

    def read(self, unit):
        g, start, stop = unit
        gname, members = self.groups[g]
        arrays = {_name(n, self.label): open_array(self.root, w) for n, w in members}
        step = self._rows_per_batch(members)
        prefix = gname or "row"
        try:
            for a in range(start, stop, step):
                b = min(a + step, stop)
                cols = {n: _column(arr[a:b]) for n, arr in arrays.items()}
                yield SampleBatch(f"numpy-{g:05d}-{a:012d}", [f"{prefix}:{i}" for i in range(a, b)], cols)
        finally:
            _close(arrays.values())


def _close(arrays) -> None:
    for a in arrays:
        if isinstance(a, _StreamedArray):
            a.close()


def _header(f):
    """``(shape, fortran_order, dtype)`` of the ``.npy`` stream ``f``, positioned at its data after."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    return np.lib.format._read_array_header(f, version)  # type: ignore[attr-defined]  # (3, 0): utf-8 field names


def _name(name: str, label: str | None) -> str:
    return "label" if label is not None and name == label else name


def _column(arr: np.ndarray):
    """A batch column: a contiguous copy (picklable, detached from the map); strings as str."""
    if arr.dtype.kind in "US":
        return [str(v) if arr.dtype.kind == "U" else bytes(v) for v in arr.tolist()]
    return np.ascontiguousarray(arr)


def _npz_names(path: str) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return [n[:-4] for n in z.namelist() if n.endswith(".npy")]


def _mappable(root: str, where: str) -> bool:
    path, _, member = where.partition("::")
    if not member:
        return True
    with zipfile.ZipFile(os.path.join(root, path)) as z:
        return z.getinfo(member + ".npy").compress_type == zipfile.ZIP_STORED


def open_array(root: str, where: str):
    """A read-only array view of ``file.npy`` or ``file.npz::member``: a memmap where possible,
    else a `_StreamedArray` for compressed members."""
    path, _, member = where.partition("::")
    path = os.path.join(root, path)
    if not member:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member + ".npy")
        if info.compress_type != zipfile.ZIP_STORED:
            return _StreamedArray(path, member + ".npy")
        with z.open(info) as f:
            shape, fortran, dtype = _header(f)
            header_len = f.tell()
    with open(path, "rb") as raw:  # the member's data starts after its local file header
        raw.seek(info.header_offset + 26)
        name_len, extra_len = np.frombuffer(raw.read(4), dtype="<u2").tolist()
    offset = info.header_offset + 30 + name_len + extra_len + header_len
    if dtype.hasobject:
        raise ConfigError(f"{where}: object arrays cannot be memory-mapped; save numeric or string arrays")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


class _StreamedArray:
    """Row slices of a compressed ``.npz`` member, read forward from the zip stream (rows before
    the last position are re-read only when a slice goes backwards)."""

    def __init__(self, path: str, member: str):
        with zipfile.ZipFile(path) as z, z.open(member) as f:
            self.shape, fortran, self.dtype = _header(f)
        if fortran and len(self.shape) > 1:
            raise ConfigError(f"{path}::{member}: Fortran-ordered compressed arrays cannot be streamed by row")
        self.path, self.member = path, member
        self.ndim = len(self.shape)
        self._row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self._zip: zipfile.ZipFile | None = None
        self._f: IO[bytes] | None = None
        self._pos = 0

    def __getitem__(self, sl: slice) -> np.ndarray:
        a, b, _ = sl.indices(self.shape[0])
        if self._f is None or a < self._pos:
            self.close()
            self._zip = zipfile.ZipFile(self.path)
            self._f = self._zip.open(self.member)
            _header(self._f)
            self._pos = 0
        self._f.read((a - self._pos) * self._row)
        data = self._f.read((b - a) * self._row)
        self._pos = b
        return np.frombuffer(data, dtype=self.dtype).reshape((b - a, *self.shape[1:]))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._zip is not None:
            self._zip.close()
        self._f = self._zip = None
