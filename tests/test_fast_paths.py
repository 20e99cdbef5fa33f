"""The Loader's fast paths, pinned value for value by an oracle that shares no code with them
(STYLE.md habit 16): the columnar small-record path (`fetch_rows` → `Layout.cut`, with
`copy_big_rows` for values ≥ 512 bytes), the big-value copy of large records (`copy_big`), the
buffer recycler, the batched CRC and header checks, and the libjpeg-turbo JPEG path.

The oracle below walks the TFRecord framing and the protobuf wire format itself (struct and a
40-line varint walker — no crossfeed code), and decodes JPEGs with Pillow. Each test runs at the
sizes where its path switches on: framed records ≤ 4096 bytes for the columnar path, values of
508 / 512 / 516 bytes around the big-value threshold, batch arrays ≥ 1 MiB for the recycler.
`benchmarks/mutate_fast_paths.py` breaks each path on purpose and checks that a test here fails.
"""

from __future__ import annotations

import io
import os
import shutil
import struct

import numpy as np
import pytest
from PIL import Image, features

import crossfeed
from crossfeed import Encoding, Feature, ReadOptions, Schema

CODES = (0, 127, 128, 2**40, -1)  # varints of 1, 1, 2, 6 and 10 bytes
SHUFFLES = ("none", "global", "block")


# ---- the oracle: TFRecord framing + tf.train.Example, walked by hand ----------------------------


