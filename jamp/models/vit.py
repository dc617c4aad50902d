"""Vision Transformer (ViT-Ti/S/B/L), written once and dtype-agnostic.

The model takes no dtype arguments: :func:`jamp.apply_policy` decides the
param/compute/output dtypes. Encoder blocks are stacked with ``nn.scan`` (one
set of parameters with a leading ``layers`` axis) so the parallelism layer can
shard them, and pipeline them through a ``layer_runner`` it hands in (the model
never looks at the mesh). Parameters and activations carry logical axis names
(``batch``, ``seq``, ``embed``, ``heads``, ``kv``, ``mlp``, ``vocab``,
``layers``) that ``jamp.parallel`` maps onto a device mesh.

Example:
  >>> import jax, jax.numpy as jnp, jamp
  >>> from jamp.models import vit
  >>> module = vit.create("ti", num_classes=10, patch_size=4, num_layers=2, hidden_size=16,
  ...                     num_heads=2, mlp_dim=32)
  >>> model = jamp.apply_policy(module, "bf16")
  >>> variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
  >>> jax.jit(model.apply)(variables, jnp.zeros((2, 16, 16, 3))).shape
  (2, 10)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jamp import attention
from jamp.models import activations, norms
from jamp.models.sizes import VIT_SIZES as VARIANTS
from jamp.models.sizes import parse_variant


def _partitioned(init: Callable, axes: tuple[str | None, ...]) -> Callable:
    """``init`` with logical axis names.

    The policy (:mod:`jamp.apply.linen`) draws every parameter in float32 and
    rounds it to the param dtype, so every precision mode starts from the same
    weights (up to that rounding); the model does not do it again.
    """
    return nn.with_logical_partitioning(init, axes)


class MlpBlock(nn.Module):
    """Transformer MLP: Dense(mlp_dim) -> GELU -> Dense(embed), Megatron-shardable."""

    mlp_dim: int
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        features = x.shape[-1]
        x = nn.Dense(self.mlp_dim, kernel_init=_partitioned(
            nn.initializers.xavier_uniform(), ("embed", "mlp")),
            bias_init=_partitioned(nn.initializers.normal(1e-6), ("mlp",)))(x)
        x = nn.with_logical_constraint(activations.gelu(x), ("batch", "seq", "mlp"))
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
        x = nn.Dense(features, kernel_init=_partitioned(
            nn.initializers.xavier_uniform(), ("mlp", "embed")),
            bias_init=_partitioned(nn.initializers.normal(1e-6), ("embed",)))(x)
        return nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``[embed, heads, head_dim]`` kernels.

    Kernels carry logical names (``embed``, ``heads``, ``kv``) so heads shard over
    the 'model' mesh axis (Megatron). ``dtype``/``param_dtype``/``softmax_fp32``
    are set by the jamp policy; the softmax runs in float32 when asked and keeps
    half-precision residuals (:mod:`jamp.attention`).

    The four projections (query, key, value, out) follow flax's ``dot_general``
    injection convention, as ``nn.DenseGeneral``: with ``dot_general_cls`` each
    projection instantiates its own ``dot_general_cls()`` (in that order), else
    all four call ``dot_general``, else ``jax.lax.dot_general``. The fp8 modes
    set them (:func:`jamp.fp8.linen_install`: one delayed-scaling state per
    projection); the parameters are the same whichever is set. The score and
    value matmuls of the attention itself always run in the compute dtype.

    Attributes:
      num_heads: attention heads (``embed`` must be divisible by it).
      dropout_rate: attention dropout probability.
      dtype, param_dtype, softmax_fp32: set by the jamp policy.
      dot_general: the projections' ``lax.dot_general`` replacement (None: lax's).
      dot_general_cls: a class instantiated once per projection as its
        ``dot_general`` (wins over ``dot_general``).
    """

    num_heads: int
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    softmax_fp32: bool = True
    dot_general: Callable[..., jax.Array] | None = None
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        embed = x.shape[-1]
        head_dim = embed // self.num_heads
        init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=0,
                                                out_axis=(1, 2))
        out_init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=(0, 1),
                                                    out_axis=2)
        shape = (embed, self.num_heads, head_dim)

        def param(name, init_fn, shape, axes):
            return self.param(name, _partitioned(init_fn, axes), shape, self.param_dtype)

        qkv = [(param(f"{n}_kernel", init, shape, ("embed", "heads", "kv")),
                param(f"{n}_bias", nn.initializers.zeros, shape[1:], ("heads", "kv")))
               for n in ("query", "key", "value")]
        out_kernel = param("out_kernel", out_init, (self.num_heads, head_dim, embed),
                           ("heads", "kv", "embed"))
        out_bias = param("out_bias", nn.initializers.zeros, (embed,), ("embed",))
        x, *weights = nn.dtypes.promote_dtype(
            x, *[w for pair in qkv for w in pair], out_kernel, out_bias, dtype=self.dtype)

        def dot_general():  # one projection's matmul: its own dot_general_cls(), or shared
            if self.dot_general_cls is not None:
                return self.dot_general_cls()
            if self.dot_general is not None:
                return self.dot_general
            return lambda a, b, dims: jax.lax.dot_general(  # as jnp.einsum calls it
                a, b, dims, preferred_element_type=jnp.result_type(a, b))

        # The projections are the dots jnp.einsum makes of "bse,ehd->bshd" and "bshd,hde->bse"
        # (the same jaxpr by default), called directly: jnp.einsum(_dot_general=...) traces
        # its dot under its own jit, where a flax module (a dot_general_cls instance) must
        # not create its variables.
        q, k, v = [dot_general()(x, weights[2 * i], (((x.ndim - 1,), (0,)), ((), ())))
                   + weights[2 * i + 1] for i in range(3)]
        q, k, v = (nn.with_logical_constraint(t, ("batch", "seq", "heads", "kv"))
                   for t in (q, k, v))
        dropout_rng = None
        if not deterministic and self.dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        if self.softmax_fp32:
            y = attention.dot_product_attention(
                q, k, v, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                deterministic=deterministic)
        else:
            y = nn.dot_product_attention(
                q, k, v, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                deterministic=deterministic)
        out = dot_general()(y, weights[-2], (((y.ndim - 1, y.ndim - 2), (1, 0)), ((), ())))
        return out + weights[-1]


