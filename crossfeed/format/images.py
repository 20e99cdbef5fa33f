"""Decoding encoded images (JPEG/PNG) to uint8 ``(H, W, C)`` arrays: libspng and libjpeg-turbo
where they apply, Pillow otherwise. The image codec (`crossfeed.format.codecs`) and the readers
use `decode_image`."""

from __future__ import annotations

import numpy as np

from crossfeed.errors import SchemaError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _spng(data) -> np.ndarray | None:
    """An 8-bit gray, gray+alpha, RGB or RGBA PNG decoded by libspng (pyspng: ~6× Pillow on small
    images), as ``(H, W, C)``; None for any other PNG (palette, 16-bit, …: Pillow decodes those as
    it always has) or when pyspng is missing."""
    if len(data) < 33 or bytes(data[12:16]) != b"IHDR" or data[24] != 8 or data[25] not in (0, 2, 4, 6):
        return None
    try:
        import pyspng
    except ImportError:
        return None
    try:
        arr = pyspng.load(data if isinstance(data, bytes) else bytes(data))
    except Exception:  # damaged: Pillow decodes it or says what is wrong
        return None
    return arr[:, :, None] if arr.ndim == 2 else arr


def decode_image(data: bytes, f=None, fit=None) -> np.ndarray:
    """Encoded JPEG/PNG → uint8 array (H, W, C); grayscale keeps C = 1 (``f``: the `Feature`,
    named in errors). With ``fit`` (a `crossfeed.format.schema.ImageFit`), brought to
    its size and channels (a large JPEG is decoded at the smallest scale libjpeg-turbo offers
    that still covers the size: less work for the same result up to rounding)."""
    if fit is None:
        return _decode(data, f)
    name = f.name if f is not None else "image"
    return fit(_decode(data, f, fit.size), name)


def _decode(data, f, at_least: tuple[int, int] | None = None) -> np.ndarray:
    import io

    from PIL import Image

    if bytes(data[:8]) == PNG_MAGIC:
        arr = _spng(data)
        if arr is not None:
            return arr
    if bytes(data[:3]) == b"\xff\xd8\xff":
        try:
            import simplejpeg

            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace in ("YCbCr", "RGB", "Gray"):
                mins = {} if at_least is None else {"min_height": at_least[0], "min_width": at_least[1]}
                arr = simplejpeg.decode_jpeg(data, colorspace="GRAY" if colorspace == "Gray" else "RGB", **mins)
                return arr if arr.ndim == 3 else arr[:, :, None]
        except (ImportError, ValueError, RuntimeError):
            pass  # Pillow decodes it, or says what is wrong
    try:
        with Image.open(io.BytesIO(data)) as im:
            arr = np.asarray(im)
    except Exception as e:  # Pillow raises many types for bad data
        name = f.name if f is not None else "image"
        raise SchemaError(f"feature {name!r}: cannot decode image ({e})") from e
    return arr[:, :, None] if arr.ndim == 2 else arr