def _varint(b: bytes, p: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        c = b[p]
        p += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return v, p


def _fields(b: bytes):
    """Yields ``(field_number, wire_type, value)``: an int for varints, bytes otherwise."""
    p = 0
    while p < len(b):
        key, p = _varint(b, p)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, p = _varint(b, p)
        elif wire == 2:
            n, p = _varint(b, p)
            v, p = b[p : p + n], p + n
        elif wire == 5:
            v, p = b[p : p + 4], p + 4
        elif wire == 1:
            v, p = b[p : p + 8], p + 8
        else:
            raise ValueError(f"wire type {wire}")
        yield num, wire, v


def parse_example(payload: bytes) -> dict[str, tuple[int, list]]:
    """``{name: (kind, values)}``: kind 1 bytes (list of bytes), 2 float (list of 4-byte
    little-endian chunks), 3 int64 (list of Python ints)."""
    out = {}
    for _, _, feats in _fields(payload):  # Example.features = 1
        for _, _, entry in _fields(feats):  # Features.feature = 1 (map entries)
            parts = {n: v for n, _, v in _fields(entry)}
            kind, values = 0, []
            for kind, _, lst in _fields(parts.get(2, b"")):
                for _, wire, v in _fields(lst):
                    if kind == 1:
                        values.append(bytes(v))
                    elif kind == 2:
                        values += [v[i : i + 4] for i in range(0, len(v), 4)]
                    elif wire == 2:  # packed int64
                        p = 0
                        while p < len(v):
                            x, p = _varint(v, p)
                            values.append(x - (1 << 64) if x >= 1 << 63 else x)
                    else:
                        values.append(v - (1 << 64) if v >= 1 << 63 else v)
            out[parts[1].decode()] = (kind, values)
    return out


def read_frames(path) -> list[bytes]:
    """Payloads of a plain TFRecord file, by its framing alone (no CRC check)."""
    with open(path, "rb") as f:
        data = f.read()
    out, p = [], 0
    while p < len(data):
        (n,) = struct.unpack_from("<Q", data, p)
        out.append(data[p + 12 : p + 12 + n])
        p += 12 + n + 4
    return out


def oracle_value(f: Feature, kind_values):
    _, values = kind_values
    shape = [-1 if d is None else d for d in f.shape]
    if f.encoding is Encoding.TENSOR:
        (raw,) = values
        return np.frombuffer(raw, np.dtype(f.dtype).newbyteorder("<")).astype(f.dtype).reshape(f.shape)
    if f.encoding is Encoding.INT64:
        return np.array(values, dtype=np.int64).reshape(shape)
    if f.encoding is Encoding.FLOAT:
        return np.frombuffer(b"".join(values), "<f4").astype(np.float32).reshape(shape)
    if f.encoding is Encoding.IMAGE:
        with Image.open(io.BytesIO(values[0])) as im:
            arr = np.asarray(im)
        return arr[:, :, None] if arr.ndim == 2 else arr
    return values[0]


def oracle(root, split: str = "train") -> list[dict]:
    """Every sample of a split in global index order (shard order), decoded by the oracle."""
    with crossfeed.open_dataset(root) as ds:
        sp = ds[split]
        paths = [sp.file(s).path for s in range(len(sp.counts))]
        schema = ds.schema
    out = []
    for p in paths:
        for payload in read_frames(p):
            parsed = parse_example(payload)
            out.append({f.name: oracle_value(f, parsed[f.name]) for f in schema})
    return out


def assert_batch(batch: dict, ref: list[dict], names) -> None:
    idx = batch["__index__"]
    for k in names:
        want = np.stack([ref[i][k] for i in idx.tolist()])
        got = batch[k]
        assert got.dtype == want.dtype and got.shape == want.shape, (k, got.dtype, got.shape, want.dtype, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"feature {k!r}, samples {idx.tolist()[:8]}…")


def check_epochs(
    root, ref, *, batch_size: int, shuffle: str, epochs: int = 1, features=None, paths=None, **kw
) -> list[dict]:
    """Read ``epochs`` epochs, compare every batch with the oracle, check each sample comes once
    per epoch; returns the batches (kept alive throughout: the recycler must not reuse them).
    ``paths``: a dict that receives the Loader's `paths()` (which fast paths served)."""
    kept = []
    with crossfeed.Loader(
        root, batch_size=batch_size, shuffle=shuffle, seed=3, return_index=True, features=features, **kw
    ) as loader:
        names = features or loader.dataset.schema.names
        for _ in range(epochs):
            seen = []
            for b in loader:
                assert_batch(b, ref, names)
                seen.append(b["__index__"])
                kept.append(b)
            assert sorted(np.concatenate(seen).tolist()) == list(range(len(ref)))
        if paths is not None:
            paths.update(loader.paths())
    return kept


# ---- datasets ----------------------------------------------------------------------------------


def _common(i: int, rng) -> dict:
    return {
        "label": 2**20 + i,  # a 3-byte varint in every record
        "code": CODES[i % len(CODES)],  # 1, 2, 6 or 10 bytes: records of slightly different lengths
        "score": np.float32(rng.standard_normal()),
        "v508": rng.integers(0, 256, 508, dtype=np.uint8),  # just under the big-value threshold
        "v512": rng.integers(0, 256, 512, dtype=np.uint8),  # at it
        "v516": rng.standard_normal(129).astype(np.float32),  # just over it (129 × 4 bytes)
    }


COMMON = [
    Feature("label", "int64", (), Encoding.INT64),
    Feature("code", "int64", (), Encoding.INT64),
    Feature("score", "float32", (), Encoding.FLOAT),
    Feature("v508", "uint8", (508,), Encoding.TENSOR),
    Feature("v512", "uint8", (512,), Encoding.TENSOR),
    Feature("v516", "float32", (129,), Encoding.TENSOR),
]
SMALL = Schema([*COMMON, Feature("emb", "float32", (4,), Encoding.FLOAT)])
BIG = Schema(
    [
        *COMMON,
        Feature("img", "uint8", (64, 64, 3), Encoding.TENSOR),
        Feature("imgf", "float32", (64, 64, 3), Encoding.TENSOR),
    ]
)


def small_samples(n: int):
    rng = np.random.default_rng(1)
    for i in range(n):
        yield {**_common(i, rng), "emb": rng.standard_normal(4).astype(np.float32)}


def big_samples(n: int):
    rng = np.random.default_rng(2)
    for i in range(n):
        yield {
            **_common(i, rng),
            "img": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "imgf": rng.standard_normal((64, 64, 3)).astype(np.float32),
        }


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """600 records of ~1.7 KB (framed ≤ 4096 bytes: the columnar path) in 5 shards."""
    root = tmp_path_factory.mktemp("fast") / "small"
    crossfeed.write_dataset(root, small_samples(600), num_shards=5, schema=SMALL).close()
    return root, oracle(root)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """180 records of ~62 KB (the big-value copy) in 3 shards; a batch of 32 `imgf` is 1.5 MiB."""
    root = tmp_path_factory.mktemp("fast") / "big"
    crossfeed.write_dataset(root, big_samples(180), num_shards=3, schema=BIG).close()
    return root, oracle(root)


def test_oracle_agrees_with_the_samples_written(small):
    """The oracle itself is right: it gives back exactly what was written."""
    _, ref = small
    with crossfeed.open_dataset(small[0]) as ds:
        counts = ds["train"].counts.tolist()
    # write_dataset deals samples round-robin: shard s holds samples s, s + 5, …
    order = [s + 5 * k for s, c in enumerate(counts) for k in range(c)]
    written = list(small_samples(600))
    for g in (0, 1, 2, 3, 4, 127, 128, 599):
        want = written[order[g]]
        for k, v in want.items():
            np.testing.assert_array_equal(ref[g][k], np.asarray(v, dtype=ref[g][k].dtype))
    assert {int(r["code"]) for r in ref} == set(CODES)


# ---- the columnar small-record path --------------------------------------------------------------


@pytest.mark.parametrize("shuffle", SHUFFLES)
@pytest.mark.parametrize("batch_size", [1, 7, 32, 256])
def test_columnar_path_matches_oracle(small, shuffle, batch_size):
    root, ref = small
    check_epochs(root, ref, batch_size=batch_size, shuffle=shuffle)


def test_columnar_path_batch_spanning_every_shard(small):
    root, ref = small
    check_epochs(root, ref, batch_size=599, shuffle="none", epochs=2)  # 1st batch spans all 5 shards, 2nd is 1 record
    check_epochs(root, ref, batch_size=600, shuffle="global")


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_clean_small_records_never_leave_the_rows_form(small, shuffle):
    """The rows form is the path that runs, not a fallback that happens to agree: on clean data no
    batch is handed to the exact per-record path, and batches spanning every shard come out of
    the one-array gather (`Span`) in batch order."""
    root, ref = small
    for batch_size, epochs in ((64, 2), (600, 1)):
        paths: dict = {}
        check_epochs(root, ref, batch_size=batch_size, shuffle=shuffle, epochs=epochs, paths=paths)
        assert "exact" not in paths["frames"] and "parsed" not in paths["decode"], paths
        assert set(paths["frames"]) <= {"rows", "whole", "whole_fixup"}, paths


def test_a_split_held_whole_is_read_without_shard_lookups(small):
    """Once every shard is mapped, a batch's entries are one gather from `Whole`'s table (span
    offset, length, room left in the shard): from then on every batch is served there — one with
    a record too near its shard's end for the batch's row width through the fix-up path — and
    every batch equals the oracle's."""
    root, ref = small
    paths: dict = {}
    check_epochs(root, ref, batch_size=64, shuffle="global", epochs=2, paths=paths)
    frames = paths["frames"]
    assert "whole_declined" not in frames and "exact" not in frames, frames
    assert frames.get("whole", 0) + frames.get("whole_fixup", 0) >= 600 // 64, frames
    assert frames.get("whole_fixup", 0) > 0, (
        "no batch had a record near its shard's end (the last records are shortest)"
    )


def test_feature_subset_matches_oracle(small):
    """(Today a subset makes the fixed-layout path step aside: the values of the features left out
    count as layout bytes, which differ between records. The values must be right either way.)"""
    root, ref = small
    check_epochs(root, ref, batch_size=64, shuffle="global", features=["v512", "code"])
    check_epochs(root, ref, batch_size=64, shuffle="none", features=["v516", "label"])


def test_split_random_access_agrees(small):
    """The dataset's own record-by-record access gives the oracle's values too."""
    root, ref = small
    with crossfeed.open_dataset(root) as ds:
        sp = ds["train"]
        for i in (0, 1, 119, 120, 121, 599):
            for k, v in sp[i].items():
                np.testing.assert_array_equal(np.asarray(v), ref[i][k])
                assert np.asarray(v).dtype == ref[i][k].dtype


def test_int64_vectors_whose_varint_widths_differ_at_equal_length(tmp_path):
    """Records of one length whose int64 vector splits its bytes differently ([128, 0] is 2 + 1
    bytes, [0, 128] is 1 + 2): one layout cannot cut both; the varint continuation check must see it."""
    rng = np.random.default_rng(5)
    pairs = [[128, 0], [0, 128], [2**40, 1], [1, 2**40], [-1, 0], [0, -1], [127, 128], [128, 127]]
    samples = [
        {"ids": np.array(pairs[i % len(pairs)], np.int64), "x": rng.integers(0, 256, 16, dtype=np.uint8)}
        for i in range(96)
    ]
    schema = Schema([Feature("ids", "int64", (2,), Encoding.INT64), Feature("x", "uint8", (16,), Encoding.TENSOR)])
    root = tmp_path / "pairs"
    crossfeed.write_dataset(root, samples, num_shards=2, schema=schema).close()
    ref = oracle(root)
    for shuffle in ("none", "global"):
        for b in (2, 8, 96):
            check_epochs(root, ref, batch_size=b, shuffle=shuffle)


# ---- large records: the big-value copy and the recycler -----------------------------------------


@pytest.mark.parametrize("shuffle", SHUFFLES)
@pytest.mark.parametrize("batch_size", [1, 7, 32, 128])
def test_big_value_copy_matches_oracle(big, shuffle, batch_size):
    root, ref = big
    check_epochs(root, ref, batch_size=batch_size, shuffle=shuffle)


def test_recycler_never_hands_out_a_live_batch(big):
    """Every batch of three epochs kept alive (1.5 MiB `imgf` arrays, 2 threads, prefetch 2),
    then all compared with the oracle at the end: a recycled array still in use would show."""
    root, ref = big
    kept = check_epochs(
        root, ref, batch_size=32, shuffle="global", epochs=3, read=ReadOptions(num_threads=2, prefetch=2)
    )
    assert len(kept) == 3 * 6
    assert len({id(b["imgf"]) for b in kept}) == len(kept)
    for b in kept:
        assert_batch(b, ref, BIG.names)


def test_recycler_generic_path_batches_stay_intact(big):
    """The record-by-record path (a bytes feature in the request) allocates through the recycler too."""
    root = big[0]
    samples = list(big_samples(180))
    # a ragged int64 list breaks the fixed layout: the generic path builds these batches
    rag = Schema([*BIG, Feature("tags", "int64", (None,), Encoding.INT64)])
    root2 = root.parent / "big_ragged"
    if not root2.exists():
        crossfeed.write_dataset(
            root2, ({**s, "tags": list(range(i % 3))} for i, s in enumerate(samples)), num_shards=3, schema=rag
        ).close()
    ref2 = oracle(root2)
    kept = []
    with crossfeed.Loader(
        root2,
        batch_size=32,
        shuffle="global",
        seed=1,
        return_index=True,
        features=["imgf", "tags"],
        read=ReadOptions(num_threads=2, prefetch=2),
    ) as loader:
        for _ in range(2):
            kept += list(loader)
    for b in kept:
        assert_batch(b, ref2, ["imgf"])
        for i, t in zip(b["__index__"].tolist(), b["tags"]):
            np.testing.assert_array_equal(t, ref2[i]["tags"])


def test_batch_kept_while_the_next_epoch_runs_stays_intact(big):
    root, ref = big
    with crossfeed.Loader(
        root, batch_size=32, shuffle="global", seed=0, return_index=True, read=ReadOptions(num_threads=2, prefetch=2)
    ) as loader:
        first = next(iter(loader))  # the generator is dropped: the rest of epoch 0 is abandoned
        snapshot = {k: v.copy() for k, v in first.items()}
        loader.set_epoch(1)
        for _ in range(2):
            for _b in loader:  # nothing else holds these: their arrays may be recycled
                pass
        for k, v in snapshot.items():
            np.testing.assert_array_equal(first[k], v)
        assert_batch(first, ref, BIG.names)


# ---- frame checks: corruption is reported, never delivered -------------------------------------


def _corrupt(src, dst, shard: int, record: int, at: int, new: bytes | None) -> None:
    """Copy dataset ``src`` to ``dst`` and overwrite bytes at offset ``at`` of one framed record
    with ``new`` (None: invert the byte there)."""
    shutil.copytree(src, dst)
    with crossfeed.open_dataset(dst) as ds:
        sp = ds["train"]
        path = sp.file(shard).path
        off = int(sp.index(shard)[record][0])
    with open(path, "r+b") as f:
        f.seek(off + at)
        old = f.read(len(new or b"x"))
        f.seek(off + at)
        f.write(new if new is not None else bytes(b ^ 0xFF for b in old))  # None: invert the byte
    assert new is None or new != old


def _read_all(root, shuffle: str, batch_size: int) -> None:
    with crossfeed.Loader(root, batch_size=batch_size, shuffle=shuffle, seed=0) as loader:
        for _ in loader:
            pass


@pytest.mark.parametrize("which", ["small", "big"])
@pytest.mark.parametrize("shuffle", ["none", "global"])
def test_a_payload_byte_flipped_is_reported(request, tmp_path, which, shuffle):
    """One byte inside a value flipped (header intact, the record's layout still fits): the
    payload CRC check is all that can see it."""
    root, ref = request.getfixturevalue(which)
    with crossfeed.open_dataset(root) as ds:
        sp = ds["train"]
        off, length = (int(x) for x in sp.index(1)[3])
        with open(sp.file(1).path, "rb") as f:
            payload = f.read(off + length)[off + 12 : off + length - 4]
    at = payload.find(ref[int(sp.starts[1]) + 3]["v508"].tobytes())
    assert at > 0
    bad = tmp_path / "bad"
    _corrupt(root, bad, shard=1, record=3, at=12 + at + 10, new=None)
    with pytest.raises(crossfeed.CorruptRecordError):
        _read_all(bad, shuffle, 64)


@pytest.mark.parametrize("shuffle", ["none", "global"])
def test_a_big_record_whose_crc_is_checked_at_the_copy_is_named_or_skipped(big, tmp_path, shuffle):
    """Big records' payload CRCs are taken as the decoder copies them (`Frames.unchecked`): a
    flipped byte there is still a `CorruptRecordError` naming the shard and the record's offset,
    and with ``on_error="skip"`` exactly that record is dropped, every other value intact."""
    from crossfeed.read.stages.frames import FrameReader

    root, ref = big
    bad = tmp_path / "bad"
    _corrupt(root, bad, shard=2, record=5, at=12 + 3000, new=None)
    with crossfeed.open_dataset(bad) as ds:
        sp = ds["train"]
        off, gid = int(sp.index(2)[5][0]), int(sp.starts[2]) + 5
        frames = FrameReader(sp)(np.arange(len(sp)), defer_crc=True)
        assert frames.unchecked is not None  # the big records' CRCs really are left to the decoder
    with pytest.raises(crossfeed.CorruptRecordError) as e:
        _read_all(bad, shuffle, 32)
    assert e.value.offset == off and e.value.path.endswith(os.path.basename(sp.file(2).path))
    seen = []
    with crossfeed.Loader(bad, batch_size=32, shuffle=shuffle, seed=0, return_index=True, on_error="skip") as ld:
        for b in ld:
            assert_batch(b, ref, ld.dataset.schema.names)
            seen += b["__index__"].tolist()
    assert sorted(seen) == [i for i in range(len(ref)) if i != gid]


@pytest.mark.parametrize("shuffle", ["none", "global"])
def test_a_length_header_that_disagrees_with_the_index_is_reported(small, tmp_path, shuffle):
    """The length field says one byte more than the index (its CRC still that of the true
    length): only the header length check can see it."""
    root, _ = small
    with crossfeed.open_dataset(root) as ds:
        sp = ds["train"]
        n = int(sp.index(2)[5][1]) - 16
    bad = tmp_path / "bad"
    _corrupt(root, bad, shard=2, record=5, at=0, new=struct.pack("<Q", n + 1))
    with pytest.raises(crossfeed.CorruptRecordError):
        _read_all(bad, shuffle, 64)


# ---- JPEG: libjpeg-turbo straight into the batch, vs Pillow -------------------------------------


def _jpeg(arr: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="JPEG", quality=90)
    return b.getvalue()


def _smooth(rng, h, w, c) -> np.ndarray:
    small = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    arr = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.int16)
    arr = np.clip(arr + rng.integers(-10, 11, arr.shape), 0, 255).astype(np.uint8)
    return arr if c == 3 else arr[:, :, 0]


