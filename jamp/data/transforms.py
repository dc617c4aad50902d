"""Per-example image transforms for the grain pipelines, in NumPy.

They run inside grain (main process or worker processes), so they avoid JAX:
a JAX call per example would cost a dispatch and pin the accelerator runtime in
every worker. `resize` reproduces ``jax.image.resize(..., "linear")`` (triangle
kernel, antialiased when shrinking) with two small cached matrix products.

Example:
  >>> img = np.zeros((8, 8, 1), np.uint8)
  >>> resize(img, (16, 16)).shape
  (16, 16, 1)
  >>> batch = np.zeros((4, 8, 8, 1), np.uint8)
  >>> pad_crop_flip_batch(batch, pad=1, flip=True, rng=np.random.default_rng(0)).shape
  (4, 8, 8, 1)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import grain
import numpy as np

Example = dict[str, Any]

#: Native sides at or below this use pad-and-crop; above, random-resized-crop.
SMALL_IMAGE_SIDE = 64
#: Fraction of the shorter side kept by the evaluation centre crop of large images.
EVAL_CROP_FRACTION = 0.875


@functools.lru_cache(maxsize=256)
def _resize_weights(in_size: int, out_size: int) -> np.ndarray:
    """Returns the (out_size, in_size) linear-interpolation matrix of jax.image.resize."""
    scale = out_size / in_size
    kernel_scale = max(1.0 / scale, 1.0)  # Antialias when shrinking.
    sample = (np.arange(out_size, dtype=np.float64) + 0.5) / scale - 0.5
    x = np.abs(sample[:, None] - np.arange(in_size, dtype=np.float64)[None, :]) / kernel_scale
    weights = np.maximum(0.0, 1.0 - x)
    total = weights.sum(axis=1, keepdims=True)
    weights = np.where(np.abs(total) > 1000 * np.finfo(np.float32).eps, weights / total, 0.0)
    inside = (sample >= -0.5) & (sample <= in_size - 0.5)
    return np.where(inside[:, None], weights, 0.0).astype(np.float32)


def resize(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear (antialiased) resize of an HWC image to `size`, as float32.

    Matches ``jax.image.resize(image, (*size, C), "linear")`` up to float rounding.

    Args:
      image: (H, W, C) array of any real dtype.
      size: target (height, width).

    Returns:
      (height, width, C) float32 array; `image` as float32 when sizes match.

    Example:
      >>> resize(np.ones((4, 4, 3)), (2, 2))[..., 0]
      array([[1., 1.],
             [1., 1.]], dtype=float32)
    """
    h, w, _ = image.shape
    image = np.asarray(image, np.float32)
    if (h, w) == tuple(size):
        return image
    out = np.tensordot(_resize_weights(h, size[0]), image, axes=(1, 0))  # (oh, W, C)
    out = np.tensordot(_resize_weights(w, size[1]), out, axes=(1, 1))  # (ow, oh, C)
    return out.transpose(1, 0, 2)


