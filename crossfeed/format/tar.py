"""WebDataset tar shards, read in place: the tar layout, its checks, and samples' values.

A tar is a sequence of 512-byte headers, each followed by its member's data padded to 512
bytes, ended by zero blocks. Each header carries a checksum (the sum of its bytes with the
checksum field read as spaces): the only check tar has — member data has no checksum, so a
damaged payload is caught only by the shard's sha256 (``crossfeed verify``).

WebDataset's sample rule (``webdataset.tariterators``): regular files only, names matching
``__…__`` skipped; a member's *key* is its path up to the first dot of its file name, its
*extension* (lower-cased) the rest; consecutive members with one key form a sample, and each
extension is a feature of the sample (``0001.jpg`` + ``0001.cls`` → ``{"jpg": …, "cls": …}``).

A sample's index entry is the contiguous byte range ``(offset, length)`` holding its members'
headers and data. The ranges tile the file: a sample's range runs to where the next sample's
first header starts (skipped entries such as directories go with the sample before them), and
the last sample's range runs to the end of the file (the end-of-archive zero blocks).

Extensions → features (`infer_feature`): jpg/jpeg/png/webp → image, cls/cls2/index → int64,
txt → str, npy → tensor (dtype and shape from the npy header), anything else → bytes.
"""

from __future__ import annotations

import ast
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from crossfeed.errors import CorruptRecordError, SchemaError
from crossfeed.format import codecs
from crossfeed.format.schema import Feature, decode_image

FORMAT = "tar"  # the manifest's split format of tar shards
BLOCK = 512
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp"})
INT_EXTS = frozenset({"cls", "cls2", "index"})
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_REGULAR = (b"0", b"\0", b"7")
_NPY_MAGIC = b"\x93NUMPY"
_ZERO = bytes(BLOCK)
_OCTAL = re.compile(rb"[0-7]*")
_DIGITS = re.compile(rb"[0-9]+")
_NPY_HEADERS: dict[bytes, tuple] = {}  # parsed .npy headers by their text: a dataset's arrays share a few


def is_tar_name(name: str) -> bool:
    """Whether a file name is a tar shard (``*.tar``; compressed tars are not read in place)."""
    return name.endswith(".tar") and not name.startswith(".")


def split_key(name: str) -> tuple[str | None, str | None]:
    """``(key, extension)`` of a member name by webdataset's rule; ``(None, None)`` without a dot."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2).lower()) if m else (None, None)


@dataclass(frozen=True)
class Member:
    """One tar entry: ``start`` is where its first header starts (a GNU long-name or pax header
    before it included), ``data`` where its data starts, ``size`` its data's length."""

    name: str
    start: int
    data: int
    size: int
    regular: bool

    @property
    def end(self) -> int:
        """Where the next entry's header starts."""
        return self.data + _padded(self.size)


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _octal(field: bytes, what: str, path: str, offset: int) -> int:
    """A numeric header field, strictly (Go's ``archive/tar``): octal digits padded by spaces or
    NULs, or GNU base-256 for large values; a sign, an inner space or any other byte is an error,
    and so is a negative base-256 value — a size is never negative."""
    if field[:1] and field[0] & 0x80:  # GNU base-256 (sizes of 8 GiB and more)
        if field[0] & 0x40:
            raise CorruptRecordError(path, offset, f"tar header's {what} field is a negative base-256 number")
        return int.from_bytes(field[1:], "big") | ((field[0] & 0x3F) << (8 * (len(field) - 1)))
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not _OCTAL.fullmatch(text):
        raise CorruptRecordError(
            path, offset, f"tar header's {what} field {bytes(field)!r} is not octal digits: the header is damaged"
        )
    return int(text, 8) if text else 0


def _decimal(text: bytes, limit: int) -> int | None:
    """A pax decimal: ASCII digits only (no sign, space or ``_``), at most ``limit``; else None."""
    if not _DIGITS.fullmatch(text) or len(text) > 20:
        return None
    n = int(text)
    return n if n <= limit else None


def header_ok(block: bytes) -> bool:
    """Whether a 512-byte header's checksum matches (unsigned sum, or the signed one old tars wrote)."""
    text = block[148:156].split(b"\0", 1)[0].strip(b" ")
    if not text or not _OCTAL.fullmatch(text):
        return False
    stored = int(text, 8)
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32
    if stored == unsigned:
        return True
    s = np.frombuffer(block, dtype=np.int8)
    return stored == int(s.sum()) - int(s[148:156].sum()) + 8 * 32


