"""Master weights for bfloat16 parameters, from 4 bytes per parameter to 0.

A bf16 parameter updated in bf16 loses every increment below half an ulp (2**-9
relative): with small learning rates most updates vanish. :func:`bf16_master` wraps any
optax optimizer so that it runs in float32 on a float32 view of the parameters, and
keeps that view in one of five ways (``scheme``):

- ``"float32"``: a float32 copy (4 bytes per parameter); the bf16 parameter is the copy
  rounded to nearest, ties away from zero.
- ``"remainders"``: the low 16 bits of that float32 copy (2 bytes; Megatron-core's
  ``store_param_remainders``). The high 16 bits follow from the bf16 parameter and the
  remainder's top bit, so the copy is rebuilt exactly: bit-identical to ``"float32"``.
  (Rounding ties to even instead could not be undone: the float32 values
  ``(h << 16) | 0x8000`` for an even ``h`` and ``h - 1`` give the same bf16 parameter
  and the same low bits.)
- ``"kahan"``: a bf16 compensation buffer holding what rounding the parameter lost
  (2 bytes; Kahan summation of the updates, as in "Revisiting BFloat16 Training").
- ``"stochastic"``: no buffer (0 bytes): the new parameter is rounded up or down at
  random, with the probability that makes it exact on average. The random bits depend
  on ``seed``, the step and the leaf's position only, so every replica of a leaf (and
  every sharding of it) rounds alike.
- ``"none"``: no buffer, rounded to nearest. Lossy: an update below half an ulp of the
  parameter vanishes (``tests/test_optim_state.py`` shows it).

Float32 leaves (e.g. norms kept in float32) are updated in float32 in every scheme.

Example:
  >>> import jax.numpy as jnp, optax, jamp
  >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}
  >>> tx = jamp.optim_state.bf16_master(optax.sgd(1e-4), "remainders")
  >>> state = tx.init(params)
  >>> for _ in range(10):
  ...   updates, state = tx.update({"w": jnp.ones((2,), jnp.bfloat16)}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> round(float(jamp.optim_state.master_view(state, params)["w"][0]), 6)  # bf16 alone: 1.0
  0.999
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.core import meta

SCHEMES: tuple[str, ...] = ("float32", "remainders", "kahan", "stochastic", "none")
"""The master-weight schemes of :func:`bf16_master`, largest first."""

BYTES_PER_PARAM = {"float32": 4, "remainders": 2, "kahan": 2, "stochastic": 0, "none": 0}
"""What each scheme keeps per bf16 parameter, besides the parameter itself."""


class Bf16MasterState(NamedTuple):
    """State of :func:`bf16_master`.

    Attributes:
      master: per parameter, the scheme's buffer: the float32 copy (``"float32"``), the
        low 16 bits as uint16 (``"remainders"``), the bf16 compensation (``"kahan"``),
        a scalar placeholder for float32 leaves; ``optax.EmptyState()`` for the schemes
        without one.
      count: the steps applied (the stochastic rounding's step).
      inner_state: the inner optimizer's state.
    """

    master: Any
    count: jax.Array
    inner_state: optax.OptState


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _f32(x: Any) -> Any:
    return x.astype(jnp.float32) if _floating(x) else x


def _map_boxed(fn, params: Any) -> Any:
    """``fn`` on each parameter (unboxed); a result of the parameter's shape keeps its box."""
    def one(x):
        if not _is_box(x):
            return fn(x)
        y = fn(x.unbox())
        return x.replace_boxed(y) if jnp.shape(y) == jnp.shape(x.unbox()) else y
    return jax.tree_util.tree_map(one, params, is_leaf=_is_box)


def _unboxed(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x.unbox() if _is_box(x) else x, tree,
                                  is_leaf=_is_box)


def round_nearest_away(x: jax.Array) -> jax.Array:
    """float32 -> bfloat16, to nearest with ties away from zero (the bits' top half).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> x = jnp.array([1 + 2**-8], jnp.float32)   # a tie between two bf16 values
      >>> float(jamp.optim_state.master.round_nearest_away(x)[0]), float(x.astype(jnp.bfloat16)[0])
      (1.0078125, 1.0)
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    high = ((bits + jnp.uint32(0x8000)) >> 16).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(high, jnp.bfloat16)


def split_remainders(master: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(bf16 parameter, uint16 remainder)`` of a float32 master value.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> m = jnp.array([0.1, -3.3e-5, 7.0], jnp.float32)
      >>> p, r = jamp.optim_state.master.split_remainders(m)
      >>> bool((jamp.optim_state.master.join_remainders(p, r) == m).all())
      True
    """
    bits = jax.lax.bitcast_convert_type(master.astype(jnp.float32), jnp.uint32)
    return round_nearest_away(master), (bits & jnp.uint32(0xFFFF)).astype(jnp.uint16)


def join_remainders(param: jax.Array, remainder: jax.Array) -> jax.Array:
    """The float32 master that ``param`` (bf16) and ``remainder`` (uint16) stand for.

    The parameter's bits are the master's top half, plus one where the remainder is
    ``>= 0x8000`` (rounded away): subtract that and put the remainder below.

    Example: see :func:`split_remainders`.
    """
    high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32)
    rem = remainder.astype(jnp.uint32)
    high = high - (rem >> 15)
    return jax.lax.bitcast_convert_type((high << 16) | rem, jnp.float32)


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
    """float32 -> bfloat16, rounded up (in magnitude) with probability equal to the
    dropped fraction of an ulp: exact on average.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> x = jnp.full((10000,), 1 + 2**-10, jnp.float32)  # a quarter of a bf16 ulp above 1
      >>> r = jamp.optim_state.master.stochastic_round(x, jax.random.key(0)).astype(jnp.float32)
      >>> abs(float(r.mean()) - (1 + 2**-10)) < 1e-4
      True
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    rounded = ((bits + noise) >> 16).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(rounded, jnp.bfloat16)


def _check_params(params: Any, scheme: str) -> None:
    dtypes = {jnp.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(_unboxed(params))
              if _floating(x)}
    if scheme in ("remainders", "stochastic") and "float16" in dtypes:
        raise ValueError(
            f"master_weights={scheme!r} works on bfloat16 parameters (a bf16 value is the top "
            "half of a float32), and this model has float16 ones: use master_weights="
            "'float32' or 'kahan' with float16 parameters, or params in bfloat16.")
    if scheme != "float32" and not dtypes & {"bfloat16", "float16"}:
        raise ValueError(
            f"master_weights={scheme!r} keeps half-precision parameters accurate, and every "
            f"parameter here is {' / '.join(sorted(dtypes)) or 'non-floating'}: a float32 "
            "parameter is its own master. Keep the parameters in bfloat16 (mode "
            "'bf16_lowmem', or policy='p=bf16,c=bf16,o=f32'), or drop master_weights.")


def bf16_master(inner: optax.GradientTransformation, scheme: str = "remainders", *,
                seed: int = 0) -> optax.GradientTransformation:
    """Runs ``inner`` in float32 on bf16 parameters, keeping the master as ``scheme`` says.

    ``update`` needs ``params``. It builds the float32 view of the parameters (the
    master), runs ``inner`` on it with float32 gradients, applies the updates, stores
    the new master the scheme's way, and returns updates with which
    ``optax.apply_updates(params, updates)`` gives the new bf16 parameters exactly
    (float32 leaves: the new float32 values). Put the loss scale outside it
    (:func:`jamp.make_optimizer` does), so a skipped step changes nothing.

    Args:
      inner: any optax optimizer (wrap it in :func:`jamp.low_precision_state` for small
        moments: ``bf16_master(low_precision_state(tx, ...), ...)``).
      scheme: one of :data:`SCHEMES` (see the module docstring).
      seed: the stochastic rounding's seed.

    Returns:
      An ``optax.GradientTransformation`` with :class:`Bf16MasterState`.

    Raises:
      ValueError: an unknown scheme (at once); float16 parameters with ``"remainders"``
        or ``"stochastic"``, or no half-precision parameter at all (at ``init``).

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> tx = jamp.optim_state.bf16_master(optax.adam(1e-3), "kahan")
      >>> tx.init({"w": jnp.ones(3, jnp.bfloat16)}).master["w"].dtype
      dtype(bfloat16)
    """
    if scheme not in SCHEMES:
        raise ValueError(f"Unknown master_weights scheme {scheme!r}. Valid: "
                         f"{', '.join(SCHEMES)} (bytes per bf16 parameter: "
                         f"{', '.join(f'{k} {v}' for k, v in BYTES_PER_PARAM.items())}).")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}.")

    def half(x) -> bool:
        return _floating(x) and x.dtype in (jnp.bfloat16, jnp.float16)

    def make_buffer(x):
        if not half(x):
            return jnp.zeros((), jnp.uint16)
        if scheme == "float32":
            return x.astype(jnp.float32)
        if scheme == "remainders":  # a bf16 parameter is its own top half: remainder 0
            return jnp.zeros(x.shape, jnp.uint16)
        return jnp.zeros(x.shape, x.dtype)  # kahan

    def view(params, master):
        """The float32 master view of ``params``."""
        if scheme in ("stochastic", "none"):
            return jax.tree_util.tree_map(_f32, params)

        def one(p, m):
            if not half(p):
                return _f32(p)
            if scheme == "float32":
                return m
            if scheme == "remainders":
                return join_remainders(p, m)
            return p.astype(jnp.float32) + m.astype(jnp.float32)  # kahan
        return jax.tree_util.tree_map(one, params, master)

    def init_fn(params):
        _check_params(params, scheme)
        master = (optax.EmptyState() if scheme in ("stochastic", "none")
                  else _map_boxed(make_buffer, params))
        inner_state = inner.init(_map_boxed(_f32, params))
        return Bf16MasterState(master, jnp.zeros((), jnp.int32), inner_state)

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(f"jamp.optim_state.bf16_master({scheme!r}) needs the current "
                             "params: call tx.update(grads, opt_state, params).")
        master = view(params, state.master)
        grads = jax.tree_util.tree_map(_f32, updates)
        steps, inner_state = inner.update(grads, state.inner_state, master, **extra_args)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        key = jax.random.fold_in(jax.random.key(seed), state.count)

        def one(i, p, m, u, buf):
            if not half(p):
                new = m + u
                return new - _f32(p), buf
            if scheme == "kahan":
                y = u + buf.astype(jnp.float32)
                exact = p.astype(jnp.float32) + y
                new = exact.astype(p.dtype)
                return new.astype(jnp.float32) - p.astype(jnp.float32), \
                    (exact - new.astype(jnp.float32)).astype(buf.dtype)
            new_master = m + u
            if scheme == "float32":
                new = round_nearest_away(new_master) if p.dtype == jnp.bfloat16 else \
                    new_master.astype(p.dtype)
                buf = new_master
            elif scheme == "remainders":
                new, buf = split_remainders(new_master)
            elif scheme == "stochastic":
                new = stochastic_round(new_master, jax.random.fold_in(key, i))
            else:  # none: round to nearest, what optax.apply_updates does
                new = new_master.astype(p.dtype)
            return new.astype(jnp.float32) - p.astype(jnp.float32), buf

        bufs = (treedef.flatten_up_to(state.master)
                if scheme not in ("stochastic", "none") else [None] * len(leaves))
        results = [one(i, p, m, u, b) for i, (p, m, u, b) in enumerate(zip(
            leaves, treedef.flatten_up_to(master), treedef.flatten_up_to(steps), bufs,
            strict=True))]
        deltas = treedef.unflatten([r[0] for r in results])
        new_master = (state.master if scheme in ("stochastic", "none")
                      else treedef.unflatten([r[1] for r in results]))
        return deltas, Bf16MasterState(new_master, optax.safe_increment(state.count),
                                       inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def master_view(opt_state: Any, params: optax.Params) -> optax.Params:
    """The float32 master that ``params`` and the :func:`bf16_master` state in
    ``opt_state`` stand for (``params`` in float32 for the schemes without a buffer).

    Raises:
      ValueError: ``opt_state`` holds no (or more than one) :class:`Bf16MasterState`.

    Example: see the module docstring.
    """
    found = [s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, Bf16MasterState))
        if isinstance(s, Bf16MasterState)]
    if len(found) != 1:
        raise ValueError(f"Expected one jamp.optim_state.bf16_master state in opt_state, "
                         f"found {len(found)}.")
    state = found[0]

    def one(p, m):
        if not (_floating(p) and p.dtype in (jnp.bfloat16, jnp.float16)):
            return _f32(p)
        if m.dtype == jnp.float32:
            return m
        if m.dtype == jnp.uint16:
            return join_remainders(p, m)
        return p.astype(jnp.float32) + m.astype(jnp.float32)

    if isinstance(state.master, optax.EmptyState):
        return jax.tree_util.tree_map(_f32, params)
    return jax.tree_util.tree_map(one, params, state.master)
