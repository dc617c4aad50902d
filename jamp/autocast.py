"""``jamp.autocast``: a precision policy for any JAX function, by op rules.

torch.amp reaches every op of a model through lists of ops: matmuls run in the
low-precision dtype, numerically sensitive ops in float32. :func:`autocast` does
the same in JAX's idiom: it traces the function to a jaxpr and evaluates it
again with these rules, recursing into ``jit``, ``scan``, ``while_loop``,
``cond`` and ``checkpoint`` bodies:

- floating inputs are cast to the policy's compute dtype (as jmp/Haiku do), so a
  function written for float32 computes in the compute dtype;
- ``dot_general`` and ``conv_general_dilated`` (matmul, einsum, convolutions)
  take compute-dtype operands, whatever dtype their operands had, and return the
  dtype they returned before (accumulating in it);
- in modes whose softmax runs in float32 (``fp16``, ``bf16``, ``fp16_naive``):
  softmax and log-softmax of half-precision logits run in float32 and save only
  half-precision residuals (:mod:`jamp.attention`); ``exp``, ``log``, powers,
  square roots (normalisation statistics) and sums (losses, means, large
  reductions) of half-precision values run in float32, rematerialised in the
  backward pass so that only half-precision inputs are saved;
- every other op runs as traced, so every value keeps the type it was traced
  with: loop carries, branch outputs and custom derivative rules see exactly
  the types they were written for;
- outputs are cast to the policy's output dtype.

The rewrite happens at trace time: under ``jax.jit`` it costs nothing when the
compiled function runs. It composes with ``jit``, ``grad``, ``vmap``, ``scan``,
``checkpoint``, ``shard_map`` and custom derivatives (their bodies are left as
written: autocast cannot change a derivative rule someone wrote).

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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from jamp import attention
from jamp.policy import MixedPrecision, PolicyLike, to_mixed_precision

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_DOTS = frozenset({"dot_general", "conv_general_dilated"})
_LINEAR_FLOAT32 = frozenset({"reduce_sum", "cumsum"})
_FLOAT32 = frozenset({"exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "sqrt",
                      "rsqrt", "reduce_prod", "cumprod", "cumlogsumexp", "erf_inv", "lgamma",
                      "digamma"}) | _LINEAR_FLOAT32
_TRANSPARENT = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "squeeze",
                          "expand_dims", "stop_gradient", "max"})


def _floating(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point arrays of ``tree`` to ``dtype``; leaves the rest alone.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.autocast import cast_floating
      >>> out = cast_floating({"x": jnp.ones(2), "i": jnp.arange(2)}, jnp.bfloat16)
      >>> out["x"].dtype, out["i"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if _floating(x) and x.dtype != dtype else x, tree)


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which op rules a rewrite applies.

    Attributes:
      compute_dtype: the dtype of matmul/conv operands.
      cast_dots: cast ``dot_general``/``conv_general_dilated`` operands to it.
      softmax: run softmax/log-softmax of half-precision logits in float32.
      float32_ops: run exp/log/pow/sqrt/sums of half-precision values in float32.
    """

    compute_dtype: Any
    cast_dots: bool = True
    softmax: bool = True
    float32_ops: bool = True

    @classmethod
    def for_recipe(cls, mp: MixedPrecision) -> Rules:
        """The rules of :func:`autocast` under a recipe: float32 lists where softmax is float32.

        Example:
          >>> import jamp
          >>> from jamp.autocast import Rules
          >>> Rules.for_recipe(jamp.mixed_precision("bf16_pure")).softmax
          False
        """
        half = jnp.dtype(mp.policy.compute_dtype) in _HALF
        return cls(mp.policy.compute_dtype, softmax=mp.softmax_fp32 and half,
                   float32_ops=mp.softmax_fp32 and half)


# ----------------------------------------------------------------------------- patterns


def _producers(jaxpr: jex.Jaxpr) -> dict[Any, jex.JaxprEqn]:
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def _chase(var: Any, producers: dict, through: frozenset) -> tuple[Any, Any]:
    """Follows ``var`` up through shape/dtype-only ops; returns it and its producer."""
    eqn = producers.get(var)
    while eqn is not None and eqn.primitive.name in through:
        operands = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
        if len(operands) != 1:
            break
        var = operands[0]
        eqn = producers.get(var)
    return var, eqn


def _max_shifted(f: Any, producers: dict) -> tuple[Any, tuple] | None:
    """``f = a - stop_gradient(max(a, axes))``: returns ``(a, axes)``."""
    sub = producers.get(f)
    if sub is None or sub.primitive.name != "sub":
        return None
    a, shift = sub.invars
    _, reduce = _chase(shift, producers, _TRANSPARENT)
    if reduce is None or reduce.primitive.name != "reduce_max" or reduce.invars[0] is not a:
        return None
    return a, tuple(reduce.params["axes"])


