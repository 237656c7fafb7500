"""Image decoding: the one place where encoded image bytes become RGB PIL images.

The actor (``load_sample_images``: limits checked from the header first, errors become error rows), the
converters and the synthetic shards' readers (``decode_image``) share :func:`open_image` and :func:`to_rgb`,
so every path gives the same pixels for the same bytes. Greyscale, palette, RGBA (composited on white),
CMYK and 16-bit images are converted to RGB: real datasets hold them, and the processors expect 3 channels.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from pipeline.data.shards import DataError


class BadInput(DataError):
    """A sample's input cannot be evaluated; the message says why (it becomes the rows' ``error``)."""


def open_image(data: Any, what: str = "image"):
    """Open encoded bytes lazily: the size is read from the header, no pixel is decoded yet."""
    from PIL import Image

    if data is None or len(data) == 0:
        raise BadInput(f"{what} is empty (0 bytes)")
    try:
        return Image.open(io.BytesIO(bytes(data)))
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bytes that are not an image
        raise BadInput(f"{what} is corrupt or not an image ({type(e).__name__}: {e})") from None


def load_pixels(img, what: str = "image"):
    """Decode the pixels of an opened image and convert them to RGB."""
    try:
        img.load()
    except Exception as e:  # noqa: BLE001 - truncated or otherwise undecodable pixel data
        raise BadInput(f"{what} is corrupt ({type(e).__name__}: {e})") from None
    return to_rgb(img)


def to_rgb(img):
    """Any PIL mode -> RGB: 16-bit/int/float scaled to 0..255, alpha composited on white."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(a)
        return Image.fromarray(a.astype(np.uint8), "L").convert("RGB")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "RGBa", "La", "PA"):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def decode_image(data: bytes, where: str = "image"):
    """Encoded image bytes -> an RGB PIL image, or :class:`DataError` naming ``where``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DataError(f"{where}: expected encoded image bytes, got {type(data).__name__}")
    try:
        return load_pixels(open_image(data))
    except BadInput as e:
        raise DataError(f"{where}: cannot decode image bytes ({e})") from e


def encode_image(img, fmt: str = "PNG") -> bytes:
    """Encode a PIL image (or HxWx3 uint8 array) to bytes."""
    from PIL import Image

    if not isinstance(img, Image.Image):
        img = Image.fromarray(img)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def sample_images(row: dict, where: str = "sample"):
    """Decoded RGB images (frames, for video) of one input row."""
    sid = row.get("sample_id", "?")
    return [decode_image(b, f"{where}: sample_id={sid!r} field 'images'[{i}]") for i, b in enumerate(row["images"])]


def load_sample_images(images: Any, task: str, max_frames: int, max_image_bytes: int, max_image_pixels: int) -> list:
    """A sample's images, checked and decoded to RGB, or :class:`BadInput`. The pixel limit is checked from
    the header before any pixel is decoded, so it doubles as a decompression-bomb guard."""
    frames = list(images) if images is not None else []
    if not frames:
        raise BadInput("video has 0 frames" if task == "video" else "sample has no image")
    if task != "video" and len(frames) != 1:
        raise BadInput(f"expected 1 image for task '{task}', got {len(frames)}")
    if len(frames) > max_frames:
        raise BadInput(f"video has {len(frames)} frames, more than max_frames={max_frames}")
    kind = "frame" if task == "video" else "image"
    out = []
    for i, data in enumerate(frames):
        what = f"{kind} {i}"
        if data is not None and len(data) > max_image_bytes:
            raise BadInput(f"{what} is {len(data) / 2**20:.1f} MiB, more than max_image_bytes={max_image_bytes}")
        img = open_image(data, what)
        w, h = img.size
        if w * h > max_image_pixels:
            raise BadInput(f"{what} is huge: {w}x{h} = {w * h / 1e6:.1f} MP, more than max_image_pixels="
                           f"{max_image_pixels / 1e6:.1f} MP")
        if w < 1 or h < 1:
            raise BadInput(f"{what} has size {w}x{h}")
        out.append(load_pixels(img, what))
    if task == "video" and len({im.size for im in out}) > 1:
        raise BadInput(f"video frames differ in size: {sorted({im.size for im in out})}")
    return out
