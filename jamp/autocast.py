"""``jamp.autocast``: a precision policy for any JAX function, by op rules.

torch.amp reaches every op of a model through lists of ops: matmuls run in the
low-precision dtype, numerically sensitive ops in float32. :func:`autocast` does
the same in JAX's idiom: it traces the function *as written* to a jaxpr, then
evaluates that jaxpr again on inputs cast to the compute dtype, op by op,
recursing into ``jit``, ``scan``, ``while_loop``, ``cond`` and ``checkpoint``:

- ``dot_general`` and ``conv_general_dilated`` (matmul, einsum, convolutions)
  take and return the compute dtype, whatever their operands' dtype;
- in ``fp8_current`` (any recipe whose ``fp8.scaling`` is ``"current"``), every
  *projection*, a ``dot_general`` without batch dimensions (``nn.Dense``,
  ``x @ w``, ``einsum("bld,dh->blh", x, w)``), runs as
  :func:`jamp.fp8.current_scaling_dot_general` on compute-dtype operands (E4M3
  forward, E5M2 gradient backward, each tensor scaled by its own amax) and
  returns the compute dtype; ``dot_general`` with batch dimensions (attention's
  ``bhqd,bhkd->bhqk`` scores and value matmul, batched matmuls) and
  convolutions stay in the compute dtype, as in the linen/NNX fp8 modes.
  autocast sees ops, not layers, so the rule is structural and the classifier
  is fp8 too: the linen/NNX modes keep a layer named ``head`` in bf16
  (``Fp8Recipe.keep_bf16``), autocast has no names, so that default does not
  apply here and other names are refused. A 2-D attention written per example
  (``q @ k.T``) has no batch axes and counts as a projection; under an outer
  ``jax.vmap`` each mapped slice gets its own scales;
- delayed scaling (``fp8``, ``fp8_delayed``) is refused: its amax histories are
  state between steps and autocast, a function transform, has nowhere to keep
  them (use ``fp8_current``, or ``jamp.apply_policy`` on a linen/NNX model);
- in modes whose softmax runs in float32 (``fp16``, ``bf16``, ``fp16_naive``):
  softmax and log-softmax of half-precision logits run in float32 and save only
  half-precision residuals (:mod:`jamp.attention`); ``exp``, ``log``, powers
  (``square`` too), square roots (normalisation statistics) and sums (losses, means, large
  reductions) of half-precision values run in float32 and return the half
  dtype, rematerialised in the backward pass so only their half-precision
  inputs are saved;
- ops that work on any floating dtype (elementwise math, shapes, gathers,
  reductions, sorts, collectives) run on the values as they are; where
  floating operands differ they meet at the narrowest dtype, so a float32
  constant does not pull half-precision activations back to float32;
- every other op (and every ``custom_vjp`` function, and every ``custom_jvp``
  function that uses an op outside these lists) gets its operands cast back to
  the dtypes it was traced with, and runs exactly as written; a dtype-generic
  ``custom_jvp`` function (``jax.nn.relu``) runs on half values with its own jvp
  rule, so it saves half-precision residuals;
- the function's meaning is kept (:mod:`jamp.autocast_regions`): constants
  (``finfo.min``, ``-1e30`` fills) narrowed to a half dtype are clipped to its
  finite range; normalisations (mean, variance, ``rsqrt``, the affine) run in
  float32 and return their input's dtype; state (an output reached from a
  float32 input by elementwise ops meeting no matmul: running statistics, EMAs,
  counters) is computed in its own dtype and its input is not cast;
- loop carries keep the dtype they enter the loop with; ``cond`` branches meet
  at the narrowest dtype; outputs are cast to the policy's output dtype.

A function that runs in float32 therefore runs under autocast: no dtype
mismatch can appear that the float32 program did not have. The rewrite happens
at trace time: under ``jax.jit`` it costs nothing when the compiled function
runs. It composes with ``jit``, ``grad``, ``vmap``, ``scan``, ``checkpoint``,
``shard_map`` (whose body runs as written) and custom derivatives.

Example:
  >>> import jax, jax.numpy as jnp, jamp
  >>> def mlp(params, x):
  ...   return jax.nn.softmax(jnp.tanh(x @ params["w1"]) @ params["w2"])
  >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 3))}
  >>> fast = jamp.autocast(mlp, "bf16")
  >>> fast(params, jnp.ones((2, 4))).dtype
  dtype('float32')
  >>> jaxpr = jax.make_jaxpr(fast)(params, jnp.ones((2, 4)))
  >>> [str(e.invars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  ['bfloat16', 'bfloat16']
  >>> fp8 = jax.make_jaxpr(jamp.autocast(mlp, "fp8_current"))(params, jnp.ones((2, 4)))
  >>> calls = [e.params["call_jaxpr"] for e in fp8.eqns if e.primitive.name == "custom_vjp_call"]
  >>> [str(d.invars[0].aval.dtype) for c in calls for d in c.eqns
  ...  if d.primitive.name == "dot_general"]  # the softmax has none
  ['float8_e4m3fn', 'float8_e4m3fn']
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from jamp import accumulate, attention
from jamp import autocast_regions as regions
from jamp.policy import MixedPrecision, PolicyLike, to_mixed_precision

if TYPE_CHECKING:
    from jamp.fp8 import Fp8Recipe

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_DOTS = frozenset({"dot_general", "conv_general_dilated"})
_LINEAR_FLOAT32 = frozenset({"reduce_sum", "cumsum"})
_FLOAT32 = frozenset({"exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
                      "sqrt",
                      "rsqrt", "reduce_prod", "cumprod", "cumlogsumexp", "erf_inv", "lgamma",
                      "digamma"}) | _LINEAR_FLOAT32
_POLYMORPHIC = frozenset({
    # elementwise
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min",
    "floor", "ceil", "round", "nextafter", "atan2", "tanh", "logistic", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "cbrt",
    "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "stop_gradient",
    "copy", "copy_p", "reduce_precision",
    # structural
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "split",
    "sharding_constraint", "optimization_barrier",
    # reductions, sorting, collectives
    "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin", "sort",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "psum", "pmax", "pmin", "all_gather", "ppermute", "all_to_all",
})


def is_floating(x: Any) -> bool:
    """Whether ``x`` is a floating-point array (JAX, NumPy or a NumPy scalar).

    The one test of "floating value" that autocast and the policy adapters
    (:mod:`jamp.apply`) share.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.autocast import is_floating
      >>> is_floating(jnp.ones(2)), is_floating(jnp.arange(2)), is_floating(1.0)
      (True, False, False)
    """
    return isinstance(x, jax.Array | np.ndarray | np.generic) and jnp.issubdtype(
        x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any,
                  is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Casts the floating-point arrays of ``tree`` to ``dtype``; leaves the rest alone.

    ``is_leaf`` stops the walk at nodes to pass through untouched (the NNX
    adapter passes ``nnx.Rngs`` and other NNX objects this way).

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.autocast import cast_floating
      >>> out = cast_floating({"x": jnp.ones(2), "i": jnp.arange(2)}, jnp.bfloat16)
      >>> out["x"].dtype, out["i"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if is_floating(x) and x.dtype != dtype else x, tree,
        is_leaf=is_leaf)


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which op rules a rewrite applies.

    Attributes:
      compute_dtype: the dtype of matmul/conv operands.
      cast_dots: cast ``dot_general``/``conv_general_dilated`` operands to it.
      softmax: run softmax/log-softmax of half-precision logits in float32.
      float32_ops: run exp/log/pow/sqrt/sums of half-precision values in float32.
      cast_inputs: evaluate on floating inputs cast to the compute dtype.
      float32_sums: accumulate every sum of half-precision values in float32, forward
        and backward (:mod:`jamp.accumulate`: broadcasts, sums, gathers...).
      fp8: the recipe's :class:`jamp.fp8.Fp8Recipe` or ``None``; with ``cast_dots``,
        current scaling runs every ``dot_general`` without batch dimensions as
        :func:`jamp.fp8.current_scaling_dot_general`, and delayed scaling is refused
        by :func:`rewrite` (no state to keep); without ``cast_dots`` it is unused
        (``jamp.apply_policy`` installs fp8 in the layers).
    """

    compute_dtype: Any
    cast_dots: bool = True
    softmax: bool = True
    float32_ops: bool = True
    cast_inputs: bool = False
    fp8: Fp8Recipe | None = None
    float32_sums: bool = True

    @classmethod
    def for_recipe(cls, mp: MixedPrecision) -> Rules:
        """The rules of :func:`autocast` under a recipe: float32 lists where softmax is float32.

        Example:
          >>> import jamp
          >>> from jamp.autocast import Rules
          >>> Rules.for_recipe(jamp.mixed_precision("bf16_pure")).softmax
          False
          >>> Rules.for_recipe(jamp.mixed_precision("fp8_current")).fp8.scaling
          'current'
        """
        half = jnp.dtype(mp.policy.compute_dtype) in _HALF
        return cls(mp.policy.compute_dtype, softmax=mp.softmax_fp32 and half,
                   float32_ops=mp.softmax_fp32 and half, fp8=mp.fp8,
                   float32_sums=mp.softmax_fp32 and half)


