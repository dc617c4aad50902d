"""Optimizer-state and master-weight precision: 16 bytes per parameter down to 7.

Two optax-level wrappers, and the presets :func:`jamp.mixed_precision` names:

- :func:`low_precision_state` (:mod:`jamp.optim_state.moments`) stores any optax
  chain's per-parameter state (``mu``, ``nu``, SGD's ``trace``...) in bf16, float16 or
  fp8 with scales, computing the update in float32;
- :func:`bf16_master` (:mod:`jamp.optim_state.master`) keeps the master copy of bf16
  parameters as float32, as 16-bit remainders (exact), as a Kahan compensation buffer,
  or not at all (stochastic rounding, or plain rounding: lossy).

:func:`wrap` puts them together as :func:`jamp.make_optimizer` does for a recipe's
``optimizer_state`` and ``master_weights``.

Example:
  >>> import jax.numpy as jnp, optax, jamp
  >>> mp = jamp.mixed_precision("bf16_lowmem_exact")
  >>> mp.optimizer_state, mp.master_weights
  ('fp8', 'remainders')
  >>> tx = jamp.make_optimizer(mp, optax.adamw(1e-3))
  >>> state = tx.init({"w": jnp.ones((4, 4), jnp.bfloat16)})
  >>> jamp.optim_state.stored_dtypes(state)
  {'mu': 'float8_e4m3fn', 'nu': 'float16'}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jamp.optim_state.master import (
    BYTES_PER_PARAM,
    SCHEMES,
    Bf16MasterState,
    bf16_master,
    master_view,
)
from jamp.optim_state.moments import (
    ANY,
    FormatLike,
    LowPrecisionState,
    QuantizedLeaf,
    StateFormat,
    as_format,
    dequantize,
    low_precision_state,
    quantize,
    stored_dtypes,
)

__all__ = ["ANY", "BYTES_PER_PARAM", "PRESETS", "SCHEMES", "Bf16MasterState", "FormatLike",
           "LowPrecisionState", "QuantizedLeaf", "StateFormat", "as_format", "bf16_master",
           "check_master_weights", "check_optimizer_state", "checkpoint_mismatch", "dequantize",
           "low_precision_state", "master_view", "quantize", "stored_dtypes", "wrap"]

PRESETS: dict[str, dict[str, StateFormat] | None] = {
    "float32": None,
    "bf16": {ANY: StateFormat("bf16")},
    "fp8": {"mu": StateFormat("fp8", block_size=128),
            "trace": StateFormat("fp8", block_size=128),
            "nu": StateFormat("fp16", sqrt=True),
            ANY: StateFormat("bf16")},
}
"""The named ``optimizer_state`` settings (``benchmarks/optimizer_state.py`` measured them):

- ``"float32"``: as optax keeps it (no wrapper).
- ``"bf16"``: every per-parameter state in bfloat16 (2 bytes each).
- ``"fp8"``: first moments (AdamW's ``mu``, SGD's ``trace``) in fp8 E4M3 with a scale per
  128 elements, ``nu`` in float16 as its square root with a per-tensor scale (MS-AMP O2's
  fp8/fp16 split; the root keeps 16 more decades of gradient range), anything else bf16:
  about 3 bytes per parameter for AdamW's two moments.