def random_resized_crop(
    image: np.ndarray,
    size: tuple[int, int],
    *,
    rng: np.random.Generator,
    area: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> np.ndarray:
    """Inception-style crop: random area fraction and aspect ratio, resized to `size`.

    Falls back to the central square crop after ten rejected samples.

    Example:
      >>> random_resized_crop(np.zeros((100, 80, 3)), (32, 32),
      ...                     rng=np.random.default_rng(0)).shape
      (32, 32, 3)
    """
    h, w, _ = image.shape
    for _ in range(10):
        target = h * w * rng.uniform(*area)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw = round(math.sqrt(target * aspect))
        ch = round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(rng.integers(0, h - ch + 1))
            left = int(rng.integers(0, w - cw + 1))
            return resize(image[top : top + ch, left : left + cw], size)
    return center_crop_resize(image, size, fraction=1.0)


def center_crop_resize(
    image: np.ndarray, size: tuple[int, int], *, fraction: float = EVAL_CROP_FRACTION
) -> np.ndarray:
    """Crops the central square of `fraction` x the shorter side, resized to `size`.

    Example:
      >>> center_crop_resize(np.zeros((100, 80, 3)), (32, 32)).shape
      (32, 32, 3)
    """
    h, w, _ = image.shape
    side = max(1, round(min(h, w) * fraction))
    top, left = (h - side) // 2, (w - side) // 2
    return resize(image[top : top + side, left : left + side], size)


def is_small(image_shape: tuple[int | None, int | None, int]) -> bool:
    """Whether images of this native shape get pad-and-crop (else random-resized-crop).

    Example:
      >>> is_small((32, 32, 3)), is_small((None, None, 3))
      (True, False)
    """
    h, w, _ = image_shape
    return h is not None and w is not None and max(h, w) <= SMALL_IMAGE_SIDE


def _as_hwc(image: Any) -> np.ndarray:
    image = np.asarray(image)
    return image[..., None] if image.ndim == 2 else image


def pad_crop_flip_batch(
    images: np.ndarray, *, pad: int, flip: bool, rng: np.random.Generator
) -> np.ndarray:
    """Random crop after reflect padding (+ random horizontal flip), batched.

    Each image is reflect-padded by `pad` and cropped back at its own random offset;
    with `flip`, each is mirrored with probability 1/2.

    Example:
      >>> pad_crop_flip_batch(np.zeros((4, 8, 8, 1)), pad=1, flip=True,
      ...                     rng=np.random.default_rng(0)).shape
      (4, 8, 8, 1)
    """
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    top, left = rng.integers(0, 2 * pad + 1, size=(2, n))
    rows = top[:, None] + np.arange(h)
    cols = left[:, None] + np.arange(w)
    if flip:
        cols = np.where(rng.random(n)[:, None] < 0.5, cols[:, ::-1], cols)
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


@dataclasses.dataclass(frozen=True)
class Preprocess(grain.transforms.Map):
    """Per example: decode to HWC, bring to (size, size, C) deterministically.

    Small images (`is_small`) are resized (if needed); large ones get the eval
    centre crop, or with ``keep_native=True`` are left for `RandomResizedCrop`.

    Example:
      >>> Preprocess(size=16, small=True).map(
      ...     {"image": np.zeros((8, 8, 1), np.uint8), "label": 1})["image"].shape
      (16, 16, 1)
    """

    size: int
    small: bool
    keep_native: bool = False

    def map(self, element: Example) -> Example:
        image = _as_hwc(element["image"])
        if self.small:
            if image.shape[:2] != (self.size, self.size):
                image = resize(image, (self.size, self.size))
        elif not self.keep_native:
            image = center_crop_resize(image, (self.size, self.size))
        return {"image": image, "label": np.int32(element["label"])}


@dataclasses.dataclass(frozen=True)
class RandomResizedCrop(grain.transforms.RandomMap):
    """Per example: `random_resized_crop` to (size, size) and an optional random flip.

    Example:
      >>> ex = RandomResizedCrop(size=32, flip=True).random_map(
      ...     {"image": np.zeros((100, 80, 3), np.uint8), "label": 1},
      ...     np.random.default_rng(0))
      >>> ex["image"].shape
      (32, 32, 3)
    """

    size: int
    flip: bool

    def random_map(self, element: Example, rng: np.random.Generator) -> Example:
        image = random_resized_crop(element["image"], (self.size, self.size), rng=rng)
        if self.flip and rng.random() < 0.5:
            image = image[:, ::-1]
        return {"image": np.ascontiguousarray(image), "label": element["label"]}


@dataclasses.dataclass(frozen=True)
class PadCropFlip(grain.transforms.RandomMap):
    """Per batch: `pad_crop_flip_batch` with pad = size // 8 (at least 1).

    Example:
      >>> out = PadCropFlip(flip=False).random_map(
      ...     {"image": np.zeros((4, 8, 8, 1)), "label": np.arange(4)},
      ...     np.random.default_rng(0))
      >>> out["image"].shape
      (4, 8, 8, 1)
    """

    flip: bool

    def random_map(self, element: Example, rng: np.random.Generator) -> Example:
        images = element["image"]
        pad = max(1, images.shape[1] // 8)
        out = dict(element)
        out["image"] = pad_crop_flip_batch(images, pad=pad, flip=self.flip, rng=rng)
        return out


@dataclasses.dataclass(frozen=True)
class Normalize(grain.transforms.Map):
    """Per batch: ``(image - mean) / std`` to float32 NHWC; labels to int32.

    Example:
      >>> n = Normalize(mean=(127.5,), std=(127.5,))
      >>> n.map({"image": np.full((2, 1, 1, 1), 255, np.uint8),
      ...        "label": np.array([1, 2])})["image"].ravel()
      array([1., 1.], dtype=float32)
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def map(self, element: Example) -> Example:
        mean = np.asarray(self.mean, np.float32)
        scale = np.asarray(1.0 / np.asarray(self.std), np.float32)
        out = dict(element)
        out["image"] = (np.asarray(element["image"], np.float32) - mean) * scale
        out["label"] = np.asarray(element["label"], np.int32)
        return out
