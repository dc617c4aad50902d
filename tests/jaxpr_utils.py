"""Helpers to read dtypes out of jaxprs, including nested ones (scan, remat, pjit, custom_vjp)."""

from __future__ import annotations

import jax
from jax.extend import core as jex_core


def _subjaxprs(value):
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _subjaxprs(v)


def iter_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in _subjaxprs(param):
                yield from iter_eqns(sub)


def operand_dtypes(fn, *args, primitive: str) -> list[tuple[str, ...]]:
    """The operand dtypes of every ``primitive`` equation in ``fn``'s jaxpr."""
    closed = jax.make_jaxpr(fn)(*args)
    return [tuple(str(v.aval.dtype) for v in eqn.invars)
            for eqn in iter_eqns(closed) if eqn.primitive.name == primitive]
