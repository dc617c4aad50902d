"""fp8 in NNX models: the state variable, the delayed-scaling matmul, install and own loops.

NNX has no fp8 layers: :class:`DelayedScalingDot` holds one matmul's delayed-scaling
state in six :class:`Fp8Meta` variables and runs flax's same
``fp8_scaled_dot_general``. ``jamp.apply_policy`` calls :func:`nnx_install` on
every layer under the policy; what it installs comes from the recipe's strategy
(:mod:`jamp.fp8.recipe`). :func:`nnx_state` reads a model's state as a pure dict
(the ``fp8`` of a :class:`jamp.fp8.TrainState`); an NNX training loop of your own
runs the forward pass inside :func:`nnx_max_combined` and commits each applied
step with :func:`nnx_commit`.

Example:
  >>> import jax.numpy as jnp, jamp; from flax import nnx
  >>> layer = nnx.Linear(3, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  >>> jamp.fp8.nnx_install(layer, jamp.fp8.Fp8Recipe("delayed", amax_history_length=4))
  True
  >>> jamp.fp8.nnx_state(layer)["dot_general"]["input_amax_history"].shape
  (4,)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from jamp.fp8.ops import META_NAMES, delayed_scaling_dot_general, init_meta

if TYPE_CHECKING:
    from jamp.fp8.recipe import Fp8Recipe


class Fp8Meta(nnx.Variable):
    """An NNX variable of delayed-scaling state (a scale or an amax history).

    Differentiate it (``nnx.DiffState(0, jamp.fp8.PARAMS_AND_META)``): its
    gradient is its new value, written back by :func:`nnx_commit`.
    """


PARAMS_AND_META = nnx.Any(nnx.Param, Fp8Meta)
"""The NNX filter to differentiate for delayed scaling: parameters and :class:`Fp8Meta`."""


class DelayedScalingDot(nnx.Module):
    """NNX delayed-scaling fp8 matmul: a ``dot_general`` (or ``einsum`` op) holding its state.

    Install it as ``linear.dot_general`` of ``nnx.Linear``/``nnx.LinearGeneral``
    or ``einsum.einsum_op`` of ``nnx.Einsum`` (``jamp.apply_policy`` does it in
    mode ``"fp8"``); the six :class:`Fp8Meta` variables hold flax's state.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> dot = jamp.fp8.DelayedScalingDot(amax_history_length=8)
      >>> dot.input_scale.shape, dot.kernel_amax_history.shape
      ((1,), (8,))
    """

    def __init__(self, amax_history_length: int = 1024):
        for name, value in init_meta(amax_history_length).items():
            setattr(self, name, Fp8Meta(value))

    def meta(self) -> dict[str, jax.Array]:
        """The six state values, read (flax's names).

        Example:
          >>> import jamp
          >>> sorted(jamp.fp8.DelayedScalingDot(4).meta())[0]
          'input_amax_history'
        """
        return {n: getattr(self, n)[...] for n in META_NAMES}

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        if args and isinstance(args[0], str):  # einsum_op(subscripts, lhs, rhs, ...)
            subscripts, lhs, rhs = args
            dot = lambda a, b, dims, precision=None, preferred_element_type=None: (
                delayed_scaling_dot_general(a, b, dims, self.meta()))
            return jnp.einsum(subscripts, lhs.astype(rhs.dtype), rhs, _dot_general=dot)
        lhs, rhs, dims = args
        return delayed_scaling_dot_general(lhs, rhs, dims, self.meta())


NNX_LAYERS: tuple[type, ...] = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
"""NNX layers whose matmul the fp8 modes replace (and modules with ``dot_general_names``)."""


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _stacked_shape(layer: nnx.Module) -> tuple[int, ...]:
    """The leading axes ``nnx.vmap`` stacked ``layer`` along (``()`` for a single layer).

    A layer created under ``nnx.vmap`` (e.g. the scanned blocks of a ViT) has a
    kernel with extra leading axes; its delayed-scaling state gets the same ones,
    so ``nnx.scan`` gives each layer its own state (as linen's ``nn.scan`` with
    the collection in ``variable_axes``).
    """
    if isinstance(layer, nnx.Einsum):
        own = len(layer.kernel_shape)
    elif isinstance(layer, nnx.LinearGeneral):
        own = len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
    else:
        own = 2
    shape = tuple(layer.kernel.shape)
    return shape[:len(shape) - own]


def delayed_dot(amax_history_length: int, stacked: tuple[int, ...] = ()) -> DelayedScalingDot:
    """A :class:`DelayedScalingDot` whose state has the leading axes ``stacked``.

    Example:
      >>> import jamp
      >>> jamp.fp8.nnx.delayed_dot(4, (3,)).kernel_amax_history.shape
      (3, 4)
    """
    dot = DelayedScalingDot(amax_history_length)
    for meta in jax.tree_util.tree_leaves(nnx.state(dot, Fp8Meta), is_leaf=_is_variable):
        meta.set_value(jnp.broadcast_to(meta.get_value(), stacked + meta.shape))
    return dot


def _check_declared(layer: nnx.Module, names: Any) -> None:
    if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise TypeError(
            f"{type(layer).__name__}.dot_general_names must be a tuple of distinct matmul "
            f"names (e.g. ('query', 'key', 'value', 'out')), got {names!r}.")


def nnx_install(layer: nnx.Module, recipe: Fp8Recipe, name: Any = None) -> bool:
    """Gives an ``nnx.Linear``/``LinearGeneral``/``Einsum`` an fp8 matmul, in place.

    Returns whether ``layer`` is such a layer or declares ``dot_general_names``
    (and ``name``, the last component of its path, is not in
    ``recipe.keep_bf16``). Delayed scaling installs a
    :class:`DelayedScalingDot` (its :class:`Fp8Meta` state becomes part of the
    layer's state; a layer stacked by ``nnx.vmap`` gets one state per layer, the
    stacked axes leading); current scaling installs :func:`current_scaling_dot_general`.

    Other NNX modules join by declaring their matmuls: a class attribute
    ``dot_general_names`` (e.g. ``("query", "key", "value", "out")``) and an
    attribute ``dot_general`` that each of those matmuls calls (``None``:
    ``lax.dot_general``), or, when ``dot_general`` is a mapping, calls its
    own entry ``dot_general[name]``. Current scaling sets ``dot_general`` to
    :func:`current_scaling_dot_general`; delayed scaling to an ``nnx.Dict``
    of one :class:`DelayedScalingDot` per name. A module that ``nnx.vmap``
    may stack also defines ``stacked_shape()`` (its leading stacked axes) so
    that each stacked layer gets its own state. The NNX ViT's
    :class:`jamp.models.vit_nnx.SelfAttention` is one.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> layer = nnx.Linear(3, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> jamp.fp8.nnx_install(layer, jamp.fp8.Fp8Recipe("current"))
      True
      >>> layer.dot_general.__name__
      'current_scaling_dot_general'
    """
    names = getattr(type(layer), "dot_general_names", None)
    if not (isinstance(layer, NNX_LAYERS) or names) or (
            name is not None and not recipe.applies_to(str(name))):
        return False
    strategy = recipe.strategy
    if not isinstance(layer, NNX_LAYERS):  # a module declaring its matmuls (dot_general_names)
        _check_declared(layer, names)
        stacked = tuple(getattr(layer, "stacked_shape", lambda: ())())
        layer.dot_general = strategy.nnx_declared_dot(tuple(names), stacked)
        return True
    einsum = isinstance(layer, nnx.Einsum)
    setattr(layer, "einsum_op" if einsum else "dot_general",
            strategy.nnx_dot(einsum, _stacked_shape(layer)))
    return True


@contextlib.contextmanager
def nnx_max_combined(model: nnx.Module) -> Iterator[nnx.Module]:
    """Within it, ``model``'s :class:`Fp8Meta` values are flax ``fm32``: every use combines by max.

    :func:`as_meta` for an NNX model, in place and undone on exit (the model's
    state stays float32 outside). Use it inside the function you differentiate,
    around the forward pass, before any ``nnx.scan``/``nnx.RNN`` captures the
    state.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> layer = nnx.Linear(3, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> jamp.fp8.nnx_install(layer, jamp.fp8.Fp8Recipe("delayed", amax_history_length=2))
      True
      >>> def loss(m):  # two uses of one matmul: inputs of amax 1 and 3
      ...     with jamp.fp8.nnx_max_combined(m):
      ...         return (m(jnp.ones((1, 3))) + m(jnp.full((1, 3), 3.0))).astype(jnp.float32).sum()
      >>> grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, jamp.fp8.PARAMS_AND_META)))(layer)
      >>> _ = jamp.fp8.nnx_commit(layer, grads)
      >>> float(layer.dot_general.input_amax_history[0])  # the max, not the sum (4.0)
      3.0
    """
    metas = [v for _, v in nnx.iter_graph(model) if isinstance(v, Fp8Meta)]
    for meta in metas:
        if meta.get_value().dtype != fp8_ops.fm32:
            meta.set_value(jax.lax.convert_element_type(meta.get_value(), fp8_ops.fm32))
    try:
        yield model
    finally:
        for meta in metas:
            meta.set_value(jax.lax.convert_element_type(meta.get_value(), jnp.float32))


def nnx_commit(model: nnx.Module, grads: nnx.State, applied: jax.Array | bool = True
               ) -> nnx.State:
    """Writes the :class:`Fp8Meta` gradients into ``model`` when ``applied``; returns the Params'.

    For an NNX step differentiating ``PARAMS_AND_META``: give the returned
    parameter gradients to the optimizer, and pass ``applied`` (the loss
    scale's ``last_finite`` after the update) to keep a skipped step's state.

    Run the model inside :func:`nnx_max_combined` in the differentiated
    function: a matmul used several times in one step (an ``nnx.RNN`` cell
    scanned over the time steps, a layer called twice) then keeps the max of
    its uses' amaxes. Without it the float32 state's gradients add up
    (measured: an ``nnx.RNN`` of 5 steps recorded 13.3 where the input's amax
    is 3.2).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> jamp.fp8.nnx_install(model, jamp.fp8.Fp8Recipe("delayed", amax_history_length=4))
      True
      >>> loss = lambda m: m(jnp.ones((3, 4))).astype(jnp.float32).sum()
      >>> grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, jamp.fp8.PARAMS_AND_META)))(model)
      >>> param_grads = jamp.fp8.nnx_commit(model, grads)
      >>> float(model.dot_general.input_amax_history[0])
      1.0
    """
    meta_grads = nnx.filter_state(grads, Fp8Meta)
    old = nnx.state(model, Fp8Meta)
    new = jax.tree_util.tree_map(lambda o, n: jnp.where(applied, n, o), old, meta_grads)
    nnx.update(model, new)
    return nnx.filter_state(grads, nnx.Param)


def nnx_state(model: nnx.Module) -> dict[str, Any]:
    """The model's :class:`Fp8Meta` state as a plain nested dict (``{}`` if it has none).

    Nested by attribute path down to one dict per matmul with the six
    :data:`jamp.fp8.META_NAMES` keys (layers stacked by ``nnx.vmap`` carry their
    leading axes): the ``fp8`` of a :class:`jamp.fp8.TrainState`.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> layer = nnx.Linear(3, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> jamp.fp8.nnx_state(layer)
      {}
      >>> _ = jamp.fp8.nnx_install(layer, jamp.fp8.Fp8Recipe("delayed", amax_history_length=2))
      >>> jamp.fp8.nnx_state(layer)["dot_general"]["kernel_scale"].tolist()
      [1.0]
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"nnx_state expects an nnx.Module, got {type(model).__name__}.")
    return nnx.to_pure_dict(nnx.state(model, Fp8Meta))
