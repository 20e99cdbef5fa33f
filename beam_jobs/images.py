"""Image folders: ``SRC/<class>/<file>``, one subdirectory per class.

Labels are the positions of the class names in sorted order; the names are stored in the
manifest metadata (``class_names``). JPEG and PNG files in L or RGB mode are stored byte for byte
(the `image` kind); anything else (GIF, TIFF, BMP, WebP, RGBA/palette/16-bit PNG, CMYK JPEG) is
re-encoded when ``convert`` is ``"png"`` or ``"jpeg"`` (to RGB, alpha composited on white, or L
for grey images), and otherwise reported under the ``on_error`` policy, as is a file Pillow cannot
decode. Each sample records ``height``, ``width`` and ``channels``, the ``path`` relative to SRC
(also its key), and the integer ``label``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

from crossfeed.beam_jobs.policy import EmptyInputError, ErrorPolicy, Skips
from crossfeed.beam_jobs.records import SampleBatch
from crossfeed.errors import ConfigError
from crossfeed.format import codecs
from crossfeed.format.schema import Feature, Schema

EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".tif", ".tiff", ".bmp", ".webp")
KEEP = {("JPEG", "L"), ("JPEG", "RGB"), ("PNG", "L"), ("PNG", "RGB")}
SCHEMA = Schema(
    [
        Feature("image", "uint8", (None, None, None), codecs.IMAGE),
        Feature("label", "int64", (), codecs.INT64),
        Feature("height", "int64", (), codecs.INT64),
        Feature("width", "int64", (), codecs.INT64),
        Feature("channels", "int64", (), codecs.INT64),
        Feature("path", "string", (), codecs.BYTES),
    ]
)


@dataclass(frozen=True)
class ImageFolderSource:
    """Reads ``root`` (see the module doc); a unit is up to ``batch_files`` files."""

    root: str
    class_names: tuple[str, ...]
    files: tuple[str, ...]
    convert: str | None = None
    on_error: ErrorPolicy = ErrorPolicy()
    batch_files: int = 256

    def __post_init__(self):
        if self.convert not in (None, "png", "jpeg"):
            raise ConfigError(f"convert must be None, 'png' or 'jpeg', got {self.convert!r}")
        if self.batch_files < 1:
            raise ConfigError(f"batch_files must be >= 1, got {self.batch_files}")

    @classmethod
    def scan(cls, root, **options) -> ImageFolderSource:
        root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(root):
            raise ConfigError(f"{root}: not a directory; an image folder has one subdirectory per class")
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
        if not classes:
            raise EmptyInputError(f"{root}: no class subdirectories; put each class's images in SRC/<class>/")
        files = []
        for c in classes:
            for dirpath, dirnames, names in os.walk(os.path.join(root, c)):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                files += [
                    os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/")
                    for n in names
                    if n.lower().endswith(EXTENSIONS) and not n.startswith(".")
                ]
        if not files:
            raise EmptyInputError(f"{root}: no image files ({', '.join(EXTENSIONS)}) under {classes}")
        return cls(root, tuple(classes), tuple(sorted(files)), **options)

    @property
    def schema(self) -> Schema:
        return SCHEMA

    @property
    def metadata(self) -> dict:
        return {"source": "images", "class_names": list(self.class_names)}

    def report(self) -> list[str]:
        """With ``convert``: one line per kind of file it re-encodes (format and mode, from the
        headers alone), with how many, an example, and what the conversion loses."""
        if self.convert is None:
            return []
        from PIL import Image

        kinds: dict[tuple, list[str]] = {}
        for rel in self.files:
            try:
                with Image.open(os.path.join(self.root, rel)) as im:
                    if (im.format, im.mode) not in KEEP:
                        kinds.setdefault((im.format, im.mode, conversion_losses(im, self.convert)), []).append(rel)
            except Exception:  # Pillow raises many types; a damaged file is reported when it is read
                continue
        return [
            f"--convert {self.convert}: {n} {fmt} {mode} file{'s' if len(rels) > 1 else ''} (e.g. {rels[0]}) "
            f"re-encoded: {lost}"
            for (fmt, mode, lost), rels in sorted(kinds.items(), key=lambda kv: -len(kv[1]))
            for n in [len(rels)]
        ]

    def describe(self) -> str:
        return f"image folder {self.root} ({len(self.files)} files, {len(self.class_names)} classes)"

    def units(self) -> list[tuple[int, tuple[str, ...]]]:
        b = self.batch_files
        return [(i // b, self.files[i : i + b]) for i in range(0, len(self.files), b)]

    def read(self, unit):
        number, files = unit
        labels = {c: i for i, c in enumerate(self.class_names)}
        skips = Skips(self.on_error)
        keys, images, shapes = [], [], []
        for rel in files:
            with open(os.path.join(self.root, rel), "rb") as f:
                data = f.read()
            try:
                data, shape = inspect_image(data, self.convert)
            except ValueError as e:
                skips.bad(f"{os.path.join(self.root, rel)}: {e}")
                continue
            keys.append(rel)
            images.append(data)
            shapes.append(shape)
        if not keys and not skips.count:
            return
        arr = np.array(shapes, dtype=np.int64).reshape(-1, 3)
        yield SampleBatch(
            f"images-{number:06d}",
            keys,
            {
                "image": images,
                "label": np.array([labels[k.split("/", 1)[0]] for k in keys], dtype=np.int64),
                "height": arr[:, 0],
                "width": arr[:, 1],
                "channels": arr[:, 2],
                "path": keys,
            },
            shapes={"image": [tuple(s) for s in shapes]},
            skipped=skips.count,
        )


def inspect_image(data: bytes, convert: str | None = None) -> tuple[bytes, tuple[int, int, int]]:
    """``(bytes to store, (height, width, channels))``; the original bytes for a JPEG/PNG in L or
    RGB mode, else re-encoded per ``convert``. Raises ValueError for what cannot be stored."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # decode fully, so a truncated or damaged file is caught here, not by a reader
            fmt, mode, (w, h) = im.format, im.mode, im.size
            if (fmt, mode) in KEEP:
                return data, (h, w, 1 if mode == "L" else 3)
            if convert is None:
                raise ValueError(
                    f"{fmt} image in mode {mode} is not stored as-is (only JPEG/PNG in L or RGB); "
                    f"pass convert='png' (--convert png) to re-encode such files"
                )
            out = _to_storable(im)
    except ValueError:
        raise
    except Exception as e:  # Pillow raises many types for damaged data
        raise ValueError(f"not a readable image ({type(e).__name__}: {e})") from e
    buf = io.BytesIO()
    if convert == "png":
        out.save(buf, format="PNG", optimize=False)
    else:
        out.save(buf, format="JPEG", quality=95)
    return buf.getvalue(), (out.height, out.width, 1 if out.mode == "L" else 3)


