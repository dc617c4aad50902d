"""Where :func:`jamp.autocast` keeps a function's meaning over its op rules.

autocast's op rules (compute-dtype dots, float32 lists, the narrowest dtype
where floating operands meet) are local: each looks at one equation. Some
meanings are not local, and this module finds them in a jaxpr before it is
evaluated:

- :func:`inline`: nested ``jit`` calls (``jnp.var``, ``jnp.where`` are jitted
  helpers) flattened into one list of equations, so the patterns below are seen
  whole;
- :func:`softmax_at`: the last op of a softmax or log-softmax (``exp(x - max(x)) / sum``),
  which autocast replaces by a float32 softmax with half-precision residuals;
- :func:`constants`: values computed from literals and closed-over constants
  only (a ``jnp.finfo(x.dtype).min`` or ``-1e30`` fill). Narrowed to a half
  dtype they are clipped to its finite range (:func:`narrow_finite`), so a
  masked logit stays finite and a fully masked softmax row stays as finite as in
  float32;
- :func:`norm_regions`: normalisation, ``rsqrt(var + eps)`` (or ``x / sqrt``)
  of statistics reduced from an input (layer, group, batch and RMS norm: mean,
  variance, the centred input, the scaling and the affine), runs in float32 and
  returns its input's dtype, as ``torch.amp`` runs ``layer_norm``; statistics
  used elsewhere (a BatchNorm's batch mean) leave in float32;
- :func:`state_equations`: state. An output with the shape of a floating input
  that it reaches through elementwise ops only (``m * r + (1 - m) * mean``,
  ``count + 1``, ``w - lr * g``) is computed in the input's own dtype, and that
  input is not cast on entry; a path that meets a matmul or convolution output
  (a bias added to logits) is not state, so model outputs keep the compute dtype.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp import autocast_regions as regions
  >>> ema = lambda r, x: 0.99 * r + 0.01 * x.mean(0)
  >>> closed = jax.make_jaxpr(ema)(jnp.ones(3), jnp.ones((2, 3)))
  >>> jaxpr, _ = regions.inline(closed.jaxpr, closed.consts)
  >>> len(regions.state_equations(jaxpr)), regions.state_inputs(jaxpr)
  (2, [0])
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

try:  # public since JAX 0.4.14; absent: equations rebound without their source info
    from jax.extend import source_info_util as _source_info
except ImportError:  # pragma: no cover
    _source_info = None

__all__ = ["NormRegion", "constants", "inline", "narrow_finite", "norm_regions", "open_jaxpr",
           "producers", "scan_counts", "softmax_at", "source_of", "state_equations",
           "state_inputs"]

_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr"}
_SHAPE = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                    "convert_element_type", "copy", "copy_p"})
_ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul", "div", "neg", "max", "min",
                          "select_n", "clamp", "stop_gradient"}) | _SHAPE
_STATISTICS = frozenset({"reduce_sum", "square", "integer_pow"}) | _ELEMENTWISE
_BELOW = frozenset({"sub", "mul", "div", "square", "integer_pow"})  # x - mean, its square
_DOTS = frozenset({"dot_general", "conv_general_dilated"})


# ----------------------------------------------------------------------------- inline


def open_jaxpr(jaxpr: Any) -> tuple[jex.Jaxpr, list]:
    """A nested jaxpr parameter and its consts, whether JAX gives it closed (a
    ``ClosedJaxpr``, JAX <= 0.10) or open (a ``Jaxpr``, JAX 0.11).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda x: x + 1)(1.0)
      >>> [len(open_jaxpr(j)[0].eqns) for j in (closed, closed.jaxpr)]
      [1, 1]
    """
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def scan_counts(eqn: jex.JaxprEqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation: its parameters where JAX names
    them (<= 0.10); else from the shapes, since only the scanned inputs and outputs carry
    the leading ``length`` axis beside the body's (JAX 0.11 names neither).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda k, xs: jax.lax.scan(lambda c, x: (c * x + k, x), 0.0, xs)
      >>> eqn = jax.make_jaxpr(f)(1.0, jnp.ones(3)).jaxpr.eqns[-1]
      >>> scan_counts(eqn)
      (1, 1)
    """
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    body, _ = open_jaxpr(p["jaxpr"])
    stacked = lambda outer, inner: outer.aval.shape == (p["length"], *inner.aval.shape)

    def trailing(outer: Sequence[Any], inner: Sequence[Any]) -> int:
        n = 0
        for a, b in zip(reversed(outer), reversed(inner), strict=True):
            if not stacked(a, b):
                break
            n += 1
        return n

    n_carry = len(eqn.outvars) - trailing(eqn.outvars, body.outvars)
    return len(eqn.invars) - n_carry - trailing(eqn.invars, body.invars), n_carry