class EncoderBlock(nn.Module):
    """Pre-LN transformer block. ``__call__(x, deterministic) -> (x, None)`` for nn.scan."""

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> tuple[jax.Array, None]:
        ln = lambda: norms.LayerNorm(scale_init=_partitioned(nn.initializers.ones, ("embed",)),
                                     bias_init=_partitioned(nn.initializers.zeros, ("embed",)))
        y = ln()(x)
        y = SelfAttention(self.num_heads, self.attention_dropout_rate)(y, deterministic)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        x = nn.with_logical_constraint(x + y, ("batch", "seq", "embed"))
        y = MlpBlock(self.mlp_dim, self.dropout_rate)(ln()(x), deterministic)
        x = nn.with_logical_constraint(x + y, ("batch", "seq", "embed"))
        return x, None


LayersFn = Callable[[Any, jax.Array, jax.Array | None], jax.Array]
"""``apply_layers(layer_params, x, dropout_rng) -> y``: applies ``[n, ...]``-stacked blocks."""

LayerRunner = Callable[[LayersFn, Any, jax.Array, jax.Array | None], jax.Array]
"""``runner(apply_layers, layer_variables, x, dropout_rng) -> y``: runs the scanned blocks.

``layer_variables`` are the ``[num_layers, ...]``-stacked block variables
(``{"params": ...}``, plus the fp8 delayed-scaling state in mode ``"fp8"``); the
runner applies them through ``apply_layers`` in whatever pieces it likes (e.g.
``jamp.parallel.pipeline.GPipe``: pipeline stages over microbatches).
"""