# both simplejpeg and this Pillow decode with libjpeg-turbo's default (islow DCT, fancy
# upsampling): identical output. Another libjpeg may round differently by a step or two.
JPEG_ATOL = 0 if features.check_feature("libjpeg_turbo") else 2


def _assert_images(batch, ref, name="image"):
    for i, got in zip(batch["__index__"].tolist(), batch[name]):
        want = ref[i][name]
        assert got.dtype == np.uint8 and got.shape == want.shape, (i, got.shape, want.shape)
        if JPEG_ATOL:
            assert int(np.abs(got.astype(np.int16) - want).max()) <= JPEG_ATOL
        else:
            np.testing.assert_array_equal(got, want)


def test_jpeg_batches_equal_pillow_decoding(tmp_path):
    """Colour JPEGs of one size (decoded straight into a ≥ 1 MiB batch array), with an
    odd-sized and a grayscale image in the mix (the per-image path); all batches kept alive."""
    rng = np.random.default_rng(9)
    imgs = [_smooth(rng, 64, 64, 3) for _ in range(300)]
    imgs[150] = _smooth(rng, 37, 51, 3)
    imgs[151] = _smooth(rng, 40, 30, 1)
    samples = [{"image": _jpeg(a), "label": i} for i, a in enumerate(imgs)]
    schema = Schema(
        [Feature("image", "uint8", (None, None, None), Encoding.IMAGE), Feature("label", "int64", (), Encoding.INT64)]
    )
    root = tmp_path / "jpeg"
    crossfeed.write_dataset(root, samples, num_shards=2, schema=schema).close()
    ref = oracle(root)
    assert ref[0]["image"].shape == (64, 64, 3)
    assert {r["image"].shape for r in ref} == {(64, 64, 3), (37, 51, 3), (40, 30, 1)}
    kept = []
    with crossfeed.Loader(
        root, batch_size=100, shuffle="none", return_index=True, read=ReadOptions(num_threads=2, prefetch=2)
    ) as loader:
        for _ in range(2):
            for b in loader:
                np.testing.assert_array_equal(b["label"], np.stack([ref[i]["label"] for i in b["__index__"].tolist()]))
                _assert_images(b, ref)
                kept.append(b)
    whole = [b for b in kept if b["image"].dtype == np.uint8]
    assert whole and whole[0]["image"].shape == (100, 64, 64, 3)  # the straight-into-the-batch path ran
    assert any(b["image"].dtype == object for b in kept)  # and the mixed batch went image by image
    for b in kept:
        _assert_images(b, ref)
    with crossfeed.Loader(root, batch_size=7, shuffle="global", seed=4, return_index=True) as loader:
        for b in loader:
            _assert_images(b, ref)