def conversion_losses(im, convert: str) -> str:
    """What re-encoding an opened (not yet decoded) Pillow image per ``convert`` loses, in words."""
    mode, lost = im.mode, []
    if mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        bits = "32-bit float" if mode == "F" else "16-bit" if "16" in mode else "32-bit"
        lost.append(f"{bits} gray scaled to 8-bit (each image's maximum becomes 255: precision and levels lost)")
    elif mode == "1":
        lost.append("1-bit expanded to 8-bit gray (nothing lost)")
    if mode == "CMYK":
        lost.append("CMYK converted to RGB without color management (colors may shift)")
    if mode == "P":
        lost.append("palette expanded to RGB (the palette indices are gone)")
    if "A" in mode or "a" in mode or "transparency" in im.info:
        lost.append("alpha composited on white and dropped")
    if mode in ("YCbCr", "LAB", "HSV"):
        lost.append(f"{mode} converted to RGB")
    if im.info.get("icc_profile"):
        lost.append("ICC color profile dropped (pixels not converted to sRGB)")
    if convert == "jpeg":
        lost.append("re-encoded as JPEG quality 95 (lossy)")
    return "; ".join(lost) or f"re-encoded as {convert.upper()} (pixels kept)"


def _to_storable(im):
    from PIL import Image

    if im.mode in ("1", "L", "I", "I;16", "I;16B", "F"):
        if im.mode in ("I", "I;16", "I;16B", "F"):
            arr = np.asarray(im, dtype=np.float64)
            hi = arr.max() if arr.size and arr.max() > 0 else 1.0
            return Image.fromarray(np.clip(arr * (255.0 / hi), 0, 255).astype(np.uint8), "L")
        return im.convert("L")
    rgba = im.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")