class Encoder(nn.Module):
    """``num_layers`` encoder blocks, stacked with ``nn.scan`` or unrolled.

    With a ``layer_runner`` (scanned blocks only) the stacked blocks are applied
    by it, e.g. as GPipe pipeline stages (``jamp.parallel.pipeline.GPipe``, which
    the trainer passes when its mesh has a 'pipe' axis), each stage running the
    same ``nn.scan``-ed blocks on its share of the layers inside whatever
    precision policy wraps the model. Initialisation always runs the plain scan:
    the parameters are the same with or without a runner.
    """

    num_layers: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    scan_layers: bool = True
    remat: bool = False
    layer_runner: LayerRunner | None = None

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        block_cls = EncoderBlock
        if self.remat:
            block_cls = nn.remat(block_cls, static_argnums=(2,), prevent_cse=not self.scan_layers)
        kwargs = dict(num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                      dropout_rate=self.dropout_rate,
                      attention_dropout_rate=self.attention_dropout_rate)
        if not self.scan_layers:
            if self.layer_runner is not None:
                raise ValueError("A layer_runner runs the scanned blocks: set scan_layers=True.")
            for i in range(self.num_layers):
                x, _ = block_cls(**kwargs, name=f"layers_{i}")(x, deterministic)
            return x
        stack = lambda length: nn.scan(
            block_cls,
            # Every collection per layer, stacked like the params (e.g. the fp8 state that
            # jamp.apply_policy's mode "fp8" adds: one per layer).
            variable_axes={True: 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=nn.broadcast,
            length=length,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        if self.layer_runner is None or self.is_initializing():
            x, _ = stack(self.num_layers)(**kwargs, name="layers")(x, deterministic)
            return x
        return self._run_layers(lambda length: stack(length)(**kwargs, parent=None), x,
                                deterministic)

    def _run_layers(self, stack: Callable[[int], nn.Module], x: jax.Array,
                    deterministic: bool) -> jax.Array:
        """Hands the stacked ``layers`` variables and a function applying them to the runner."""
        rng = None
        if not deterministic and (self.dropout_rate or self.attention_dropout_rate):
            rng = self.make_rng("dropout")

        def apply_layers(layer_variables, h, key):
            length = jax.tree_util.tree_leaves(layer_variables)[0].shape[0]
            rngs = {} if key is None else {"dropout": key}
            return stack(length).apply(layer_variables, h, deterministic, rngs=rngs)[0]

        # The runner splits every [num_layers, ...] leaf: the params and any other
        # collection of the blocks (e.g. the fp8 delayed-scaling state, whose gradient, its
        # new value, the runner's on_tick hook keeps to real microbatches).
        layer_variables = {name: nn.unbox(collection["layers"])
                           for name, collection in self.variables.items()
                           if "layers" in collection}
        return self.layer_runner(apply_layers, layer_variables, x, rng)


class ViT(nn.Module):
    """Vision Transformer classifier with a class token and learned position embeddings.

    Attributes:
      num_classes: number of output classes.
      patch_size: side of the square patches.
      hidden_size, num_layers, num_heads, mlp_dim: model size (see ``VARIANTS``).
      dropout_rate, attention_dropout_rate: dropout probabilities.
      scan_layers: stack the blocks with ``nn.scan`` (params get a ``layers`` axis).
      remat: rematerialise each block in the backward pass (saves activations).
      layer_runner: runs the scanned encoder blocks at apply time (e.g. as a
        pipeline, see :class:`Encoder`); None applies them with the plain scan.
    """

    num_classes: int
    patch_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    scan_layers: bool = True
    remat: bool = False
    layer_runner: LayerRunner | None = None

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> jax.Array:
        """Maps ``[batch, height, width, channels]`` images to ``[batch, num_classes]`` logits."""
        if images.ndim != 4:
            raise ValueError(
                f"ViT expects images of shape [batch, height, width, channels], got {images.shape}."
            )
        height, width = images.shape[1:3]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"Image size {height}x{width} is not divisible by patch_size={self.patch_size}: "
                "resize the images or choose a patch size that divides them."
            )
        x = nn.Conv(self.hidden_size, (self.patch_size, self.patch_size),
                    strides=(self.patch_size, self.patch_size), padding="VALID",
                    kernel_init=_partitioned(nn.initializers.lecun_normal(),
                                             (None, None, None, "embed")),
                    bias_init=_partitioned(nn.initializers.zeros, ("embed",)),
                    name="embedding")(images)
        batch, h, w, c = x.shape
        x = x.reshape(batch, h * w, c)
        cls = self.param("cls", _partitioned(nn.initializers.zeros, (None, None, "embed")),
                         (1, 1, c))
        x = jnp.concatenate([jnp.broadcast_to(cls, (batch, 1, c)).astype(x.dtype), x], axis=1)
        pos = self.param("pos_embedding",
                         _partitioned(nn.initializers.normal(0.02), (None, "seq", "embed")),
                         (1, x.shape[1], c))
        x = nn.with_logical_constraint(x + pos.astype(x.dtype), ("batch", "seq", "embed"))
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        x = Encoder(self.num_layers, self.num_heads, self.mlp_dim, self.dropout_rate,
                    self.attention_dropout_rate, self.scan_layers, self.remat,
                    self.layer_runner, name="encoder")(x, not train)
        x = norms.LayerNorm(scale_init=_partitioned(nn.initializers.ones, ("embed",)),
                            bias_init=_partitioned(nn.initializers.zeros, ("embed",)),
                            name="encoder_norm")(x[:, 0])
        return nn.Dense(self.num_classes, kernel_init=_partitioned(
            nn.initializers.zeros, ("embed", "vocab")),
            bias_init=_partitioned(nn.initializers.zeros, ("vocab",)), name="head")(x)


def create(variant: str, *, num_classes: int, patch_size: int = 16, **overrides: Any) -> ViT:
    """Returns a ViT of a named size: ``"ti"``, ``"s"``, ``"b"`` or ``"l"``.

    Args:
      variant: model size; ``"b16"``-style names (size + patch) are accepted too.
      num_classes: number of classes.
      patch_size: patch side (16 for 224px images; smaller for small images).
      **overrides: any other :class:`ViT` field (``num_layers=2``, ``remat=True``...).

    Example:
      >>> from jamp.models import vit
      >>> vit.create("s16", num_classes=1000).hidden_size
      384
    """
    size, patch_size = parse_variant(variant, patch_size)
    fields = {f.name for f in dataclasses.fields(ViT)} - {"parent", "name"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"Unknown ViT field(s) {unknown}; valid: {sorted(fields)}.")
    return ViT(num_classes=num_classes, patch_size=patch_size,
               **{**VARIANTS[size], **overrides})