def source_of(eqn: jex.JaxprEqn) -> contextlib.AbstractContextManager:
    """The context in which to rebind ``eqn``: its traceback and its name stack (under
    the current one) made current, as ``jax.core.eval_jaxpr`` does, so the equations an
    interpreter emits keep the user's ``jax.named_scope`` names and source lines (in
    profiles, in errors, and for :func:`jamp.function_activations.function_activations`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(x):
      ...     with jax.named_scope("layer"):
      ...         return x @ x
      >>> eqn = jax.make_jaxpr(f)(jnp.ones((2, 2))).jaxpr.eqns[0]
      >>> def rebound(x):
      ...     with source_of(eqn):
      ...         return x @ x
      >>> str(jax.make_jaxpr(rebound)(jnp.ones((2, 2))).jaxpr.eqns[0].source_info.name_stack)
      'layer'
    """
    if _source_info is None:  # pragma: no cover
        return contextlib.nullcontext()
    info = eqn.source_info
    return _source_info.user_context(
        info.traceback, name_stack=_source_info.current_name_stack() + info.name_stack)


def inline(jaxpr: jex.Jaxpr, consts: Sequence[Any]) -> tuple[jex.Jaxpr, list]:
    """``jaxpr`` with every nested ``jit``/``closed_call`` inlined (fresh variables per call).

    Returns the flat jaxpr and its consts (the outer ones, then the inner calls'). An
    inlined equation's name stack (relative to the call it was in) is prefixed with the
    call's, so it keeps its ``jax.named_scope`` path.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autocast_regions import inline
      >>> closed = jax.make_jaxpr(lambda x: jnp.var(x))(jnp.ones(3))
      >>> flat, _ = inline(closed.jaxpr, closed.consts)
      >>> "pjit" in {e.primitive.name for e in flat.eqns} or "jit" in {
      ...     e.primitive.name for e in flat.eqns}
      False
    """
    if not any(e.primitive.name in _CALLS for e in jaxpr.eqns):
        return jaxpr, list(consts)
    constvars, consts = list(jaxpr.constvars), list(consts)
    eqns: list = []
    alias: dict = {}
    resolve = lambda a: alias.get(a, a) if isinstance(a, jex.Var) else a

    def emit(inner: jex.Jaxpr, inner_consts: Sequence[Any], args: Sequence[Any],
             stack: Any) -> list:
        sub = dict(zip(inner.invars, args, strict=True))
        for v, c in zip(inner.constvars, inner_consts, strict=True):
            fresh = jex.Var(v.aval)
            constvars.append(fresh)
            consts.append(c)
            sub[v] = fresh
        get = lambda a: sub.get(a, a) if isinstance(a, jex.Var) else a
        for e in inner.eqns:
            invars = [get(a) for a in e.invars]
            info = e.source_info.replace(name_stack=stack + e.source_info.name_stack)
            if e.primitive.name in _CALLS:
                outs = emit(*open_jaxpr(e.params[_CALLS[e.primitive.name]]), invars,
                            info.name_stack)
                sub.update(zip(e.outvars, outs, strict=True))
                continue
            outvars = [jex.Var(v.aval) for v in e.outvars]
            sub.update(zip(e.outvars, outvars, strict=True))
            eqns.append(e.replace(invars=invars, outvars=outvars, source_info=info))
        return [get(a) for a in inner.outvars]

    for e in jaxpr.eqns:
        invars = [resolve(a) for a in e.invars]
        if e.primitive.name in _CALLS:
            outs = emit(*open_jaxpr(e.params[_CALLS[e.primitive.name]]), invars,
                        e.source_info.name_stack)
            alias.update(zip(e.outvars, outs, strict=True))
        else:
            eqns.append(e.replace(invars=invars))
    outvars = [resolve(a) for a in jaxpr.outvars]
    flat = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=outvars)
    return flat, consts


_TRANSPARENT = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "squeeze",
                          "expand_dims", "stop_gradient", "max"})


# ----------------------------------------------------------------------------- softmax


def producers(jaxpr: jex.Jaxpr) -> dict[Any, jex.JaxprEqn]:
    """Each variable of ``jaxpr`` and the equation that computes it."""
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


def softmax_at(eqn: jex.JaxprEqn, producers: dict) -> tuple[str, Any, tuple] | None:
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


# ----------------------------------------------------------------------------- constants