def members(buf, start: int, end: int, path: str, base: int = 0) -> Iterator[Member]:
    """The entries of ``buf[start:end]`` (a tar, or one sample's range of it), every header's
    checksum and every size checked to fit; stops at the end-of-archive zero block, after which
    only zeros may follow. Raises `CorruptRecordError` naming ``path`` and the header's offset in
    the file (``buf`` starts at byte ``base`` of the file)."""
    view = memoryview(buf)
    pos = start
    long_name: str | None = None
    pax: dict[str, str] = {}
    first = start
    while pos < end:
        if pos + BLOCK > end:
            raise CorruptRecordError(
                path, base + pos, f"a tar header needs 512 bytes, {end - pos} are left: truncated tar"
            )
        block = bytes(view[pos : pos + BLOCK])
        if block == _ZERO:  # end of archive: only zero blocks (and padding) may follow
            rest = view[pos:end]
            if rest.tobytes().count(0) != len(rest):
                raise CorruptRecordError(
                    path, base + pos, "a zero block (end-of-archive marker) inside the archive: the tar is damaged"
                )
            return
        if not header_ok(block):
            raise CorruptRecordError(
                path, base + pos, "tar header checksum mismatch: the header is damaged (re-create or restore the tar)"
            )
        size = _octal(block[124:136], "size", path, base + pos)
        if "size" in pax:
            got = _decimal(pax["size"].encode("utf-8", "surrogateescape"), end)
            if got is None:
                raise CorruptRecordError(
                    path, base + pos, f"pax size {pax['size']!r} is not a decimal number of at most {end} bytes"
                )
            size = got
        kind = block[156:157]
        data = pos + BLOCK
        if data + size > end:
            raise CorruptRecordError(
                path,
                base + pos,
                f"tar member of {size} bytes runs past byte {base + end}: the tar (or its index) is truncated",
            )
        if kind in (b"L", b"x", b"g"):  # GNU long name / pax extended header: applies to the next entry
            body = bytes(view[data : data + size])
            if kind == b"L":
                long_name = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == b"x":
                pax = _pax(body, path, base + pos)
            pos = data + _padded(size)  # size >= 0 (parsed unsigned): pos advances by at least one block
            continue
        if long_name is not None:
            name = long_name
        elif "path" in pax:
            name = pax["path"]
        else:
            name = block[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = block[345:500].split(b"\0", 1)[0] if block[257:262] == b"ustar" else b""
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        yield Member(name, first, data, size, kind in _REGULAR)
        pos = first = data + _padded(size)  # as above: at least one block further
        long_name, pax = None, {}
    if long_name is not None or pax:
        raise CorruptRecordError(path, base + first, "a long-name or pax header with no entry after it: truncated tar")


def _pax(body: bytes, path: str, offset: int) -> dict[str, str]:
    """The records ``"<length> <key>=<value>\\n"`` of a pax extended header, strictly: the length
    is decimal digits, covers at least its own text and stays within the body, so each record
    moves ``i`` forward by at least one byte."""
    out, i = {}, 0
    while i < len(body):
        sp = body.find(b" ", i, i + 21)
        n = _decimal(body[i:sp], len(body) - i) if sp > i else None
        if n is None or n <= sp - i + 1 or body[i + n - 1 : i + n] != b"\n":
            raise CorruptRecordError(path, offset, "malformed pax extended header: a record's length is not its size")
        key, eq, value = body[sp + 1 : i + n - 1].partition(b"=")
        if not eq:
            raise CorruptRecordError(path, offset, "malformed pax extended header: a record has no '='")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        i += n
    return out


def sample_key(m: Member) -> tuple[str, str] | None:
    """``(key, extension)`` of an entry that belongs to a sample, else None (webdataset's rule:
    regular files only, ``__…__`` names skipped, a name without a dot has no key)."""
    if not m.regular or _SKIP_META.match(m.name):
        return None
    key, ext = split_key(m.name)
    return None if key is None or ext is None else (key, ext)  # both None, or neither


def sample_ranges(buf, path: str, on_sample: Callable[[str, dict[str, Member]], None]) -> list[tuple[int, int]]:
    """``(offset, length)`` of every sample of a whole tar (see the module docstring for how the
    ranges tile the file); ``on_sample(key, {extension: member})`` sees each sample in order.
    A duplicate extension within a sample is an error naming the member."""
    size = len(memoryview(buf))
    starts: list[int] = []
    key: str | None = None
    current: dict[str, Member] = {}
    for m in members(buf, 0, size, path):
        got = sample_key(m)
        if got is None:
            continue
        k, ext = got
        if k != key:
            if current and key is not None:  # a sample so far: its key is set
                on_sample(key, current)
            key, current = k, {}
            starts.append(m.start)
        if ext in current:
            raise SchemaError(
                f"{path}: member {m.name!r} at byte offset {m.start}: sample {k!r} already has a {ext!r} member; "
                f"each extension may appear once per sample"
            )
        current[ext] = m
    if current and key is not None:
        on_sample(key, current)
    if starts:
        starts[0] = 0
    bounds = [*starts, size]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(starts))]