def _sum_of_exp(k: Any, producers: dict, axes: tuple) -> Any:
    """``k = sum(exp(f), axes)`` (through casts/broadcasts): returns ``f``."""
    _, total = _chase(k, producers, _TRANSPARENT - {"max", "stop_gradient"})
    if total is None or total.primitive.name != "reduce_sum" or tuple(
            total.params["axes"]) != axes:
        return None
    _, exp = _chase(total.invars[0], producers, frozenset({"convert_element_type"}))
    if exp is None or exp.primitive.name != "exp":
        return None
    return exp.invars[0]


def _softmax_at(eqn: jex.JaxprEqn, producers: dict) -> tuple[str, Any, tuple] | None:
    """Recognises ``eqn`` as the last op of a softmax or log-softmax of one array.

    softmax: ``exp(f) / sum(exp(f))``; log-softmax: ``f - log(sum(exp(f)))``, with
    ``f = a - stop_gradient(max(a))`` (what ``jax.nn`` and ``flax.linen`` trace to).
    """
    name = eqn.primitive.name
    if name not in ("div", "sub") or any(isinstance(v, jex.Literal) for v in eqn.invars):
        return None
    num, den = eqn.invars
    if name == "div":
        exp = producers.get(num)
        if exp is None or exp.primitive.name != "exp":
            return None
        f = exp.invars[0]
        total = den
    else:
        log = producers.get(den)
        if log is None or log.primitive.name != "log":
            return None
        f, total = num, log.invars[0]
    found = _max_shifted(f, producers)
    if found is None or _sum_of_exp(total, producers, found[1]) is not f:
        return None
    return ("softmax" if name == "div" else "log_softmax", *found)


_SOFTMAX = {"softmax": attention.softmax_fp32, "log_softmax": attention.log_softmax_fp32}


# ----------------------------------------------------------------------------- plan


@dataclasses.dataclass
class _Plan:
    """Softmax replacements in one jaxpr and the equations still needed after them."""

    replace: dict[int, tuple[str, Any, tuple]]
    live: list[bool]


