"""fp8 matmuls for the ``"fp8"`` (delayed scaling) and ``"fp8_current"`` modes.

An fp8 matmul quantizes both operands to ``float8_e4m3fn`` (E4M3: 3 mantissa
bits, max 448) with one float32 scale per tensor, multiplies them with the
result in the compute dtype (bfloat16), and in the backward pass quantizes the
incoming gradient to ``float8_e5m2`` (E5M2: more range, max 57344). The scale of
a tensor ``x`` is ``amax / fp8_max``; the modes differ in which ``amax``:

- **current scaling** (stateless): the amax of the tensor itself, computed before
  each matmul. Nothing to store, checkpoint or synchronise.
- **delayed scaling** (Transformer Engine's default, ``flax.linen.fp8_ops``): the
  max of an *amax history* of the last ``amax_history_length`` steps. The state
  (three scales and three histories per matmul) lives in the
  ``"_overwrite_with_gradient"`` collection (:data:`COLLECTION`; NNX:
  :class:`Fp8Meta` variables): the backward pass returns each entry's *new value*
  as its "gradient", which the train step writes back instead of giving it to
  the optimizer.

Where each concept lives:

- :mod:`jamp.fp8.ops` -- the numerics: :func:`tensor_scale`, :func:`quantize`,
  :func:`current_scaling_dot_general` / :func:`current_scaling_einsum`,
  :func:`delayed_scaling_dot_general`, :func:`init_meta` (on flax's ``fp8_ops``).
- :mod:`jamp.fp8.recipe` -- :class:`Fp8Recipe` and its strategy
  (:class:`DelayedScaling` / :class:`CurrentScaling`): everything that depends on
  the kind of scaling, asked through ``recipe.strategy``; ``recipe.applies_to(name)``
  is the rule of which layers run fp8 (all but ``keep_bf16``, the ``head``).
- :mod:`jamp.fp8.linen` -- the linen install (:func:`linen_install`,
  :func:`linen_share_over_steps` for ``nn.RNN``, :func:`linen_einsum` for ``nn.Einsum``).
- :mod:`jamp.fp8.nnx` -- :class:`Fp8Meta`, :class:`DelayedScalingDot`,
  :func:`nnx_install`, :func:`nnx_state`, and for own NNX loops
  :func:`nnx_max_combined` / :func:`nnx_commit`.
- :mod:`jamp.fp8.state` -- training the state: :class:`TrainState` (what
  :func:`jamp.train_step` differentiates and commits), :func:`commit`,
  :func:`follow_loss_scale`, :func:`as_meta`, :func:`reduce_amax`,
  :func:`only_on_real_data`.

Where fp8 reaches (``jamp.apply_policy``, where no override applies): linen
``nn.Dense``/``nn.DenseGeneral``/``nn.Einsum`` and modules declaring ``dot_general``
and ``dot_general_cls`` fields, NNX ``Linear``/``LinearGeneral``/``Einsum`` and
modules declaring ``dot_general_names``: in the jamp ViT the MLP and the four
attention projections. Stay bf16: attention's score and value matmuls, layers
named in ``Fp8Recipe.keep_bf16`` (the ``head``), layers under an override, raw
``jnp.einsum``/``@`` on parameters in user code.

Example:
  >>> import jamp
  >>> recipe = jamp.mixed_precision("fp8").fp8           # what mode "fp8" runs
  >>> type(recipe.strategy).__name__, recipe.applies_to("head"), recipe.applies_to("fc1")
  ('DelayedScaling', False, True)
  >>> type(jamp.fp8.Fp8Recipe("current").strategy).__name__
  'CurrentScaling'
"""

from jamp.fp8.linen import (
    LINEN_LAYERS,
    linen_dot_general_cls,
    linen_einsum,
    linen_install,
    linen_share_over_steps,
)
from jamp.fp8.nnx import (
    NNX_LAYERS,
    PARAMS_AND_META,
    DelayedScalingDot,
    Fp8Meta,
    nnx_commit,
    nnx_install,
    nnx_max_combined,
    nnx_state,
)
from jamp.fp8.ops import (
    COLLECTION,
    E4M3,
    E5M2,
    META_NAMES,
    current_scaling_dot_general,
    current_scaling_einsum,
    delayed_scaling_dot_general,
    init_meta,
    quantize,
    tensor_scale,
)
from jamp.fp8.recipe import CurrentScaling, DelayedScaling, Fp8Recipe, ScalingStrategy
from jamp.fp8.state import (
    TrainState,
    as_meta,
    commit,
    follow_loss_scale,
    only_on_real_data,
    reduce_amax,
)

__all__ = [
    "COLLECTION", "E4M3", "E5M2", "LINEN_LAYERS", "META_NAMES", "NNX_LAYERS",
    "PARAMS_AND_META", "CurrentScaling", "DelayedScaling", "DelayedScalingDot", "Fp8Meta",
    "Fp8Recipe", "ScalingStrategy", "TrainState", "as_meta", "commit",
    "current_scaling_dot_general", "current_scaling_einsum", "delayed_scaling_dot_general",
    "follow_loss_scale", "init_meta", "linen_dot_general_cls", "linen_einsum",
    "linen_install", "linen_share_over_steps", "nnx_commit", "nnx_install",
    "nnx_max_combined", "nnx_state", "only_on_real_data", "quantize", "reduce_amax",
    "tensor_scale",
]