"""


def _is_legacy(value: Any) -> bool:
    return isinstance(value, bool)


def check_master_weights(value: Any) -> bool | str:
    """``value`` if it is a valid ``master_weights`` setting: True/False (float32 copy or
    none, jamp's modes before), or one of :data:`SCHEMES`.

    Example:
      >>> import jamp
      >>> jamp.optim_state.check_master_weights("remainders")
      'remainders'
    """
    if _is_legacy(value) or value in SCHEMES:
        return value
    raise ValueError(
        f"Unknown master_weights {value!r}. Valid: {', '.join(map(repr, SCHEMES))} (bytes per "
        f"bf16 parameter: {', '.join(f'{k} {v}' for k, v in BYTES_PER_PARAM.items())}), or "
        "True/False (a float32 copy / none).")


def check_optimizer_state(value: Any) -> str | dict[str, StateFormat]:
    """``value`` as a preset name or a checked ``{state name: StateFormat}`` mapping.

    Example:
      >>> import jamp
      >>> jamp.optim_state.check_optimizer_state({"mu": "fp8"})
      {'mu': StateFormat(dtype='float8_e4m3fn', block_size=None, sqrt=False)}
    """
    if isinstance(value, str) and "=" in value:  # the command line's "mu=fp8,nu=fp16"
        pairs = [part.partition("=") for part in value.split(",") if part.strip()]
        if any(not sep or not k.strip() for k, sep, _ in pairs):
            raise ValueError(f"optimizer_state {value!r}: write name=dtype pairs separated by "
                             "commas, e.g. 'mu=fp8,nu=fp16,*=bf16'.")
        value = {k.strip(): v.strip() for k, _, v in pairs}
    if isinstance(value, str):
        if value in PRESETS:
            return value
        raise ValueError(
            f"Unknown optimizer_state {value!r}. Valid: {', '.join(map(repr, PRESETS))}, or a "
            "mapping from state names to dtypes such as {'mu': 'fp8', 'nu': 'fp16', '*': "
            "'bf16'} (dtypes: f32, bf16, fp16, fp8).")
    if isinstance(value, StateFormat):
        return {ANY: value}
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)  # a recipe's frozen form
    if isinstance(value, Mapping):
        from jamp.optim_state.moments import _check_formats  # noqa: PLC0415

        return _check_formats(value)
    raise ValueError(f"optimizer_state must be a preset name ({', '.join(map(repr, PRESETS))}) "
                     f"or a mapping from state names to dtypes, got {value!r}.")


def check_combination(optimizer_state: Any, master_weights: Any, param_dtype: Any) -> None:
    """Raises a ValueError for a master-weight scheme the parameter dtype cannot use.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> try:
      ...     jamp.optim_state.check_combination("fp8", "remainders", jnp.float32)
      ... except ValueError as e:
      ...     print(str(e).split(" (")[0])
      master_weights='remainders' needs bfloat16 parameters
    """
    del optimizer_state
    dtype = jnp.dtype(param_dtype)
    if _is_legacy(master_weights) or master_weights in ("float32", "none"):
        return
    if master_weights in ("remainders", "stochastic") and dtype != jnp.bfloat16:
        raise ValueError(
            f"master_weights={master_weights!r} needs bfloat16 parameters (the bf16 value is "
            f"the top half of the float32 master), and the policy keeps them in {dtype.name}: "
            "use mode 'bf16_lowmem' / 'bf16_lowmem_exact' or policy='p=bf16,c=bf16,o=f32', or "
            "master_weights='float32'.")
    if master_weights == "kahan" and dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"master_weights='kahan' compensates half-precision parameters, and the policy "
            f"keeps them in {dtype.name} (their own master): use policy='p=bf16,c=bf16,o=f32' "
            "or drop master_weights.")


def _key_names(tree: Any) -> set[str]:
    names = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        for k in path:
            name = getattr(k, "key", getattr(k, "name", None))
            if isinstance(name, str):
                names.add(name)
    return names


def _describe(names: set[str]) -> str:
    low = "scale" in names and "value" in names
    master = "master" in names and "count" in names
    return (f"{'low-precision (quantized)' if low else 'float32'} optimizer state"
            f"{' with a bf16_master buffer' if master else ''}")


def checkpoint_mismatch(abstract: Any, saved: Any) -> str | None:
    """One sentence when the optimizer-state precision of a saved state tree (orbax's
    metadata tree) differs from that of ``abstract``, the state to restore into; None when
    they agree.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> p = {"w": jnp.ones((2, 2))}
      >>> low = jamp.low_precision_state(optax.adam(1e-3), "bf16").init(p)
      >>> print(jamp.optim_state.checkpoint_mismatch(low, optax.adam(1e-3).init(p))[:60])
      The checkpoint holds float32 optimizer state, and this run s
    """
    mine, theirs = _describe(_key_names(abstract)), _describe(_key_names(saved))
    if mine == theirs:
        return None
    return (f"The checkpoint holds {theirs}, and this run stores {mine} "
            "(mixed_precision's optimizer_state / master_weights differ). Restore with the "
            "optimizer_state and master_weights it was saved with; to change them, restore "
            "the run as saved and start the new optimizer from its parameters "
            "(tx.init(state.params)).")


def wrap(tx: optax.GradientTransformation, optimizer_state: Any = "float32",
         master_weights: bool | str = False, *, seed: int = 0
         ) -> optax.GradientTransformation:
    """``tx`` with its state stored as ``optimizer_state`` says, inside the master-weight
    scheme ``master_weights`` (the loss scale goes outside: :func:`jamp.make_optimizer`).

    ``master_weights``: False (none, optax as is), True or ``"float32"``
    (:func:`jamp.master_weights`, a float32 copy rounded to nearest even), or a scheme of
    :func:`bf16_master` (``"remainders"``, ``"kahan"``, ``"stochastic"``, ``"none"``: the
    optimizer then runs in float32 on bf16 parameters).

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> tx = jamp.optim_state.wrap(optax.adam(1e-3), "bf16", "kahan")
      >>> type(tx.init({"w": jnp.ones(2, jnp.bfloat16)})).__name__
      'Bf16MasterState'
    """
    from jamp.master import master_weights as float32_master  # noqa: PLC0415

    formats = check_optimizer_state(optimizer_state)
    master_weights = check_master_weights(master_weights)
    if isinstance(formats, str):
        formats = PRESETS[formats]
        strict = False
    else:
        strict = True
    if formats is not None:
        tx = low_precision_state(tx, formats, strict=strict)
    if master_weights is True or master_weights == "float32":
        return float32_master(tx)
    if master_weights is False:
        return tx
    return bf16_master(tx, master_weights, seed=seed)