def read_sample(buf, offset: int, length: int, path: str, base: int = 0) -> dict[str, memoryview]:
    """``{extension: data}`` of the sample at ``buf[offset:offset + length]``, headers checked
    (``buf`` starts at byte ``base`` of the file ``path``; errors name file offsets). A range
    past the buffer's end (a truncated tar) raises `CorruptRecordError`."""
    view = memoryview(buf)
    if offset < 0 or offset + length > len(view):
        raise CorruptRecordError(
            path,
            base + offset,
            f"the index says the sample is {length} bytes, the file ends at byte {base + len(view)}: it is "
            f"truncated; restore it or rebuild the index with `crossfeed index --force`",
        )
    out: dict[str, memoryview] = {}
    key = None
    for m in members(buf, offset, offset + length, path, base):
        got = sample_key(m)
        if got is None:
            continue
        k, ext = got
        if key is None:
            key = k
        elif k != key:
            raise CorruptRecordError(
                path,
                base + m.start,
                f"member {m.name!r} has key {k!r}, the sample's is {key!r}: the index does not fit the tar",
            )
        out[ext] = view[m.data : m.data + m.size]
    if key is None:
        raise CorruptRecordError(
            path, base + offset, "no sample members at this index entry: the index does not fit the tar"
        )
    return out


# ---- values -----------------------------------------------------------------------------------


def npy_header(data) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """``(dtype, shape, fortran_order, data_offset)`` of ``.npy`` bytes; `SchemaError` if malformed."""
    head = bytes(data[:12])
    if not head.startswith(_NPY_MAGIC) or len(head) < 10:
        raise SchemaError("not a .npy array (no \\x93NUMPY magic)")
    major = head[6]
    if major == 1:
        n, at = int.from_bytes(head[8:10], "little"), 10
    elif major in (2, 3):
        n, at = int.from_bytes(head[8:12], "little"), 12
    else:
        raise SchemaError(f".npy format version {major} is not supported")
    text = bytes(data[at : at + n])
    got = _NPY_HEADERS.get(text)
    if got is not None:
        return got
    try:
        d = ast.literal_eval(text.decode("latin1"))
        dtype = np.dtype(d["descr"])
        shape = tuple(int(x) for x in d["shape"])
        fortran = bool(d["fortran_order"])
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise SchemaError(f"malformed .npy header ({e})") from e
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biufc":
        raise SchemaError(f".npy dtype {dtype} is not a plain numeric dtype")
    got = (dtype, shape, fortran, at + n)
    if len(_NPY_HEADERS) < 1024:
        _NPY_HEADERS[text] = got
    return got


def npy_array(data) -> np.ndarray:
    """The array of ``.npy`` bytes (a zero-copy view when little-endian/native and C-ordered)."""
    dtype, shape, fortran, at = npy_header(data)
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - at != count * dtype.itemsize:
        raise SchemaError(
            f".npy holds {len(data) - at} data bytes, {dtype}{list(shape)} needs {count * dtype.itemsize}"
        )
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=at)
    arr = arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)
    return arr if dtype.isnative else arr.astype(dtype.newbyteorder("="))