def _check_fp8(recipe: Fp8Recipe | None) -> None:
    """Refuses what autocast cannot do with an fp8 recipe, naming the fix."""
    if recipe is None:
        return
    recipe.strategy.autocast_dot_general()  # delayed scaling: a ValueError naming the fix
    extra = [n for n in recipe.keep_bf16 if n != "head"]
    if extra:
        raise ValueError(
            f"jamp.autocast with Fp8Recipe(keep_bf16={recipe.keep_bf16!r}): autocast sees "
            "ops, not named layers, so it cannot keep the matmuls of "
            f"{tuple(extra)!r} in bf16 (every projection runs in fp8; the default ('head',) "
            "is accepted and does not apply). Use keep_bf16=() or ('head',), and compute the "
            "matmuls to keep outside the autocast function (or under jamp.autocast(f, "
            "'bf16')); or use jamp.apply_policy on a Flax model, which matches layer names.")


def _projection(eqn: jex.JaxprEqn) -> bool:
    """A ``dot_general`` without batch dimensions (a layer's ``x @ w``, not attention's)."""
    if eqn.primitive.name != "dot_general":
        return False
    _, (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    return not lhs_batch and not rhs_batch


_SOFTMAX = {"softmax": attention.softmax_fp32, "log_softmax": attention.log_softmax_fp32}


# ----------------------------------------------------------------------------- plan


@dataclasses.dataclass
class _Plan:
    """Softmax replacements in one jaxpr, the equations still needed after them, and the
    regions that keep the function's meaning (:mod:`jamp.autocast_regions`)."""

    replace: dict[int, tuple[str, Any, tuple]]
    live: list[bool]
    constants: set = dataclasses.field(default_factory=set)
    norms: dict[int, regions.NormRegion] = dataclasses.field(default_factory=dict)
    state: set = dataclasses.field(default_factory=set)


def _plan(jaxpr: jex.Jaxpr, rules: Rules, top: bool = False) -> _Plan:
    replace = {}
    if rules.softmax:
        producers = regions.producers(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            found = regions.softmax_at(eqn, producers)
            if found is not None:  # whatever it traced as: its values may be half precision
                replace[i] = found
    needed = {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    live = [False] * len(jaxpr.eqns)
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live[i] = True
            inputs = [replace[i][1]] if i in replace else eqn.invars
            needed.update(v for v in inputs if not isinstance(v, jex.Literal))
    norms = {i: r for r in regions.norm_regions(jaxpr) for i in r.eqns} if \
        rules.float32_ops else {}
    state = regions.state_equations(jaxpr) if top and rules.cast_inputs else set()
    return _Plan(replace, live, regions.constants(jaxpr), norms, state)


# ----------------------------------------------------------------------------- evaluation
#
# Values may have other dtypes than the jaxpr traced (inputs cast to the compute dtype, dots
# returning it). Ops known to work on any floating dtype run on the values as they are (mixed
# floating operands meet at the narrowest dtype, as Python scalars would); every other op gets
# its operands cast back to the traced dtypes, so it runs exactly as written.


def _bind(eqn: jex.JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list:
    """Binds ``eqn``'s primitive on ``invals`` as ``jax.core.eval_jaxpr`` does."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
        invals = [*subfuns, *invals]
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None:
        with ctx.manager:
            out = eqn.primitive.bind(*invals, **bind_params)
    else:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


_CASTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jamp_autocast_casts",
                                                                   default=None)
"""The casts made so far by the jaxpr evaluation under way (each :func:`_eval` its own)."""


def _cast(x: Any, dtype: Any) -> Any:
    """``x.astype(dtype)``, once per value and dtype within one jaxpr's evaluation.

    A value read by several equations that each want it in another dtype (a norm's input,
    read by its mean, its variance and its centring, all in float32) gets one convert and
    its uses share it, as in a hand-written model. Separate converts of one value would
    each get their own cotangent, summed in the narrow dtype in the backward pass: a wide
    fan-in of converts per norm that XLA:CPU re-fuses into every later block's fusions
    (issue 31: backward time quadratic in depth).
    """
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    cache = _CASTS.get()
    if cache is None:
        return x.astype(dtype)
    hit = cache.get((id(x), dtype))
    if hit is not None and hit[0] is x:
        return hit[1]
    y = x.astype(dtype)
    cache[(id(x), dtype)] = (x, y)  # keeps x alive: its id is not reused while cached
    return y


def _as_traced(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list:
    """``eqn`` run on its operands cast back to the dtypes it was traced with."""
    return _bind(eqn, [_cast(x, v.aval.dtype) if is_floating(x) else x
                       for x, v in zip(invals, eqn.invars, strict=True)])


def _narrowest_dtype(dtypes: Sequence[Any]) -> Any:
    return min(dtypes, key=lambda d: (jnp.dtype(d).itemsize, jnp.dtype(d) not in _HALF))


def _narrowest(invals: Sequence[Any]) -> list:
    """Floating operands cast to the narrowest floating dtype among them."""
    dtypes = {x.dtype for x in invals if is_floating(x)}
    if len(dtypes) < 2:
        return list(invals)
    target = _narrowest_dtype(dtypes)
    return [_cast(x, target) if is_floating(x) else x for x in invals]


def _polymorphic(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list:
    return _bind(eqn, _narrowest(invals))


def _dot(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    """A matmul/conv on compute-dtype operands, returning the compute dtype; projections
    as current-scaling fp8 matmuls where the recipe says so."""
    if not all(is_floating(x) for x in invals):
        return _as_traced(eqn, invals)
    compute = jnp.dtype(rules.compute_dtype)
    operands = [_cast(x, compute) for x in invals]
    if rules.fp8 is not None and _projection(eqn):  # delayed scaling was refused earlier
        dims = tuple(tuple(tuple(int(d) for d in axes) for axes in pair)
                     for pair in eqn.params["dimension_numbers"])  # hashable: a static arg
        fp8_dot = rules.fp8.strategy.autocast_dot_general()
        return [fp8_dot(*operands, dims, preferred_element_type=compute)]
    params = dict(eqn.params, preferred_element_type=compute)
    return _bind(eqn, operands, params)


def _float32(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list:
    """``eqn`` computed in float32, returned in its operands' dtype; remat keeps the half
    precision inputs only (not float32 intermediates) for the backward pass."""
    invals = _narrowest(invals)
    half = {x.dtype for x in invals if is_floating(x)} & set(_HALF)
    if not half:
        return _bind(eqn, invals)
    (dtype,) = half

    def in_float32(*xs):
        out = _bind(eqn, [x.astype(jnp.float32) if is_floating(x) else x for x in xs])
        return [y.astype(dtype) if is_floating(y) else y for y in out]

    if eqn.primitive.name in _LINEAR_FLOAT32:
        return in_float32(*invals)
    return jax.checkpoint(in_float32, prevent_cse=False)(*invals)


def _convert(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list:
    """Casts as written: to ``new_dtype``, whatever the operand's dtype now is."""
    return [invals[0].astype(eqn.params["new_dtype"])]


def _whole_softmax(closed: Any, rules: Rules) -> tuple[str, tuple] | None:
    """A custom-derivative function that is exactly a softmax of its one input."""
    jaxpr, _ = regions.open_jaxpr(closed)
    if len(jaxpr.invars) != 1 or len(jaxpr.outvars) != 1:
        return None
    plan = _plan(jaxpr, dataclasses.replace(rules, softmax=True))
    for i, (kind, a, axes) in plan.replace.items():
        if jaxpr.eqns[i].outvars[0] is jaxpr.outvars[0] and a is jaxpr.invars[0]:
            return kind, axes
    return None


def _generic(closed: Any) -> bool:
    """Whether a function runs on any floating dtype: only dtype-generic and float32-list ops."""
    jaxpr, _ = regions.inline(*regions.open_jaxpr(closed))
    return all(e.primitive.name in _POLYMORPHIC | _FLOAT32 | {"custom_jvp_call"}
               for e in jaxpr.eqns)


def _custom_jvp(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    """A dtype-generic ``custom_jvp`` function (``jax.nn.relu``) on the values' own dtypes:
    its function and its jvp rule's jaxpr, evaluated by autocast, keep the rule."""
    p = eqn.params

    def primal(*xs):
        return _eval_closed(p["call_jaxpr"], xs, rules)

    f = jax.custom_jvp(primal)

    def jvp(primals, tangents):
        jaxpr, consts, out_zeros = p["jvp_jaxpr_fun"].call_wrapped(*[False] * len(primals))
        out = _eval(jaxpr, consts, [*primals, *tangents], rules)
        like = jax.eval_shape(primal, *primals)
        ys, dys = out[:len(out_zeros)], iter(out[len(out_zeros):])
        dys = [jnp.zeros(y.shape, y.dtype) if zero else next(dys)
               for y, zero in zip(like, out_zeros, strict=True)]
        return _cast_like(ys, like), _cast_like(dys, like)

    f.defjvp(jvp)
    return list(f(*invals))


def _custom(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    """custom_jvp/custom_vjp functions run as written, except a whole softmax on half logits
    and dtype-generic custom_jvp functions (relu) on half values."""
    found = None
    if rules.softmax and len(invals) == 1 and is_floating(invals[0]) and invals[0].dtype in _HALF:
        found = _whole_softmax(eqn.params["call_jaxpr"], rules)
    if found is None:
        if (rules.cast_dots and eqn.primitive.name == "custom_jvp_call"
                and not eqn.params.get("num_consts", 0)
                and "jvp_jaxpr_fun" in eqn.params  # else (another JAX) run as written
                and any(is_floating(x) and x.dtype in _HALF for x in invals)
                and _generic(eqn.params["call_jaxpr"])):
            return _custom_jvp(eqn, invals, rules)
        return _as_traced(eqn, invals)
    kind, axes = found
    return [_SOFTMAX[kind](invals[0], axes)]


def _cast_like(values: Sequence[Any], like: Sequence[Any]) -> list:
    return [x.astype(y.dtype) if is_floating(x) and x.dtype != y.dtype else x
            for x, y in zip(values, like, strict=True)]


def _scan(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    """``lax.scan`` again; the carry keeps the dtype it enters with."""
    p = eqn.params
    n_consts, n_carry = regions.scan_counts(eqn)
    consts, carry, xs = (invals[:n_consts], list(invals[n_consts:n_consts + n_carry]),
                         list(invals[n_consts + n_carry:]))

    def body(c, x):
        out = _eval_closed(p["jaxpr"], [*consts, *c, *x], rules)
        return _cast_like(out[:n_carry], c), out[n_carry:]

    carry, ys = jax.lax.scan(body, carry, xs, length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
    return [*carry, *ys]


def _while(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    """``lax.while_loop`` again; the carry keeps the dtype it enters with."""
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond:n_cond + n_body]
    init = list(invals[n_cond + n_body:])
    cond = lambda c: _eval_closed(p["cond_jaxpr"], [*cond_consts, *c], rules)[0]
    body = lambda c: _cast_like(_eval_closed(p["body_jaxpr"], [*body_consts, *c], rules), c)
    return jax.lax.while_loop(cond, body, init)


def _cond(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    """``lax.switch`` again; each output in the narrowest dtype any branch gives it."""
    branches = eqn.params["branches"]
    run = lambda b, *ops: _eval_closed(b, ops, rules)
    shapes = [jax.eval_shape(functools.partial(run, b), *invals[1:]) for b in branches]
    like = [jax.ShapeDtypeStruct(s[0].shape, _narrowest_dtype([x.dtype for x in s]))
            for s in zip(*shapes, strict=True)]
    fns = [lambda *ops, b=b: _cast_like(run(b, *ops), like) for b in branches]
    return jax.lax.switch(invals[0], fns, *invals[1:])


def _checkpoint(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    p = eqn.params
    body = lambda *args: _eval(p["jaxpr"], [], args, rules)
    return jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals)


def _inline(param: str):
    def run(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
        return _eval_closed(eqn.params[param], invals, rules)

    return run


_HIGHER_ORDER: dict[str, Callable[[jex.JaxprEqn, Sequence[Any], Rules], list]] = {
    "jit": _inline("jaxpr"), "pjit": _inline("jaxpr"), "closed_call": _inline("call_jaxpr"),
    "scan": _scan, "while": _while, "cond": _cond,
    "remat2": _checkpoint, "checkpoint": _checkpoint,
    "custom_jvp_call": _custom, "custom_vjp_call": _custom, "custom_vjp_call_jaxpr": _custom,
}


def _apply(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    name = eqn.primitive.name
    if name in _HIGHER_ORDER:
        return _HIGHER_ORDER[name](eqn, invals, rules)
    if name == "convert_element_type":
        return _convert(eqn, invals)
    if rules.cast_dots and name in _DOTS:
        return _dot(eqn, invals, rules)
    if rules.float32_sums:  # before differentiation: the sums autodiff writes too
        invals = accumulate.broadcast_operands(eqn, invals)
        out = accumulate.in_float32(eqn, _narrowest(invals), _bind) if (
            name in accumulate.LINEAR) else None
        if out is not None:
            return out
    if rules.float32_ops and name in _FLOAT32:
        return _float32(eqn, invals)
    if name in _POLYMORPHIC or name in _FLOAT32:
        return _polymorphic(eqn, invals)
    return _as_traced(eqn, invals)


def _literal(v: jex.Literal) -> Any:
    """A literal as a NumPy scalar of its traced dtype (so it can be cast like any value)."""
    dtype = getattr(v.aval, "dtype", None)
    return np.asarray(v.val, dtype) if dtype is not None and jnp.issubdtype(
        dtype, jnp.number) else v.val


def _eval_closed(closed: Any, args: Sequence[Any], rules: Rules) -> list:
    """Evaluates a nested jaxpr parameter (closed, or open as in JAX 0.11) on ``args``."""
    return _eval(*regions.open_jaxpr(closed), args, rules)


def _narrow_constants(invals: Sequence[Any], eqn: jex.JaxprEqn, plan: _Plan) -> list:
    """Constant operands (fills, masks) narrowed with their finite values kept finite."""
    dtypes = {x.dtype for x in invals if is_floating(x)}
    if len(dtypes) < 2 or eqn.primitive.name not in _POLYMORPHIC | _FLOAT32:
        return list(invals)
    target = _narrowest_dtype(dtypes)
    return [regions.narrow_finite(x, target) if is_floating(x) and x.dtype != target and (
        isinstance(v, jex.Literal) or v in plan.constants) else x
        for x, v in zip(invals, eqn.invars, strict=True)]


def _in_float32(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list:
    """A normalisation's equation: floating operands in float32, bound as written."""
    return _bind(eqn, [_cast(x, jnp.float32) if is_floating(x) else x for x in invals])


def _eval(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: Rules,
          top: bool = False) -> list:
    """Evaluates ``jaxpr`` on ``args`` (of any floating dtypes) applying ``rules``; at the
    ``top`` of :func:`rewrite`, casts the inputs (``rules.cast_inputs``) and keeps state."""
    token = _CASTS.set({})
    try:
        return _eval_casting(jaxpr, consts, args, rules, top)
    finally:
        _CASTS.reset(token)


def _eval_casting(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: Rules,
                  top: bool) -> list:
    jaxpr, consts = regions.inline(jaxpr, consts)
    plan = _plan(jaxpr, rules, top)
    if top and rules.cast_inputs:  # state inputs keep their dtype
        keep = set(regions.state_inputs(jaxpr)) if plan.state else set()
        args = [x if i in keep else cast_floating(x, rules.compute_dtype)
                for i, x in enumerate(args)]
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    wide: dict = {}  # float32 values of the normalisations, read inside them
    read = lambda v: _literal(v) if isinstance(v, jex.Literal) else env[v]
    for i, eqn in enumerate(jaxpr.eqns):
        if not plan.live[i]:
            continue
        with regions.source_of(eqn):  # the user's names and lines, as jax.core.eval_jaxpr
            if i in plan.replace:
                kind, a, axes = plan.replace[i]
                env[eqn.outvars[0]] = _SOFTMAX[kind](env[a], axes)
                continue
            invals = _narrow_constants([read(v) for v in eqn.invars], eqn, plan)
            if i in plan.state:
                outs = _as_traced(eqn, invals)
            elif i in plan.norms:
                norm = plan.norms[i]
                outs = _in_float32(eqn, [x if isinstance(v, jex.Literal) else wide.get(v, x)
                                         for v, x in zip(eqn.invars, invals, strict=True)])
                back = _narrowest_dtype([env[v].dtype for v in norm.inputs
                                         if v in env and is_floating(env[v])] or [jnp.float32])
                wide.update((v, y) for v, y in zip(eqn.outvars, outs, strict=True)
                            if v in norm.exits)
                outs = [y.astype(back) if v in norm.exits and is_floating(y) else y
                        for v, y in zip(eqn.outvars, outs, strict=True)]
            else:
                outs = _apply(eqn, invals, rules)
            env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def rewrite(fn: Callable[..., Any], rules: Rules) -> Callable[..., Any]:
    """``fn`` traced as written, then evaluated again under ``rules``.

    Array leaves of the arguments are traced; every other leaf (Python numbers,
    strings, callables) is passed to ``fn`` as is. Outputs may come back in
    other floating dtypes than ``fn`` gives (the compute dtype, for instance).

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.autocast import Rules, rewrite
      >>> f = rewrite(lambda x: x @ x, Rules(jnp.bfloat16))
      >>> f(jnp.ones((2, 2))).dtype
      dtype(bfloat16)

    Raises:
      ValueError: for ``rules.fp8`` that dots cannot honour (delayed scaling, layer
        names in ``keep_bf16``) when ``rules.cast_dots`` is set.
    """
    if rules.cast_dots:
        _check_fp8(rules.fp8)

    @functools.wraps(fn)
    def rewritten(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

        def traced(*arrays):
            full = list(leaves)
            for i, x in zip(dynamic, arrays, strict=True):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*a, **k)

        arrays = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*arrays)
        outs = _eval(closed.jaxpr, closed.consts, arrays, rules, top=True)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return rewritten


def autocast(fn: Callable[..., Any], policy_or_mode: PolicyLike) -> Callable[..., Any]:
    """Returns ``fn`` run under a precision policy, with torch.amp-style op rules.

    ``fn`` is traced as written; its floating inputs are cast to the compute
    dtype; matmul/conv/einsum operands are in the compute dtype; in modes whose
    softmax runs in float32 (``fp16``, ``bf16``, ``fp16_naive``) softmax,
    log-softmax, exp/log, powers, square roots and sums of half-precision values
    run in float32 keeping half-precision residuals; loop carries keep the
    dtype they enter with; ops autocast does not know run on the dtypes they
    were traced with; outputs are cast to the output dtype. A bare policy
    (``"p=f32,c=bf16,o=f32"`` or a ``jamp.Policy``) casts without the float32
    rules, as ``jamp.apply_policy`` does. Parameters stay in the dtype you
    store them in (``mp.policy.cast_to_param(params)`` gives the param dtype).

    fp8: under ``"fp8_current"`` (a recipe whose ``fp8.strategy`` is current scaling)
    every projection, i.e. every ``dot_general`` without batch dimensions
    (``x @ w``, ``nn.Dense``, ``einsum`` with a kernel), runs as
    :func:`jamp.fp8.current_scaling_dot_general` (E4M3 operands, E5M2 gradient,
    compute-dtype result); ``dot_general`` with batch dimensions (attention's
    score and value matmuls, batched matmuls) and convolutions stay in the
    compute dtype. There are no layer names here: the classifier is fp8 too
    (``Fp8Recipe.keep_bf16``'s default ``("head",)`` does not apply, other names
    are refused); compute a matmul to keep in bf16 outside ``fn``. Delayed
    scaling (``"fp8"``, ``"fp8_delayed"``) needs amax state between steps that
    a function transform cannot keep, and is refused.

    Args:
      fn: any function of arrays (and of other Python values, passed as is).
      policy_or_mode: a mode name, a policy string, a ``jamp.Policy`` or a
        ``jamp.MixedPrecision``.

    Returns:
      A function with ``fn``'s signature.

    Raises:
      ValueError: at call time, for delayed-scaling fp8 (``"fp8"``): use
        ``"fp8_current"``, or ``jamp.apply_policy`` on a linen/NNX model (state in
        ``jamp.fp8.COLLECTION`` / ``jamp.fp8.Fp8Meta``); for ``Fp8Recipe.keep_bf16``
        naming layers other than ``"head"``.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> loss = lambda w, x: jnp.mean(jax.nn.log_softmax(x @ w))
      >>> jax.grad(jamp.autocast(loss, "fp16"))(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
      dtype('float32')
      >>> jax.grad(jamp.autocast(loss, "fp8_current"))(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
      dtype('float32')
    """
    mp = to_mixed_precision(policy_or_mode)
    rewritten = rewrite(fn, dataclasses.replace(Rules.for_recipe(mp), cast_inputs=True))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return cast_floating(rewritten(*args, **kwargs), mp.policy.output_dtype)

    return run
