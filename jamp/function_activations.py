"""Layer outputs of a plain function (Equinox, Haiku, jnp) for :mod:`jamp.tensor_stats`.

A linen or NNX model has layers to intercept; a function ``fn(params, x)`` has equations.
:func:`function_activations` traces ``fn`` (normally the :func:`jamp.autocast` rewrite of
it, so the values are those of the mixed-precision forward pass) to a jaxpr and evaluates
it again, equation by equation, handing the output of every matmul and convolution
(``dot_general``, ``conv_general_dilated``: where a half-precision forward pass
overflows) and the function's outputs to ``reduce`` where they are computed, in the
order they are computed. The result has the layout of
:func:`jamp.tensor_stats.linen_activations`' (``{name: {"__call__": (reduce(y),)}}``),
for :func:`jamp.tensor_stats.ordered_leaves` and :func:`jamp.tensor_stats.reduced_stats`.

Names: the equation's ``jax.named_scope`` path (Haiku's module names, Equinox's layer
classes, your own scopes) and the primitive, ``mlp/linear_1/dot_general``; an equation
with no scope is named by the first line of its traceback outside JAX, jamp and the
layer libraries, ``model.py:68 dot_general``. A name met again gets ``#2``, ``#3``...
Names and their order depend only on the traced program: every call gives the same.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp import tensor_stats
  >>> from jamp.function_activations import function_activations
  >>> def mlp(w, x):
  ...     with jax.named_scope("mlp"):
  ...         return jnp.tanh(x @ w["a"]) @ w["b"]
  >>> w = {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}
  >>> out = function_activations(mlp, w, jnp.ones((1, 3)), reduce=tensor_stats.array_stats)
  >>> [n for n, _ in tensor_stats.ordered_leaves(out)]
  ['mlp/dot_general', 'mlp/dot_general#2', '(output)']
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sysconfig
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.extend.source_info_util import NameStack

from jamp import autocast_regions as regions
from jamp.autocast import _bind  # binds an equation as jax.core.eval_jaxpr does
from jamp.tensor_stats import named_leaves

__all__ = ["SCAN", "function_activations"]

SCAN = "scan"
"""The path component of a ``lax.scan``'s outputs (``layers/scan/mlp/dot_general``): their
statistics are stacked, one per iteration; list it in the ``scanned`` of
:func:`jamp.tensor_stats.reduced_stats` (``jamp.boost`` does) for one row per layer,
``layers/scan/3/mlp/dot_general``."""

_DOTS = frozenset({"dot_general", "conv_general_dilated"})
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}
_LIBRARIES = ("jax", "jaxlib", "jamp", "equinox", "haiku", "flax", "optax", "chex", "jaxtyping")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """The folders whose frames are not the user's: the libraries a forward pass goes
    through, and Python's own (``contextlib``, ``functools``)."""
    dirs = [sysconfig.get_paths()["stdlib"]]
    for name in _LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        dirs += list(spec.submodule_search_locations or []) if spec is not None else []
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


@functools.lru_cache(maxsize=4096)
def _is_library(path: str) -> bool:
    return path.startswith("<frozen") or os.path.realpath(path).startswith(_library_dirs())


def _user_line(eqn: jex.JaxprEqn) -> str:
    """``file.py:LINE`` of the innermost frame of ``eqn``'s traceback outside the libraries."""
    traceback = eqn.source_info.traceback
    for frame in getattr(traceback, "frames", None) or ():
        if not _is_library(frame.file_name):
            return f"{os.path.basename(frame.file_name)}:{frame.line_num}"
    return "?"


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


@dataclasses.dataclass
class _Run:
    """One evaluation's results: ``(name, reduce(y))`` in the order computed."""

    reduce: Callable[[jax.Array], Any]
    entries: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    seen: dict[str, int] = dataclasses.field(default_factory=dict)
    hidden: list[str] = dataclasses.field(default_factory=list)
    """Where matmuls ran inside a body that is evaluated as it is (no rows)."""

    def count(self, name: str) -> int:
        self.seen[name] = self.seen.get(name, 0) + 1
        return self.seen[name]

    def unique(self, name: str) -> str:
        n = self.count(name)
        return name if n == 1 else f"{name}#{n}"

    def add(self, name: str, y: Any) -> None:
        if _is_floating(y):
            self.entries.append((self.unique(name), self.reduce(y)))


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _eval(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any], run: _Run,
          prefix: str, stack: NameStack) -> list:
    """Evaluates ``jaxpr`` as written, reducing each matmul/conv output into ``run``.

    ``prefix``: the names of the enclosing scans (``layers/scan``); ``stack``: the name
    stack of the enclosing (inlined) calls since the innermost scan's body began.
    """
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name, here = eqn.primitive.name, stack + eqn.source_info.name_stack
        with regions.source_of(eqn):
            if name in _CALLS and _CALLS[name] in eqn.params:
                inner, inner_consts = regions.open_jaxpr(eqn.params[_CALLS[name]])
                outs = _eval(inner, inner_consts, invals, run, prefix, here)
            elif name == "scan":
                where = _join(prefix, str(here) or _user_line(eqn))
                n = run.count(_join(where, SCAN))  # a second scan here: where#2/scan
                outs = _scan(eqn, invals, run, _join(where + (f"#{n}" if n > 1 else ""), SCAN))
            else:
                outs = _bind(eqn, invals)
                if name not in _DOTS and _dots_within(eqn.params.values()):
                    where = _join(prefix, str(here) or _user_line(eqn))
                    run.hidden.append(f"{name} at {where}" if where else name)
        if name in _DOTS:
            run.add(_join(prefix, f"{here}/{name}" if str(here) else
                          f"{_user_line(eqn)} {name}"), outs[0])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _dots_within(params: Any) -> bool:
    """Whether a matmul or convolution is inside the jaxprs among ``params`` (a cond's
    branches, a while loop's body, a ``shard_map``'s jaxpr...)."""
    for p in params:
        if isinstance(p, list | tuple):
            if _dots_within(p):
                return True
            continue
        jaxpr = getattr(p, "jaxpr", p)
        if isinstance(jaxpr, jex.Jaxpr) and any(
                e.primitive.name in _DOTS or _dots_within(e.params.values())
                for e in jaxpr.eqns):
            return True
    return False


