"""ViT sizes, variant names and analytic FLOPs: plain Python, no JAX.

The one table of model sizes, read by :mod:`jamp.models.vit`, :mod:`jamp.config`
and the benchmarks (the PyTorch baseline too: nothing here needs JAX).

Example:
  >>> from jamp.models import sizes
  >>> sizes.parse_variant("vit-b16"), sizes.VIT_SIZES["s"]["hidden_size"]
  (('b', 16), 384)
  >>> round(sizes.vit_macs("b", image_size=224) / 1e9, 1)   # ViT-B/16: 17.6 GMAC/image
  17.6
"""

from __future__ import annotations

from typing import Any

VIT_SIZES: dict[str, dict[str, int]] = {
    "ti": dict(hidden_size=192, num_layers=12, num_heads=3, mlp_dim=768),
    "s": dict(hidden_size=384, num_layers=12, num_heads=6, mlp_dim=1536),
    "b": dict(hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "l": dict(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096),
}
"""Model sizes of Dosovitskiy et al. (2020) and Touvron et al. (2021)."""


def parse_variant(name: str, patch_size: int | None = 16) -> tuple[str, int | None]:
    """Splits ``"b16"``/``"vit-s16"``/``"ti"`` into ``(size, patch_size)``.

    A patch size in the name wins over ``patch_size``, which is the default for
    names without one. Raises ``ValueError`` for an unknown size.

    Example:
      >>> from jamp.models.sizes import parse_variant
      >>> parse_variant("b16"), parse_variant("ti", 4), parse_variant("S", None)
      (('b', 16), ('ti', 4), ('s', None))
    """
    text = name.lower().removeprefix("vit-").removeprefix("vit_")
    size = text.rstrip("0123456789")
    if size not in VIT_SIZES:
        raise ValueError(f"Unknown ViT variant {name!r}: use one of {', '.join(VIT_SIZES)} "
                         "optionally followed by the patch size (e.g. 'b16', 's16', 'ti4').")
    return size, int(text[len(size):]) if text[len(size):] else patch_size


def vit_dims(variant: str, **overrides: int | None) -> dict[str, int]:
    """Model dimensions of a ViT size with optional overrides (``None`` ones are ignored).

    Example:
      >>> from jamp.models.sizes import vit_dims
      >>> vit_dims("s16", num_layers=2, mlp_dim=None)
      {'hidden_size': 384, 'num_layers': 2, 'num_heads': 6, 'mlp_dim': 1536}
    """
    size, _ = parse_variant(variant)
    return {**VIT_SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}


def vit_label(variant: str, patch_size: int | None = None) -> str:
    """The usual name of a ViT variant.

    Example:
      >>> from jamp.models.sizes import vit_label
      >>> vit_label("ti4"), vit_label("b", 16)
      ('ViT-Ti/4', 'ViT-B/16')
    """
    size, patch = parse_variant(variant, patch_size or 16)
    return f"ViT-{'Ti' if size == 'ti' else size.upper()}/{patch}"


def vit_macs(variant: str, *, image_size: int, patch_size: int | None = None,
             num_classes: int = 1000, channels: int = 3, **overrides: int | None) -> float:
    """Multiply-accumulates of one ViT forward pass for one image (analytic).

    Counts the matmuls: patch embedding, per block Q/K/V/out projections
    (``4 S D^2``), attention scores and weighted values (``2 S^2 D``), MLP
    (``2 S D M``), and the head; with ``S = (image/patch)^2 + 1`` tokens.
    Norms, softmax and GELU are left out (they are not tensor-core work).

    Example:
      >>> from jamp.models.sizes import vit_macs
      >>> round(vit_macs("s16", image_size=224) / 1e9, 2)
      4.6
    """
    patch = patch_size or parse_variant(variant)[1]
    d = vit_dims(variant, **overrides)
    hidden, mlp, layers = d["hidden_size"], d["mlp_dim"], d["num_layers"]
    patches = (image_size // patch) ** 2
    seq = patches + 1
    embed = patches * patch * patch * channels * hidden
    block = 4 * seq * hidden**2 + 2 * seq**2 * hidden + 2 * seq * hidden * mlp
    return float(embed + layers * block + hidden * num_classes)


def train_flops_per_image(variant: str, **kwargs: Any) -> float:
    """FLOPs of one training step per image: 3 passes (fwd + 2x bwd) x 2 FLOPs per MAC.

    Example:
      >>> from jamp.models.sizes import train_flops_per_image
      >>> round(train_flops_per_image("b16", image_size=224) / 1e9)
      105
    """
    return 6.0 * vit_macs(variant, **kwargs)
