"""Photos of different sizes, some grayscale, written by the tools users have — a WebDataset tar
(webdataset's ``TarWriter``: ``jpg``/``cls``), a crossfeed TFRecord dataset (``image``/``label``)
and a Parquet file (pyarrow: ``img``/``y``) — and the mixture of the three, renamed to
``image``/``label``. Each photo's left half is one colour and its right half another, both
known from its label, so a resized photo can be checked (`halves`)."""

from __future__ import annotations

import io
import os

import numpy as np

import crossfeed
from crossfeed.format.schema import Encoding, Feature, Schema

SIZES = {"tar": 12, "tfrecord": 10, "parquet": 8}
WEIGHTS = {"tar": 3, "tfrecord": 2, "parquet": 1}
CLASSES = 5


def colours(label: int) -> tuple[np.ndarray, np.ndarray]:
    """The left and right colours of a photo of class ``label`` (far apart, JPEG keeps them)."""
    left = np.array([40 + 40 * label, 220 - 30 * label, 30], np.uint8)
    right = np.array([230, 20 + 45 * label, 200 - 35 * label], np.uint8)
    return left, right


def photo(i: int, label: int, *, gray: bool) -> np.ndarray:
    """Photo ``i``: its own size (13–35 × 11–33), halves in the class colours; gray: (H, W) luma."""
    h, w = 13 + (i * 7) % 23, 11 + (i * 5) % 23
    im = np.empty((h, w, 3), np.uint8)
    left, right = colours(label)
    im[:, : w // 2], im[:, w // 2 :] = left, right
    if gray:
        return np.round(im @ np.array([0.299, 0.587, 0.114])).astype(np.uint8)
    return im


def encode(im: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(im).save(b, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return b.getvalue()


def labels(kind: str) -> list[int]:
    offset = {"tar": 0, "tfrecord": 1, "parquet": 2}[kind]
    return [(i + offset) % CLASSES for i in range(SIZES[kind])]


def write_tar(root) -> str:
    import webdataset as wds

    from crossfeed.write.adopt.index import index_dataset

    os.makedirs(root)
    ys = labels("tar")
    for part in range(2):
        with wds.TarWriter(os.path.join(root, f"photos-{part:06d}.tar")) as sink:
            for i in range(part * 6, part * 6 + 6):
                im = photo(i, ys[i], gray=i % 4 == 3)
                sink.write({"__key__": f"p{i:05d}", "jpg": encode(im, "JPEG"), "cls": ys[i], "txt": f"photo {i}"})
    index_dataset(root)
    return str(root)


def write_tfrecord(root) -> str:
    ys = labels("tfrecord")
    schema = Schema(
        [Feature("image", "uint8", (None, None, 3), Encoding.IMAGE), Feature("label", "int64", (), "int64")]
    )
    samples = [{"image": encode(photo(100 + i, y, gray=False), "PNG"), "label": y} for i, y in enumerate(ys)]
    crossfeed.write_dataset(root, samples, num_shards=2, schema=schema).close()
    return str(root)


def write_parquet(root) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from crossfeed.write.adopt.index import index_dataset

    os.makedirs(root)
    ys = labels("parquet")
    pngs = [encode(photo(200 + i, y, gray=i % 3 == 0), "PNG") for i, y in enumerate(ys)]
    table = pa.table({"img": pa.array(pngs, pa.binary()), "y": pa.array(np.asarray(ys, np.int32))})
    pq.write_table(table, os.path.join(root, "photos.parquet"), row_group_size=3)
    index_dataset(root, features=["img=image", "y"])
    return str(root)


def write_all(root) -> dict[str, str]:
    return {
        "tar": write_tar(root / "wds"),
        "tfrecord": write_tfrecord(root / "tfrecord"),
        "parquet": write_parquet(root / "parquet"),
    }


def sources(paths: dict[str, str]) -> list:
    """The mixture, in the order tar, TFRecord, Parquet, each renamed to ``image``/``label``."""
    return [
        crossfeed.Source(paths["tar"], weight=WEIGHTS["tar"], rename={"jpg": "image", "cls": "label"}),
        crossfeed.Source(paths["tfrecord"], weight=WEIGHTS["tfrecord"]),
        crossfeed.Source(paths["parquet"], weight=WEIGHTS["parquet"], rename={"img": "image", "y": "label"}),
    ]


def halves(im: np.ndarray, label: int, tol: int = 24) -> bool:
    """Whether a colour photo's outer columns are its class's left and right colours."""
    left, right = colours(label)
    w = im.shape[1]
    got_l, got_r = im[:, : max(1, w // 4)].reshape(-1, 3), im[:, w - max(1, w // 4) :].reshape(-1, 3)
    return bool(
        (np.abs(got_l.astype(int) - left).max() <= tol or _is_gray(got_l, left, tol))
        and (np.abs(got_r.astype(int) - right).max() <= tol or _is_gray(got_r, right, tol))
    )


def _is_gray(got: np.ndarray, colour: np.ndarray, tol: int) -> bool:
    """A gray photo made RGB: its three channels equal, at the colour's luma."""
    luma = float(colour @ np.array([0.299, 0.587, 0.114]))
    return bool((got.max(axis=1) - got.min(axis=1)).max() <= 2 and np.abs(got.astype(float) - luma).max() <= tol)