def infer_feature(ext: str, data) -> Feature:
    """The feature a member implies from its extension (see the module docstring)."""
    if ext in IMAGE_EXTS:
        return Feature(ext, "uint8", image_shape(data), codecs.IMAGE)
    if ext in INT_EXTS:
        return Feature(ext, "int64", (), codecs.INT64)
    if ext == "txt":
        return Feature(ext, "string", (), codecs.BYTES)
    if ext == "npy":
        dtype, shape, _, _ = npy_header(data)
        return Feature(ext, dtype.newbyteorder("=").name, shape, codecs.TENSOR)
    return Feature(ext, "bytes", (), codecs.BYTES)


def image_shape(data) -> tuple:
    """``(height, width, channels)`` from an image's header (Pillow reads no pixels)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            w, h = im.size
            return (h, w, len(im.getbands()))
    except Exception as e:  # Pillow raises many types for bad data
        raise SchemaError(f"not a readable image ({e})") from e


def widen(old: Feature, new: Feature) -> Feature:
    """One feature covering both: dimensions that differ become ``None``; kinds must agree.
    (Unlike `crossfeed.format.schema.widen`, tensor shapes may vary: each npy member's header
    carries its own shape, where a TFRecord needs a ``/shape`` feature.)"""
    if old == new:
        return old
    if old.encoding != new.encoding or old.dtype != new.dtype or len(old.shape) != len(new.shape):
        raise SchemaError(
            f"{old.encoding.value} {old.dtype}{list(old.shape)} in earlier samples, "
            f"{new.encoding.value} {new.dtype}{list(new.shape)} here; every sample must agree"
        )
    return Feature(
        old.name, old.dtype, tuple(a if a == b else None for a, b in zip(old.shape, new.shape)), old.encoding
    )


def member_value(f: Feature, data, *, decode_images: bool = True):
    """A feature's value from its member's bytes; `SchemaError` when they do not fit ``f``."""
    if f.codec is codecs.IMAGE:
        return decode_image(data, f) if decode_images else bytes(data)
    if f.codec is codecs.INT64:
        try:
            return np.int64(int(bytes(data)))
        except ValueError:
            raise SchemaError(f"{bytes(data[:32])!r} is not an integer") from None
    if f.codec is codecs.TENSOR:
        arr = npy_array(data)
        if np.dtype(f.dtype) != arr.dtype or len(arr.shape) != len(f.shape):
            raise SchemaError(f"holds {arr.dtype}{list(arr.shape)}, the schema says {f.dtype}{list(f.shape)}")
        if any(d is not None and d != s for d, s in zip(f.shape, arr.shape)):
            raise SchemaError(f"holds {arr.dtype}{list(arr.shape)}, the schema says {f.dtype}{list(f.shape)}")
        return arr
    if f.codec is codecs.BYTES and f.shape == ():
        if f.dtype == "string":
            try:
                return bytes(data).decode("utf-8")
            except UnicodeDecodeError as e:
                raise SchemaError(f"not UTF-8 text ({e})") from e
        return bytes(data)
    raise SchemaError(f"a tar member cannot hold a {f.encoding.value} {f.dtype}{list(f.shape)} feature")


def decode_sample(buf, offset: int, length: int, path: str, features, *, decode_images: bool = True, base: int = 0):
    """``{feature: value}`` of the sample at ``buf[offset:offset + length]`` (``buf`` starts at
    byte ``base`` of ``path``). A damaged header raises `CorruptRecordError`; a member that does
    not fit the schema `SchemaError`, both naming ``path`` and the sample's byte offset."""
    return sample_values(
        read_sample(buf, offset, length, path, base),
        features,
        decode_images=decode_images,
        where=lambda: f"{path}: sample at byte offset {base + offset}",
    )


def sample_values(got: dict, features, *, decode_images: bool, where: Callable[[], str]) -> dict:
    """``{feature: value}`` from a sample's ``{extension: data}``; errors start with ``where()``."""
    out = {}
    for f in features:
        data = got.get(f.name)
        if data is None:
            raise SchemaError(f"{where()} has no {f.name!r} member; it has {sorted(got)}")
        try:
            out[f.name] = member_value(f, data, decode_images=decode_images)
        except SchemaError as e:
            raise SchemaError(f"{where()}: member {f.name!r}: {e}") from e
    return out