def constants(jaxpr: jex.Jaxpr) -> set:
    """Variables computed from literals and ``jaxpr``'s constvars only (fills, masks).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autocast_regions import constants
      >>> jaxpr = jax.make_jaxpr(lambda x: x + jnp.full(3, -1e30))(jnp.ones(3)).jaxpr
      >>> [e.primitive.name for e in jaxpr.eqns if e.outvars[0] in constants(jaxpr)]
      ['broadcast_in_dim', 'convert_element_type']
    """
    known = set(jaxpr.constvars)
    for e in jaxpr.eqns:
        if not e.effects and all(isinstance(v, jex.Literal) or v in known for v in e.invars):
            known.update(e.outvars)
    return known


def narrow_finite(x: Any, dtype: Any) -> Any:
    """``x`` cast to ``dtype``, finite values clipped to ``dtype``'s finite range first.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.autocast_regions import narrow_finite
      >>> x = jnp.float32(-1e30)
      >>> float(narrow_finite(x, jnp.float16)), float(x.astype(jnp.float16))
      (-65504.0, -inf)
    """
    info = jnp.finfo(dtype)
    lo, hi = np.asarray(info.min, x.dtype), np.asarray(info.max, x.dtype)
    if isinstance(x, np.ndarray | np.generic):
        return np.where(np.isfinite(x), np.clip(x, lo, hi), x).astype(dtype)
    return jnp.where(jnp.isfinite(x), jnp.clip(x, lo, hi), x).astype(dtype)


# ----------------------------------------------------------------------------- norms


@dataclasses.dataclass(frozen=True)
class NormRegion:
    """One normalisation: its equations (indices), its inputs, and the values it returns.

    Attributes:
      eqns: indices of the equations that run in float32.
      inputs: the normalised values (the reductions' operands): the region returns
        their dtype.
      exits: normalised values read outside the region (cast back to the inputs' dtype);
        the statistics read outside leave in float32.
    """

    eqns: frozenset
    inputs: tuple
    exits: frozenset


def _graph(jaxpr: jex.Jaxpr) -> tuple[dict, dict]:
    producers = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    consumers: dict = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if isinstance(v, jex.Var):
                consumers.setdefault(v, []).append(i)
    return producers, consumers


def _statistics(jaxpr: jex.Jaxpr, producers: dict, start: Any, below: bool = False,
                limit: int = 60) -> tuple[set, set] | None:
    """The equations computing ``start`` from reductions of some inputs, and those inputs.

    Walks up through elementwise, shape and ``reduce_sum`` equations; below a
    reduction at most four elementwise steps (``x - mean``, its square) before
    a value counts as an input (``below``: ``start`` itself is below one, as
    ``x - mean(x)``). ``None`` without a reduction or past ``limit``.
    """
    region, leaves, reduced = set(), set(), False
    stack = [(start, 0 if below else None)]
    while stack:
        v, depth = stack.pop()
        i = producers.get(v) if isinstance(v, jex.Var) else None
        if i is None:
            if isinstance(v, jex.Var) and depth is not None:
                leaves.add(v)
            continue
        eqn = jaxpr.eqns[i]
        name = eqn.primitive.name
        if name not in _STATISTICS or (depth is not None and name not in _SHAPE and (
                depth >= 4 or name not in _BELOW) and name != "reduce_sum"):
            if depth is None and jnp.issubdtype(v.aval.dtype, jnp.floating):
                return None  # no reduction between the anchor and an input
            leaves.add(v)
            continue
        if i in region:
            continue
        region.add(i)
        if len(region) > limit:
            return None
        if name == "reduce_sum":
            reduced, next_depth = True, 0
        elif depth is None or name in _SHAPE:
            next_depth = depth
        else:
            next_depth = depth + 1
        stack.extend((u, next_depth) for u in eqn.invars)
    return (region, leaves) if reduced and leaves else None


def _anchors(jaxpr: jex.Jaxpr, consumers: dict) -> list[int]:
    out = []
    for i, e in enumerate(jaxpr.eqns):
        name = e.primitive.name
        if name == "rsqrt" or (name == "sqrt" and any(
                jaxpr.eqns[j].primitive.name == "div" for j in consumers.get(e.outvars[0], []))):
            out.append(i)
    return out


def _vars(atoms: Sequence[Any]) -> list:
    return [v for v in atoms if isinstance(v, jex.Var)]


def _size(v: Any) -> int:
    return int(np.prod(getattr(v.aval, "shape", ())))