def _scan(eqn: jex.JaxprEqn, invals: Sequence[Any], run: _Run, where: str) -> list:
    """``lax.scan`` again, its body's reduced outputs as extra stacked outputs (one per
    iteration), recorded under ``where`` once the scan is done."""
    p = eqn.params
    n_consts, n_carry = regions.scan_counts(eqn)
    body, body_consts = regions.open_jaxpr(p["jaxpr"])
    consts, carry, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                         invals[n_consts + n_carry:])
    names: list[str] = []

    def step(c, x):
        inner = _Run(run.reduce, hidden=run.hidden)  # afresh each time the body is traced
        out = _eval(body, body_consts, [*consts, *c, *x], inner, where, NameStack())
        names[:] = [n for n, _ in inner.entries]
        return out[:n_carry], (out[n_carry:], [r for _, r in inner.entries])

    carry, (ys, stacked) = jax.lax.scan(step, list(carry), list(xs), length=p["length"],
                                        reverse=p["reverse"], unroll=p["unroll"])
    run.entries += zip(names, stacked, strict=True)
    return [*carry, *ys]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def function_activations(fn: Callable[..., Any], *args: Any,
                         reduce: Callable[[jax.Array], Any] | None = None,
                         **kwargs: Any) -> dict[str, Any]:
    """The output of every matmul and convolution of ``fn(*args, **kwargs)``, and ``fn``'s
    floating outputs, in the order they are computed: ``{name: {"__call__": (y,)}}`` for
    :func:`jamp.tensor_stats.ordered_leaves`, as :func:`jamp.tensor_stats.linen_activations`
    gives for linen (names: see the module docstring; the outputs are ``(output)``, or
    ``(output)/<path>`` for a tree of them).

    ``fn`` is traced to a jaxpr (its array arguments traced, the rest passed as they are)
    and evaluated again as written, so each value is exactly the one ``fn`` computes;
    pass the :func:`jamp.autocast` rewrite of a function for its mixed-precision values.
    ``reduce``: applied to each output where it is computed (e.g.
    :func:`jamp.tensor_stats.array_stats`), so the outputs themselves are not kept.

    Nested calls (``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp`` functions) are
    evaluated inline (their custom derivative rules dropped: this is a forward pass for
    statistics, not one to differentiate). A ``lax.scan`` (stacked layers) runs again with
    each of its body's results stacked over the iterations, under a path component
    :data:`SCAN` (list it in ``scanned`` for one row per layer). The bodies of
    ``lax.while_loop`` and ``lax.cond`` run as they are: their matmuls have no rows, and a
    warning says where they are.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def layer(h, w):
      ...     with jax.named_scope("dense"):
      ...         return h @ w, None
      >>> def stack(ws, x):  # three layers, scanned
      ...     with jax.named_scope("layers"):
      ...         return jax.lax.scan(layer, x, ws)[0]
      >>> fast = jamp.autocast(stack, "fp16")
      >>> out = function_activations(fast, jnp.ones((3, 2, 2)), jnp.ones((1, 2)),
      ...                            reduce=jamp.tensor_stats.array_stats)
      >>> stats, rows = jamp.tensor_stats.reduced_stats(
      ...     jamp.tensor_stats.ordered_leaves(out), scanned=(SCAN,))
      >>> [r.name for r in rows][:2]
      ['layers/scan/0/dense/dot_general', 'layers/scan/1/dense/dot_general']
      >>> stats.amax.tolist()
      [2.0, 4.0, 8.0, 8.0]
    """
    keep = reduce if reduce is not None else (lambda y: y)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

    def traced(*arrays):
        full = list(leaves)
        for i, x in zip(dynamic, arrays, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    arrays = [leaves[i] for i in dynamic]
    closed, shape = jax.make_jaxpr(traced, return_shape=True)(*arrays)
    run = _Run(keep)
    outs = _eval(closed.jaxpr, closed.consts, arrays, run, "", NameStack())
    outputs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)
    for path, y in named_leaves(outputs):
        run.add(_join("(output)", path), y)
    if run.hidden:
        where = ", ".join(dict.fromkeys(run.hidden))
        warnings.warn(f"function_activations: the matmuls inside {where} have no rows (the "
                      "bodies of lax.cond, lax.while_loop and other control flow run as they "
                      "are): their overflows show in the first layer after them. For a row "
                      "per layer, run stacked layers with lax.scan.",
                      stacklevel=2)
    return {name: {"__call__": (value,)} for name, value in run.entries}
