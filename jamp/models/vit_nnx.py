"""The Vision Transformer of :mod:`jamp.models.vit`, written in Flax NNX.

The same model, hyper-parameters and computation as the linen :class:`~jamp.models.vit.ViT`
(patch embedding, class token and learned position embeddings, pre-norm encoder
blocks stacked with ``nnx.vmap``/``nnx.scan``, a float32-friendly head), taking no
dtype arguments: :func:`jamp.apply_policy` puts it under a precision policy in
place, which gives the dtypes the linen ViT gets under the same mode. NNX needs
the input size up front: ``image_size`` and ``channels`` size the patch
embedding and the position embeddings.

- **Same weights as linen**: :func:`from_linen` builds the NNX model from a linen
  ViT's parameters (bit for bit), :func:`to_linen` goes back; the parameter names
  follow linen's except for descriptive block members (:data:`LINEN_NAMES`).
- **Sharding**: every parameter carries the linen ViT's logical axis names as
  NNX ``out_sharding`` metadata (``nnx.get_partition_spec`` reads them; the
  stacked blocks get the leading ``layers`` axis), and activations are constrained
  with ``flax.linen``'s logical constraints, so ``jamp.parallel.LOGICAL_AXIS_RULES``
  shard it for data and tensor parallelism as they shard the linen ViT. A
  ``layer_runner`` (``jamp.parallel.pipeline.GPipe``) runs the stacked blocks as
  pipeline stages, through the same interface as the linen model.
- **Training it**: the trainer's view of an NNX model (``(apply_fn, params)`` for a
  ``TrainState``, the fp8 state beside it) is :mod:`jamp.nnx_functional`, not this
  module; ``vit_nnx.functional`` and ``vit_nnx.fp8_state`` still name it.

Example:
  >>> import jax.numpy as jnp, jamp
  >>> from flax import nnx
  >>> from jamp.models import vit_nnx
  >>> model = nnx.eval_shape(lambda: jamp.apply_policy(vit_nnx.create(  # shapes only here
  ...     "ti", num_classes=10, image_size=16, patch_size=4, num_layers=2, hidden_size=16,
  ...     num_heads=2, mlp_dim=32, rngs=nnx.Rngs(0)), "bf16"))
  >>> logits = nnx.eval_shape(lambda m: m(jnp.zeros((2, 16, 16, 3))), model)
  >>> logits.shape, logits.dtype, model.encoder.layers.mlp.fc1.kernel.shape
  ((2, 10), dtype('float32'), (2, 16, 32))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jamp.models import activations, norms
from jamp.models import vit as linen_vit
from jamp.models.sizes import VIT_SIZES as VARIANTS
from jamp.models.sizes import parse_variant
from jamp.models.vit import LayerRunner
from jamp.nnx import norm_in_float32

LINEN_NAMES: dict[str, str] = {"norm1": "LayerNorm_0", "attention": "SelfAttention_0",
                               "norm2": "LayerNorm_1", "mlp": "MlpBlock_0",
                               "fc1": "Dense_0", "fc2": "Dense_1"}
"""NNX attribute -> linen module name, where the two differ (every other name is the same)."""


def _partitioned(init: Callable, axes: tuple[str | None, ...]) -> Callable:
    """``init`` drawn in float32, with logical axis names as (lazy) NNX sharding metadata."""

    def init_in_f32(key, shape, dtype=jnp.float32):
        return init(key, shape, jnp.float32).astype(dtype)

    return nnx.with_partitioning(init_in_f32, axes, eager_sharding=False)


def _dropout_keys(rng: jax.Array | None, n: int) -> list[jax.Array | None]:
    return [None] * n if rng is None else list(jax.random.split(rng, n))


class MlpBlock(nnx.Module):
    """Transformer MLP: Linear(mlp_dim) -> GELU -> Linear(embed), Megatron-shardable."""

    def __init__(self, hidden_size: int, mlp_dim: int, dropout_rate: float = 0.0, *,
                 rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(
            hidden_size, mlp_dim, rngs=rngs,
            kernel_init=_partitioned(nn.initializers.xavier_uniform(), ("embed", "mlp")),
            bias_init=_partitioned(nn.initializers.normal(1e-6), ("mlp",)))
        self.fc2 = nnx.Linear(
            mlp_dim, hidden_size, rngs=rngs,
            kernel_init=_partitioned(nn.initializers.xavier_uniform(), ("mlp", "embed")),
            bias_init=_partitioned(nn.initializers.normal(1e-6), ("embed",)))
        self.dropout = nnx.Dropout(dropout_rate)

    def __call__(self, x: jax.Array, deterministic: bool = True,
                 rng: jax.Array | None = None) -> jax.Array:
        first, second = _dropout_keys(rng, 2)
        x = nn.with_logical_constraint(activations.gelu(self.fc1(x)), ("batch", "seq", "mlp"))
        x = self.dropout(x, deterministic=deterministic, rngs=first)
        return self.dropout(self.fc2(x), deterministic=deterministic, rngs=second)


class SelfAttention(nnx.Module):
    """Multi-head self-attention with ``[embed, heads, head_dim]`` kernels.

    ``dtype`` is the compute dtype (set by the jamp policy, like the NNX layers').
    The softmax is Flax's; in modes whose softmax runs in float32 the policy runs
    it in float32 with half-precision residuals, as the linen ViT's.

    The four projections (:attr:`dot_general_names`) call ``dot_general``:
    ``None`` (``lax.dot_general``), one function for all four, or a mapping
    from projection name to its own function. ``jamp.fp8.nnx_install`` (the fp8
    modes) sets it: :func:`jamp.fp8.current_scaling_dot_general`, or one
    ``jamp.fp8.DelayedScalingDot`` per projection (stacked like the parameters
    when ``nnx.vmap`` stacks the blocks). The score and value matmuls stay in
    the compute dtype; the parameters are the same whichever is set.
    """

    dot_general_names = ("query", "key", "value", "out")
    """The matmuls that call ``dot_general`` (see :func:`jamp.fp8.nnx_install`)."""

    def __init__(self, hidden_size: int, num_heads: int, dropout_rate: float = 0.0, *,
                 dtype: Any = None, param_dtype: Any = jnp.float32,
                 dot_general: Callable[..., jax.Array] | None = None, rngs: nnx.Rngs):
        self.num_heads, self.dropout_rate = num_heads, dropout_rate
        self.dtype, self.param_dtype = dtype, param_dtype
        self.dot_general = dot_general
        head_dim = hidden_size // num_heads
        init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=0,
                                                out_axis=(1, 2))
        out_init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=(0, 1),
                                                    out_axis=2)
        shape = (hidden_size, num_heads, head_dim)

        def param(init_fn, shape, axes):
            return nnx.Param(_partitioned(init_fn, axes)(rngs.params(), shape, param_dtype))

        for n in ("query", "key", "value"):
            setattr(self, f"{n}_kernel", param(init, shape, ("embed", "heads", "kv")))
            setattr(self, f"{n}_bias", param(nn.initializers.zeros, shape[1:], ("heads", "kv")))
        self.out_kernel = param(out_init, (num_heads, head_dim, hidden_size),
                                ("heads", "kv", "embed"))
        self.out_bias = param(nn.initializers.zeros, (hidden_size,), ("embed",))

    def stacked_shape(self) -> tuple[int, ...]:
        """The leading axes ``nnx.vmap`` stacked this module along (``()`` for one layer).

        Example:
          >>> from flax import nnx
          >>> from jamp.models import vit_nnx
          >>> vit_nnx.SelfAttention(8, 2, rngs=nnx.Rngs(0)).stacked_shape()
          ()
        """
        return tuple(self.out_bias.shape[:-1])  # out_bias is [embed] per layer

    def _dot(self, name: str) -> Callable[..., jax.Array]:
        dot = self.dot_general
        if isinstance(dot, Mapping):
            return dot[name]
        if dot is not None:
            return dot
        return lambda a, b, dims: jax.lax.dot_general(  # as jnp.einsum calls it
            a, b, dims, preferred_element_type=jnp.result_type(a, b))

    def __call__(self, x: jax.Array, deterministic: bool = True,
                 rng: jax.Array | None = None) -> jax.Array:
        names = [f"{n}_{w}" for n in ("query", "key", "value") for w in ("kernel", "bias")]
        x, *weights = nn.dtypes.promote_dtype(
            x, *[getattr(self, n).get_value() for n in names], self.out_kernel.get_value(),
            self.out_bias.get_value(), dtype=self.dtype)
        # The dots jnp.einsum makes of "bse,ehd->bshd" and "bshd,hde->bse" (the same jaxpr by
        # default), as the linen ViT's.
        q, k, v = [self._dot(n)(x, weights[2 * i], (((x.ndim - 1,), (0,)), ((), ())))
                   + weights[2 * i + 1] for i, n in enumerate(("query", "key", "value"))]
        q, k, v = (nn.with_logical_constraint(t, ("batch", "seq", "heads", "kv"))
                   for t in (q, k, v))
        y = nn.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=self.dropout_rate,
                                     deterministic=deterministic or not self.dropout_rate)
        out = self._dot("out")(y, weights[-2], (((y.ndim - 1, y.ndim - 2), (1, 0)), ((), ())))
        return out + weights[-1]


def _layer_norm(hidden_size: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return norms.NnxLayerNorm(hidden_size, rngs=rngs, promote_dtype=norm_in_float32,
                              scale_init=_partitioned(nn.initializers.ones, ("embed",)),
                              bias_init=_partitioned(nn.initializers.zeros, ("embed",)))


class EncoderBlock(nnx.Module):
    """Pre-LN transformer block: ``x + attention(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_dim: int,
                 dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0, *,
                 rngs: nnx.Rngs):
        self.norm1 = _layer_norm(hidden_size, rngs)
        self.attention = SelfAttention(hidden_size, num_heads, attention_dropout_rate,
                                       rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate)
        self.norm2 = _layer_norm(hidden_size, rngs)
        self.mlp = MlpBlock(hidden_size, mlp_dim, dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array, deterministic: bool = True,
                 rng: jax.Array | None = None) -> jax.Array:
        attention_key, dropout_key, mlp_key = _dropout_keys(rng, 3)
        y = self.attention(self.norm1(x), deterministic, attention_key)
        y = self.dropout(y, deterministic=deterministic, rngs=dropout_key)
        x = nn.with_logical_constraint(x + y, ("batch", "seq", "embed"))
        y = self.mlp(self.norm2(x), deterministic, mlp_key)
        return nn.with_logical_constraint(x + y, ("batch", "seq", "embed"))


class Encoder(nnx.Module):
    """``num_layers`` encoder blocks: stacked (``layers``, one leading axis) or ``layers_{i}``.

    Stacked blocks are created with ``nnx.vmap`` and applied with ``nnx.scan``
    (optionally through ``nnx.remat``); with a ``layer_runner`` the runner applies
    them (e.g. as GPipe stages), as in the linen :class:`jamp.models.vit.Encoder`.
    """

    def __init__(self, num_layers: int, hidden_size: int, num_heads: int, mlp_dim: int,
                 dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0,
                 scan_layers: bool = True, remat: bool = False,
                 layer_runner: LayerRunner | None = None, *, rngs: nnx.Rngs):
        if layer_runner is not None and not scan_layers:
            raise ValueError("A layer_runner runs the scanned blocks: set scan_layers=True.")
        self.num_layers, self.scan_layers, self.remat = num_layers, scan_layers, remat
        self.layer_runner = layer_runner
        self.has_dropout = bool(dropout_rate or attention_dropout_rate)
        make = lambda r: EncoderBlock(hidden_size, num_heads, mlp_dim, dropout_rate,
                                      attention_dropout_rate, rngs=r)
        if scan_layers:
            @nnx.split_rngs(splits=num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stack(r):
                return make(r)

            self.layers = stack(rngs)
        else:
            for i in range(num_layers):
                setattr(self, f"layers_{i}", make(rngs))

    def _block(self, deterministic: bool) -> Callable:
        def block(layer, x, key):
            return layer(x, deterministic, key)

        return nnx.remat(block, prevent_cse=not self.scan_layers) if self.remat else block

    def _scan(self, layers: EncoderBlock, x: jax.Array, deterministic: bool,
              rng: jax.Array | None) -> jax.Array:
        length = jax.tree_util.tree_leaves(nnx.state(layers, nnx.Param))[0].shape[0]
        keys = None if rng is None else jax.random.split(rng, length)
        scan = nnx.scan(self._block(deterministic),
                        in_axes=(0, nnx.Carry, None if keys is None else 0),
                        out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        return scan(layers, x, keys)

    def __call__(self, x: jax.Array, deterministic: bool = True,
                 rng: jax.Array | None = None) -> jax.Array:
        rng = None if deterministic or not self.has_dropout else rng
        if not self.scan_layers:
            block = self._block(deterministic)
            for i, key in enumerate(_dropout_keys(rng, self.num_layers)):
                x = block(getattr(self, f"layers_{i}"), x, key)
            return x
        if self.layer_runner is None:
            return self._scan(self.layers, x, deterministic, rng)
        # The runner splits every [num_layers, ...] leaf: the params and any other state of
        # the blocks (e.g. the fp8 delayed-scaling state, whose gradient, its new value, the
        # runner's on_tick hook keeps to real microbatches).
        graphdef, params, other = nnx.split(self.layers, nnx.Param, ...)
        layer_variables = {"params": nnx.to_pure_dict(params)}
        if jax.tree_util.tree_leaves(other):
            layer_variables["other"] = nnx.to_pure_dict(other)

        def apply_layers(variables, h, key):
            layers = nnx.merge(graphdef, variables["params"], variables.get("other", other))
            return self._scan(layers, h, deterministic, key)

        return self.layer_runner(apply_layers, layer_variables, x, rng)


class ViT(nnx.Module):
    """Vision Transformer classifier with a class token and learned position embeddings.

    ``num_classes``, ``patch_size``, ``hidden_size``, ``num_layers``, ``num_heads``,
    ``mlp_dim``, ``dropout_rate``, ``attention_dropout_rate``, ``scan_layers``, ``remat``
    and ``layer_runner`` are as the fields of the linen :class:`jamp.models.vit.ViT`.

    Args:
      image_size: side of the square input images, or ``(height, width)``.
      channels: channels of the input images.
      rngs: ``nnx.Rngs`` with a ``params`` stream for the initial weights. Dropout
        keys are passed to the call, not held by the model.

    Example: see the module docstring.
    """

    def __init__(self, num_classes: int, patch_size: int, hidden_size: int, num_layers: int,
                 num_heads: int, mlp_dim: int, dropout_rate: float = 0.0,
                 attention_dropout_rate: float = 0.0, scan_layers: bool = True,
                 remat: bool = False, layer_runner: LayerRunner | None = None, *,
                 image_size: int | tuple[int, int], channels: int = 3, rngs: nnx.Rngs):
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
        if height % patch_size or width % patch_size:
            raise ValueError(
                f"Image size {height}x{width} is not divisible by patch_size={patch_size}: "
                "resize the images or choose a patch size that divides them.")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by "
                             f"num_heads={num_heads}.")
        self.image_size, self.patch_size, self.channels = (height, width), patch_size, channels
        self.embedding = nnx.Conv(
            channels, hidden_size, (patch_size, patch_size), strides=(patch_size, patch_size),
            padding="VALID", rngs=rngs,
            kernel_init=_partitioned(nn.initializers.lecun_normal(), (None, None, None, "embed")),
            bias_init=_partitioned(nn.initializers.zeros, ("embed",)))
        seq = (height // patch_size) * (width // patch_size) + 1
        self.cls = nnx.Param(_partitioned(nn.initializers.zeros, (None, None, "embed"))(
            rngs.params(), (1, 1, hidden_size)))
        self.pos_embedding = nnx.Param(_partitioned(
            nn.initializers.normal(0.02), (None, "seq", "embed"))(
            rngs.params(), (1, seq, hidden_size)))
        self.dropout = nnx.Dropout(dropout_rate)
        self.encoder = Encoder(num_layers, hidden_size, num_heads, mlp_dim, dropout_rate,
                               attention_dropout_rate, scan_layers, remat, layer_runner,
                               rngs=rngs)
        self.encoder_norm = _layer_norm(hidden_size, rngs)
        self.head = nnx.Linear(
            hidden_size, num_classes, rngs=rngs,
            kernel_init=_partitioned(nn.initializers.zeros, ("embed", "vocab")),
            bias_init=_partitioned(nn.initializers.zeros, ("vocab",)))

    def __call__(self, images: jax.Array, train: bool = False,
                 rngs: nnx.Rngs | jax.Array | None = None) -> jax.Array:
        """Maps ``[batch, height, width, channels]`` images to ``[batch, num_classes]`` logits.

        ``rngs`` (``nnx.Rngs`` with a ``dropout`` stream, or a key) draws the
        dropout masks when ``train`` and the model has dropout.
        """
        if images.ndim != 4:
            raise ValueError(
                "ViT expects images of shape [batch, height, width, channels], got "
                f"{images.shape}.")
        if tuple(images.shape[1:3]) != self.image_size:
            raise ValueError(
                f"This ViT was built for {self.image_size[0]}x{self.image_size[1]} images "
                f"(image_size sizes its position embeddings), got {images.shape[1]}x"
                f"{images.shape[2]}: resize the images or build the model with "
                f"image_size={tuple(images.shape[1:3])}.")
        if images.shape[-1] != self.channels:
            raise ValueError(f"This ViT was built for images with channels={self.channels}, got "
                             f"{images.shape[-1]} channels: build it with "
                             f"channels={images.shape[-1]}.")
        rng = None
        if train and (self.dropout.rate or self.encoder.has_dropout):
            if rngs is None:
                raise ValueError("Training with dropout needs rngs: call model(images, "
                                 "train=True, rngs=nnx.Rngs(dropout=key)) or pass a key.")
            rng = rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs
        embed_key, encoder_key = _dropout_keys(rng, 2)
        x = self.embedding(images)
        batch, h, w, c = x.shape
        x = x.reshape(batch, h * w, c)
        cls = jnp.broadcast_to(self.cls.get_value(), (batch, 1, c)).astype(x.dtype)
        x = jnp.concatenate([cls, x], axis=1)
        x = nn.with_logical_constraint(x + self.pos_embedding.get_value().astype(x.dtype),
                                       ("batch", "seq", "embed"))
        x = self.dropout(x, deterministic=not train, rngs=embed_key)
        x = self.encoder(x, not train, encoder_key)
        return self.head(self.encoder_norm(x[:, 0]))


def create(variant: str, *, num_classes: int, image_size: int | tuple[int, int],
           channels: int = 3, patch_size: int = 16, rngs: nnx.Rngs, **overrides: Any) -> ViT:
    """Returns an NNX ViT of a named size: ``"ti"``, ``"s"``, ``"b"`` or ``"l"``.

    As :func:`jamp.models.vit.create`, plus the input size NNX needs up front.

    Example:
      >>> from flax import nnx
      >>> from jamp.models import vit_nnx
      >>> model = nnx.eval_shape(lambda: vit_nnx.create(  # shapes only: nothing computed
      ...     "ti4", num_classes=10, image_size=8, num_layers=1, rngs=nnx.Rngs(0)))
      >>> model.pos_embedding.shape  # 2 x 2 patches and the class token
      (1, 5, 192)
    """
    size, patch_size = parse_variant(variant, patch_size)
    fields = {f.name for f in dataclasses.fields(linen_vit.ViT)} - {"parent", "name"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"Unknown ViT field(s) {unknown}; valid: {sorted(fields)}.")
    return ViT(num_classes=num_classes, patch_size=patch_size, image_size=image_size,
               channels=channels, rngs=rngs, **{**VARIANTS[size], **overrides})


# ----------------------------------------------------------------------------- linen <-> NNX


def _linen_path(path: tuple) -> tuple[str, ...]:
    return tuple(LINEN_NAMES.get(str(p), str(p)) for p in path)


def _params_of(variables: Mapping[str, Any]) -> dict[str, Any]:
    params = nn.unbox(variables)
    if not isinstance(params, Mapping):
        raise TypeError(f"expected the linen ViT's params (a dict), got {type(params).__name__}.")
    if set(params) == {"params"}:
        params = params["params"]
    return dict(params)


def from_linen(module: linen_vit.ViT | nn.Module, params: Mapping[str, Any], *,
               image_size: int | tuple[int, int] | None = None) -> ViT:
    """The NNX ViT with exactly the weights of a linen ViT.

    Args:
      module: the linen :class:`jamp.models.vit.ViT` (or ``jamp.apply_policy`` of
        one); its fields give the NNX model's hyper-parameters.
      params: its parameters (``init(...)["params"]``, boxed or not, or the
        whole variables dict), in any dtype: the NNX params get these arrays.
      image_size: the input size; by default the square size that the position
        embeddings were made for.

    Returns:
      An ``nnx.Module`` without a policy: apply one as to any NNX model (the
      params are rounded to its param dtype as linen's are).

    Raises:
      ValueError: if ``params`` do not fit ``module`` (a missing, extra or
        mis-shaped parameter is named).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jamp.models import vit, vit_nnx
      >>> module = vit.create("ti", num_classes=3, patch_size=4, num_layers=2, hidden_size=8,
      ...                     num_heads=2, mlp_dim=8)
      >>> params = jax.jit(module.init)(jax.random.key(0), jnp.ones((1, 8, 8, 1)))["params"]
      >>> model = vit_nnx.from_linen(module, params)
      >>> kernel = params["encoder"]["layers"]["MlpBlock_0"]["Dense_0"]["kernel"]
      >>> np.array_equal(model.encoder.layers.mlp.fc1.kernel.get_value(), kernel.value)
      True
    """
    module = getattr(module, "inner", module)  # a jamp.apply_policy wrapper
    if not isinstance(module, linen_vit.ViT):
        raise TypeError(f"from_linen expects a jamp.models.vit.ViT, got {type(module).__name__}.")
    params = _params_of(params)
    try:
        kernel, pos = params["embedding"]["kernel"], params["pos_embedding"]
    except (KeyError, TypeError):
        raise ValueError("params are not a linen ViT's: they need 'embedding' and "
                         "'pos_embedding' entries.") from None
    if image_size is None:
        side = math.isqrt(pos.shape[1] - 1)
        if side * side != pos.shape[1] - 1:
            raise ValueError(f"The position embeddings hold {pos.shape[1] - 1} patches, not a "
                             "square number: pass image_size=(height, width).")
        image_size = side * module.patch_size
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(linen_vit.ViT)
              if f.name not in ("parent", "name")}
    model = nnx.eval_shape(lambda: ViT(**fields, image_size=image_size, channels=kernel.shape[2],
                                       rngs=nnx.Rngs(0)))
    flat = {_linen_path(path): value for path, value in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}
    given = {path: value for path, value in
             jax.tree_util.tree_flatten_with_path(params)[0]}
    given = {tuple(str(k.key) for k in path): value for path, value in given.items()}
    missing, extra = sorted(set(flat) - set(given)), sorted(set(given) - set(flat))
    if missing or extra:
        raise ValueError(f"params do not fit the ViT {module.__class__.__name__}: missing "
                         f"{['/'.join(p) for p in missing]}, unexpected "
                         f"{['/'.join(p) for p in extra]}.")
    for path, variable in flat.items():
        value = jnp.asarray(given[path])
        if value.shape != variable.shape:
            raise ValueError(f"params[{'/'.join(path)}] has shape {value.shape}; this ViT "
                             f"needs {variable.shape}.")
        variable.set_value(value)
    return model


def to_linen(model: ViT) -> dict[str, Any]:
    """The linen ViT's ``params`` dict holding an NNX ViT's weights (the same arrays).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jamp.models import vit_nnx
      >>> model = nnx.eval_shape(lambda: vit_nnx.create(
      ...     "ti", num_classes=3, image_size=4, patch_size=2, num_layers=1, hidden_size=8,
      ...     num_heads=2, mlp_dim=8, rngs=nnx.Rngs(0)))
      >>> sorted(vit_nnx.to_linen(model)["encoder"]["layers"])
      ['LayerNorm_0', 'LayerNorm_1', 'MlpBlock_0', 'SelfAttention_0']
    """
    if not isinstance(model, ViT):
        raise TypeError(f"to_linen expects a jamp.models.vit_nnx.ViT, got "
                        f"{type(model).__name__}.")
    out: dict[str, Any] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        *parents, leaf = _linen_path(path)
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = variable.get_value()
    return out


def __getattr__(name: str) -> Any:
    """``vit_nnx.functional`` and ``vit_nnx.fp8_state``: the trainer's view of an NNX model
    lives in :mod:`jamp.nnx_functional` (it is not part of the model); these names are kept
    for code written against them and resolved on first use, so the model module imports
    nothing of the trainer's."""
    if name in ("functional", "fp8_state"):
        from jamp import nnx_functional

        return getattr(nnx_functional, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