def _plan(jaxpr: jex.Jaxpr, rules: Rules) -> _Plan:
    replace = {}
    if rules.softmax:
        producers = _producers(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            found = _softmax_at(eqn, producers)
            if found is not None and jnp.dtype(found[1].aval.dtype) in _HALF:
                replace[i] = found
    needed = {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    live = [False] * len(jaxpr.eqns)
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live[i] = True
            inputs = [replace[i][1]] if i in replace else eqn.invars
            needed.update(v for v in inputs if not isinstance(v, jex.Literal))
    return _Plan(replace, live)


# ----------------------------------------------------------------------------- evaluation


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


def _out_dtypes(eqn: jex.JaxprEqn) -> list:
    return [v.aval.dtype for v in eqn.outvars]


def _dot(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    """A matmul/conv on compute-dtype operands, returning (and accumulating in) its dtype."""
    compute = jnp.dtype(rules.compute_dtype)
    if not all(_floating(x) for x in invals) or all(x.dtype == compute for x in invals):
        return _bind(eqn, invals)
    params = dict(eqn.params, preferred_element_type=eqn.outvars[0].aval.dtype)
    return _bind(eqn, [x.astype(compute) for x in invals], params)


def _float32(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list:
    """``eqn`` computed in float32, cast back; remat keeps only the half-precision inputs."""
    if not any(_floating(x) and x.dtype in _HALF for x in invals):
        return _bind(eqn, invals)
    dtypes = _out_dtypes(eqn)

    def in_float32(*xs):
        out = _bind(eqn, [x.astype(jnp.float32) if _floating(x) else x for x in xs])
        return [y.astype(d) for y, d in zip(out, dtypes, strict=True)]

    if eqn.primitive.name in _LINEAR_FLOAT32:
        return in_float32(*invals)
    return jax.checkpoint(in_float32, prevent_cse=False)(*invals)


def _whole_softmax(closed: jex.ClosedJaxpr, rules: Rules) -> tuple[str, tuple] | None:
    """A ``custom_jvp`` function that is exactly a softmax of its one input."""
    jaxpr = closed.jaxpr
    if len(jaxpr.invars) != 1 or len(jaxpr.outvars) != 1:
        return None
    plan = _plan(jaxpr, rules)
    for i, (kind, a, axes) in plan.replace.items():
        if jaxpr.eqns[i].outvars[0] is jaxpr.outvars[0] and a is jaxpr.invars[0]:
            return kind, axes
    return None


def _custom_jvp(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    found = _whole_softmax(eqn.params["call_jaxpr"], rules) if rules.softmax else None
    if found is None or len(invals) != 1 or invals[0].dtype not in _HALF:
        return _bind(eqn, invals)
    kind, axes = found
    return [_SOFTMAX[kind](invals[0], axes)]


def _scan(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, carry, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                         invals[n_consts + n_carry:])

    def body(carry, x):
        out = _eval_closed(p["jaxpr"], [*consts, *carry, *x], rules)
        return out[:n_carry], out[n_carry:]

    carry, ys = jax.lax.scan(body, list(carry), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _while(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond:n_cond + n_body]
    init = list(invals[n_cond + n_body:])
    cond = lambda c: _eval_closed(p["cond_jaxpr"], [*cond_consts, *c], rules)[0]
    body = lambda c: _eval_closed(p["body_jaxpr"], [*body_consts, *c], rules)
    return jax.lax.while_loop(cond, body, init)


def _cond(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    branches = [functools.partial(lambda b, *ops: _eval_closed(b, ops, rules), b)
                for b in eqn.params["branches"]]
    return jax.lax.switch(invals[0], branches, *invals[1:])


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
    "custom_jvp_call": _custom_jvp,
}


def _apply(eqn: jex.JaxprEqn, invals: Sequence[Any], rules: Rules) -> list:
    name = eqn.primitive.name
    if name in _HIGHER_ORDER:
        return _HIGHER_ORDER[name](eqn, invals, rules)
    if rules.cast_dots and name in _DOTS:
        return _dot(eqn, invals, rules)
    if rules.float32_ops and name in _FLOAT32:
        return _float32(eqn, invals)
    return _bind(eqn, invals)


def _eval_closed(closed: jex.ClosedJaxpr, args: Sequence[Any], rules: Rules) -> list:
    return _eval(closed.jaxpr, closed.consts, args, rules)


def _eval(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: Rules) -> list:
    """Evaluates ``jaxpr`` applying ``rules``; every output keeps its traced type."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
    plan = _plan(jaxpr, rules)
    for i, eqn in enumerate(jaxpr.eqns):
        if not plan.live[i]:
            continue
        if i in plan.replace:
            kind, a, axes = plan.replace[i]
            outs = [_SOFTMAX[kind](env[a], axes).astype(eqn.outvars[0].aval.dtype)]
        else:
            outs = _apply(eqn, [read(v) for v in eqn.invars], rules)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def rewrite(fn: Callable[..., Any], rules: Rules) -> Callable[..., Any]:
    """``fn`` traced and evaluated again under ``rules``; same inputs, outputs and types.

    Array leaves of the arguments are traced; every other leaf (Python numbers,
    strings, callables) is passed to ``fn`` as is.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.autocast import Rules, rewrite
      >>> f = rewrite(lambda x: x @ x, Rules(jnp.bfloat16))
      >>> f(jnp.ones((2, 2))).dtype
      dtype('float32')
    """

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
        outs = _eval_closed(closed, arrays, rules)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return rewritten


def autocast(fn: Callable[..., Any], policy_or_mode: PolicyLike) -> Callable[..., Any]:
    """Returns ``fn`` run under a precision policy, with torch.amp-style op rules.

    Floating inputs are cast to the compute dtype; matmul/conv/einsum operands
    are in the compute dtype; in modes whose softmax runs in float32 (``fp16``,
    ``bf16``, ``fp16_naive``) softmax, log-softmax, exp/log, powers, square roots
    and sums of half-precision values run in float32 keeping half-precision
    residuals; loop carries and all other values keep the type ``fn`` traced
    them with; outputs are cast to the output dtype. A bare policy
    (``"p=f32,c=bf16,o=f32"`` or a ``jamp.Policy``) casts without the float32
    rules, as ``jamp.apply_policy`` does.

    Args:
      fn: any function of arrays (and of other Python values, passed as is).
      policy_or_mode: a mode name, a policy string, a ``jamp.Policy`` or a
        ``jamp.MixedPrecision``.

    Returns:
      A function with ``fn``'s signature.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> loss = lambda w, x: jnp.mean(jax.nn.log_softmax(x @ w))
      >>> jax.grad(jamp.autocast(loss, "fp16"))(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
      dtype('float32')
    """
    mp = to_mixed_precision(policy_or_mode)
    rewritten = rewrite(fn, Rules.for_recipe(mp))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        args, kwargs = cast_floating((args, kwargs), mp.policy.compute_dtype)
        return cast_floating(rewritten(*args, **kwargs), mp.policy.output_dtype)

    return run