def _norm_region(jaxpr: jex.Jaxpr, producers: dict, sources: set, anchor: int, stats: set,
                 leaves: set) -> NormRegion:
    """The statistics, the anchor, and what follows it: ``(x - mean) * inv``, the affine."""
    inputs = {v for v in leaves if v.aval.shape and jnp.issubdtype(v.aval.dtype, jnp.floating)}
    inputs = {v for v in inputs if _size(v) == max(_size(u) for u in inputs)}
    region = stats | {anchor}
    normalised = set(jaxpr.eqns[anchor].outvars)
    inside = {v for i in region for v in jaxpr.eqns[i].outvars}

    def acceptable(v: Any, out_size: int) -> bool:
        if not isinstance(v, jex.Var) or v in inside or v in leaves or _size(v) < out_size:
            return True
        while v not in sources and producers.get(v) is not None and \
                jaxpr.eqns[producers[v]].primitive.name in _SHAPE:
            v = jaxpr.eqns[producers[v]].invars[0]
        if v in sources or v in inside:
            return True
        centred = _statistics(jaxpr, producers, v, below=True)  # x - mean(x), apart
        if centred is not None and centred[1] <= leaves | sources:
            region.update(centred[0])
            inside.update(u for i in centred[0] for u in jaxpr.eqns[i].outvars)
            return True
        return False

    for i in range(anchor + 1, len(jaxpr.eqns)):
        e = jaxpr.eqns[i]
        if e.primitive.name not in ("mul", "div", "add", "sub", "convert_element_type",
                                    "broadcast_in_dim") or not any(
                                        v in normalised for v in _vars(e.invars)):
            continue
        size = _size(e.outvars[0])
        if all(acceptable(v, size) for v in _vars(e.invars) if v not in normalised):
            region.add(i)
            normalised.update(e.outvars)
            inside.update(e.outvars)
    outside = {v for i, e in enumerate(jaxpr.eqns) if i not in region
               for v in _vars(e.invars)}
    outside |= set(_vars(jaxpr.outvars))
    exits = frozenset(v for v in normalised if v in outside)
    return NormRegion(frozenset(region), tuple(inputs), exits)


def norm_regions(jaxpr: jex.Jaxpr) -> list[NormRegion]:
    """The normalisations of ``jaxpr``: ``rsqrt``/``sqrt`` of reduced statistics plus affine.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autocast_regions import inline, norm_regions
      >>> ln = lambda x, w: (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(
      ...     x.var(-1, keepdims=True) + 1e-5) * w
      >>> closed = jax.make_jaxpr(ln)(jnp.ones((2, 4)), jnp.ones(4))
      >>> [len(r.inputs) for r in norm_regions(inline(closed.jaxpr, closed.consts)[0])]
      [1]
    """
    producers, consumers = _graph(jaxpr)
    sources = set(jaxpr.invars) | set(jaxpr.constvars)
    regions = []
    for anchor in _anchors(jaxpr, consumers):
        found = _statistics(jaxpr, producers, jaxpr.eqns[anchor].invars[0])
        if found is not None:
            regions.append(_norm_region(jaxpr, producers, sources, anchor, *found))
    return regions


# ----------------------------------------------------------------------------- state


def _from_dot(jaxpr: jex.Jaxpr, producers: dict, v: Any) -> bool:
    while isinstance(v, jex.Var) and v in producers:
        e = jaxpr.eqns[producers[v]]
        if e.primitive.name in _DOTS:
            return True
        if e.primitive.name not in _SHAPE | {"transpose"}:
            return False
        v = e.invars[0]
    return False


def _state(jaxpr: jex.Jaxpr) -> tuple[set, set]:
    producers, _ = _graph(jaxpr)
    floating = [v for v in jaxpr.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
    reach: dict = {v: {v} for v in floating}  # var -> the inputs it is an elementwise path of
    via: dict = {}
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name not in _ELEMENTWISE:
            continue
        srcs = set().union(*(reach.get(v, set()) for v in e.invars if isinstance(v, jex.Var)))
        if not srcs or any(_from_dot(jaxpr, producers, v) for v in e.invars):
            continue
        for v in e.outvars:
            reach[v] = srcs
            via[v] = i
    eqns, inputs = set(), set()
    stack = []
    for v in jaxpr.outvars:
        if not isinstance(v, jex.Var) or v not in via:
            continue
        same = {s for s in reach[v] if s.aval.shape == v.aval.shape}
        if same:
            inputs |= same
            stack.append(v)
    while stack:
        v = stack.pop()
        i = via.get(v)
        if i is None or i in eqns:
            continue
        eqns.add(i)
        stack.extend(u for u in jaxpr.eqns[i].invars if isinstance(u, jex.Var) and u in via)
    return eqns, inputs


def state_equations(jaxpr: jex.Jaxpr) -> set[int]:
    """Indices of the equations on elementwise paths from a floating input to an output of
    its shape that meet no matmul/conv output: they run in the dtypes they were traced with.
    """
    return _state(jaxpr)[0]


def state_inputs(jaxpr: jex.Jaxpr) -> list[int]:
    """Positions of the floating inputs that are state (see :func:`state_equations`)."""
    inputs = _state(jaxpr)[1]
    return [i for i, v in enumerate(jaxpr.invars) if v in inputs]
