"""The dtype a function reads each parameter in, found from its jaxpr.

ZeRO-3 / FSDP stores every parameter sharded in its param dtype and all-gathers it
before use. A model under a mixed-precision policy reads most parameters through a
cast (``float32 -> float16`` for a kernel), so the cast can move *before* the gather
and the gather moves half the bytes; but a parameter the model reads in float32
(a LayerNorm scale under jamp's policies, a module overridden to float32) must be
gathered as it is, or the numbers change. :func:`read_dtypes` answers, per leaf,
which dtype the gather may use, for any function of the parameters (linen's
``model.apply``, an NNX model made functional, a plain JAX function), by reading
its jaxpr instead of trusting a policy's description.

The rule, per floating leaf: follow every use of its value, through ops that only
move data (``reshape``, ``transpose``, ``broadcast_in_dim``, ``slice``,
``dynamic_slice``, ``gather``, ``concatenate``, ``pad``, ``select_n``, ``copy``,
``sharding_constraint``, ``pvary``, ``all_gather``, ...: each commutes with an
element-wise cast) and into nested jaxprs (``jit``, ``remat``, ``custom_jvp_call``
and ``custom_vjp_call`` (their primal ``call_jaxpr``), ``closed_call``,
``shard_map``, ``scan`` (consts and per-iteration slices of ``xs``), ``cond`` (every
branch) and ``while`` (consts)). If every use found is a ``convert_element_type`` to
one floating dtype ``X`` no wider than the leaf's own, the leaf is read in ``X``:
casting it to ``X`` before the gather gives the function bit-identical inputs.
Anything else (a dot or an add on the raw value, casts that disagree, a scan carry,
a value returned as it is, a primitive not listed) reads the leaf in its own dtype,
which is always safe. Unused and non-floating leaves keep their own dtype.

What is traced is what is analysed: for a forward function, the forward reads; pass
the gradient function (``jax.grad(loss)``) to include the backward pass's reads
(a ``custom_vjp``'s backward rule is traced only then).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp.parallel.read_dtypes import read_dtypes
  >>> def f(p, x):
  ...     h = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)   # read in float16
  ...     return h.astype(jnp.float32) * p["scale"]                 # read as it is
  >>> params = {"w": jnp.ones((4, 3)), "scale": jnp.ones(3)}
  >>> read_dtypes(f, params, jax.ShapeDtypeStruct((2, 4), jnp.float32))
  {'scale': dtype('float32'), 'w': dtype('float16')}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jamp import autocast_regions as regions

__all__ = ["read_dtypes"]

# Primitives whose output is (a rearrangement of) elements of the operands at these
# positions ("all": every operand), unchanged: an element-wise cast commutes with them.
_MOVES: dict[str, tuple[int, ...] | str] = {
    **dict.fromkeys(
        ("reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "rev",
         "slice", "dynamic_slice", "gather", "copy", "copy_p", "sharding_constraint",
         "mesh_cast", "reshard", "pvary", "pcast", "all_gather", "all_to_all", "ppermute"),
        (0,)),
    "concatenate": "all",
    "pad": "all",
    "dynamic_update_slice": (0, 1),
    "select_n": "all_but_first",  # the predicate picks, the cases are moved
}
# Call-like primitives: operand i is the nested jaxpr's invar i, output j its outvar j.
_CALLS: dict[str, str] = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "remat2": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "shard_map": "jaxpr",
}


def _open(jaxpr: Any) -> jex_core.Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


class _Reads:
    """What the uses of one leaf found: the dtypes it is cast to, and raw uses."""

    def __init__(self) -> None:
        self.casts: set[np.dtype] = set()
        self.raw = False


def _follow(jaxpr: Any, tracked: Iterable[Any], reads: _Reads) -> set[int]:
    """Records in ``reads`` the uses of the ``tracked`` vars of ``jaxpr`` (copies of one
    leaf's value) and returns the indices of the outputs that carry such a copy."""
    jaxpr = _open(jaxpr)
    live = set(tracked)
    for eqn in jaxpr.eqns:
        hits = [i for i, v in enumerate(eqn.invars)
                if not isinstance(v, jex_core.Literal) and v in live]
        if hits:
            live.update(_through(eqn, hits, reads))
        if reads.raw:
            return set()
    escaped = {i for i, v in enumerate(jaxpr.outvars)
               if not isinstance(v, jex_core.Literal) and v in live}
    return escaped


def _through(eqn: Any, hits: list[int], reads: _Reads) -> list[Any]:
    """The outputs of ``eqn`` that carry a copy of the leaf, given the operands at
    positions ``hits`` do; the other uses are recorded in ``reads``."""
    name, params = eqn.primitive.name, eqn.params
    if name == "convert_element_type":
        old, new = np.dtype(eqn.invars[0].aval.dtype), np.dtype(params["new_dtype"])
        if new == old:
            return list(eqn.outvars)
        if jax.dtypes.issubdtype(new, np.floating):
            reads.casts.add(new)
        else:
            reads.raw = True
        return []
    if name in _MOVES:
        allowed = _MOVES[name]
        ok = (allowed == "all" or (allowed == "all_but_first" and 0 not in hits)
              or (isinstance(allowed, tuple) and set(hits) <= set(allowed)))
        if ok:
            return list(eqn.outvars)
        reads.raw = True
        return []
    if name == "optimization_barrier":
        return [eqn.outvars[i] for i in hits]
    if name in _CALLS and _CALLS[name] in params:
        sub = _open(params[_CALLS[name]])
        if len(sub.invars) != len(eqn.invars):
            reads.raw = True
            return []
        escaped = _follow(sub, [sub.invars[i] for i in hits], reads)
        return [eqn.outvars[j] for j in escaped]
    if name == "scan":
        body = _open(params["jaxpr"])
        n_consts, n_carry = regions.scan_counts(eqn)
        if any(n_consts <= i < n_consts + n_carry for i in hits):
            reads.raw = True  # a carry mixes the leaf with the loop's other values
            return []
        escaped = _follow(body, [body.invars[i] for i in hits], reads)
        if any(j < n_carry for j in escaped):
            reads.raw = True
            return []
        return [eqn.outvars[j] for j in escaped]  # stacked ys: moved copies
    if name == "cond":
        if 0 in hits:
            reads.raw = True
            return []
        escaped: set[int] = set()
        for branch in params["branches"]:
            branch = _open(branch)
            escaped |= _follow(branch, [branch.invars[i - 1] for i in hits], reads)
        return [eqn.outvars[j] for j in escaped]
    if name == "while":
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        if any(i >= n_cond + n_body for i in hits):
            reads.raw = True  # the carry
            return []
        cond, body = _open(params["cond_jaxpr"]), _open(params["body_jaxpr"])
        _follow(cond, [cond.invars[i] for i in hits if i < n_cond], reads)
        escaped = _follow(body, [body.invars[i - n_cond] for i in hits if i >= n_cond], reads)
        if escaped:
            reads.raw = True  # into the carry
        return []
    reads.raw = True  # any other primitive computes with the value as it is
    return []


def _leaf_dtype(var: Any, jaxpr: jex_core.Jaxpr) -> np.dtype:
    own = np.dtype(var.aval.dtype)
    if not jax.dtypes.issubdtype(own, np.floating):
        return own
    reads = _Reads()
    if _follow(jaxpr, [var], reads):
        reads.raw = True  # returned as it is
    if reads.raw or len(reads.casts) != 1:
        return own
    (cast,) = reads.casts
    return cast if cast.itemsize <= own.itemsize else own


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def read_dtypes(fun: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Any:
    """The dtype ``fun(params, *args, **kwargs)`` reads each leaf of ``params`` in.

    Args:
      fun: any JAX-traceable function of the parameters (e.g. ``lambda p, x:
        model.apply({"params": p}, x)``, or ``jax.grad`` of a loss).
      params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
      args, kwargs: the other arguments; array and ``jax.ShapeDtypeStruct``
        leaves are traced, anything else (flags, modules) is passed as it is.

    Returns:
      A pytree like ``params`` of ``numpy.dtype``: per floating leaf the one dtype
      every use casts it to (if no wider than its own), else its own dtype (also
      for unused and non-floating leaves). See the module docstring for the rule.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.parallel.read_dtypes import read_dtypes
      >>> f = lambda p: p["a"].astype(jnp.bfloat16).sum() + p["b"] * p["b"].astype(jnp.bfloat16)
      >>> read_dtypes(f, {"a": jnp.ones(3), "b": jnp.ones(())})  # 'b' is also read raw
      {'a': dtype(bfloat16), 'b': dtype('float32')}
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    rest, rest_def = jax.tree_util.tree_flatten((args, kwargs))
    traced = [i for i, x in enumerate(rest) if _is_array(x)]

    def call(p: Any, dynamic: list[Any]) -> Any:
        values = list(rest)
        for i, x in zip(traced, dynamic, strict=True):
            values[i] = x
        a, k = jax.tree_util.tree_unflatten(rest_def, values)
        return fun(p, *a, **k)

    closed = jax.make_jaxpr(call)(params, [rest[i] for i in traced])
    jaxpr = closed.jaxpr
    return jax.tree_util.tree_unflatten(
        treedef, [_leaf_dtype(v, jaxpr) for v in jaxpr.invars[:len(leaves)]])
