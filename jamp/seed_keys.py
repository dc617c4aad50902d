"""Colossal-AI, apex, torch.amp and Lightning precision settings, read as jamp's.

One job: translate the keys of the libraries jamp reimplements into a
:class:`jamp.MixedPrecision` (and, for ``jamp.train``, into its config), each key
with the meaning it has there. :func:`jamp.mixed_precision` hands these forms
here, so all of these work::

  jamp.mixed_precision(dict(mode=AMP_TYPE.TORCH, init_scale=2.**16))  # Colossal-AI fp16=dict
  jamp.mixed_precision("fp16_apex")                                 # Booster string
  jamp.mixed_precision(opt_level="O2", loss_scale=128.0)            # apex amp.initialize
  jamp.mixed_precision(16)                                          # Lightning precision=16

Where a seed leaves a value open, jamp decides (``docs/guides/coming_from.md``):
apex's ``min_loss_scale=None`` ("no floor") is jamp's smallest scale, 2**-126
(:data:`NO_FLOOR`); apex's scaler has no hysteresis (1); a key absent from a
Colossal-AI naive dict takes Colossal-AI's naive default (initial scale 2**32,
interval 1000, hysteresis 2, maximum 2**32).

Example:
  >>> import jamp
  >>> from jamp import AMP_TYPE
  >>> mp = jamp.mixed_precision(dict(mode=AMP_TYPE.NAIVE, clip_grad=1.0))
  >>> mp.name, mp.loss_scale.init_scale, mp.loss_scale.hysteresis, mp.clip_grad_norm
  ('fp16_naive', 4294967296.0, 2, 1.0)
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import os
import runpy
import types
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jamp.loss_scale import LossScaleConfig
from jamp.policy import (
    NORMS,
    MixedPrecision,
    Policy,
    float32_overrides,
)


class AMP_TYPE(enum.StrEnum):  # noqa: N801  (Colossal-AI's spelling)
    """Colossal-AI's AMP modes: the ``mode`` of a ``fp16=dict(...)`` block.

    ``PARALLEL`` (the older docs' name of the tensor-parallel AMP) is an alias
    of ``NAIVE``. The members are strings, so ``mode="torch"`` means
    ``AMP_TYPE.TORCH``.

    Example:
      >>> from jamp import AMP_TYPE
      >>> AMP_TYPE.PARALLEL is AMP_TYPE.NAIVE, AMP_TYPE("torch") is AMP_TYPE.TORCH
      (True, True)
    """

    TORCH = "torch"
    APEX = "apex"
    NAIVE = "naive"
    PARALLEL = "naive"


NO_FLOOR: float = 2.0**-126
"""The ``min_scale`` jamp uses for "no floor" (apex's ``min_loss_scale=None``): the
smallest scale :class:`jamp.LossScaleConfig` accepts (1/scale stays finite in float32)."""

TORCH_DEFAULTS: dict[str, Any] = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=2000, enabled=True)
"""``fp16=dict(mode=AMP_TYPE.TORCH, ...)``'s keys and defaults (torch's ``GradScaler``)."""

APEX_DEFAULTS: dict[str, Any] = dict(
    enabled=True, opt_level="O1", cast_model_type=None, patch_torch_functions=None,
    keep_batchnorm_fp32=None, master_weights=None, loss_scale=None, cast_model_outputs=None,
    num_losses=1, verbosity=1, min_loss_scale=None, max_loss_scale=2.0**24)
"""``amp.initialize``'s (and ``mode=AMP_TYPE.APEX``'s) keys and defaults."""

NAIVE_DEFAULTS: dict[str, Any] = dict(
    log_num_zeros_in_grad=False, initial_scale=2.0**32, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=1000, hysteresis=2, max_scale=2.0**32, min_scale=1.0, clip_grad=0.0,
    verbose=False)
"""``mode=AMP_TYPE.NAIVE``'s keys and Colossal-AI's defaults for them."""

OPT_LEVELS: dict[str, str] = {"O0": "fp32", "O1": "fp16", "O2": "fp16_naive", "O3": "fp16_pure"}
"""apex's ``opt_level`` -> jamp's mode."""

BOOSTER_MODES: dict[str, str] = {"fp16": "fp16", "fp16_apex": "fp16", "bf16": "bf16",
                                 "fp8": "fp8", "fp16_naive": "fp16_naive"}
"""Colossal-AI ``Booster(mixed_precision=...)`` strings -> the jamp mode they give
(``'fp16_apex'`` is apex O1: :func:`from_apex`)."""

LIGHTNING_KEYS: tuple[str, ...] = ("precision", "amp_backend", "amp_level")
"""Lightning ``Trainer`` keys :func:`from_lightning` reads."""

_APEX_ONLY = ("opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
              "cast_model_outputs", "verbosity", "min_loss_scale", "max_loss_scale", "enabled")
_NAIVE_RENAMES = {"initial_scale": "init_scale", "clip_grad": "clip_grad_norm"}
_MODE_KEYS = {AMP_TYPE.TORCH: TORCH_DEFAULTS, AMP_TYPE.APEX: APEX_DEFAULTS,
              AMP_TYPE.NAIVE: NAIVE_DEFAULTS}
_KEEP_NORMS_DEFAULT = {"O0": True, "O1": True, "O2": True, "O3": False}


# --------------------------------------------------------------------------- values


def _number(key: str, value: Any, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        want = "an integer" if integer else "a number"
        raise ValueError(f"{key}={value!r}: {key} takes {want}, e.g. {key}="
                         f"{_example(key)}.")
    return value if integer else float(value)


def _example(key: str) -> Any:
    for defaults in (TORCH_DEFAULTS, NAIVE_DEFAULTS, APEX_DEFAULTS):
        if defaults.get(key) is not None:
            return defaults[key]
    return {"min_loss_scale": 1.0, "loss_scale": "'dynamic'"}.get(key, 1)


def _flag(key: str, value: Any, allow_none: bool = True) -> bool | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value in ("True", "False"):  # apex accepts the strings
        return value == "True"
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r}: {key} takes True or False"
                         f"{' (or None: the opt_level default)' if allow_none else ''}.")
    return value


def _dtype(key: str, value: Any) -> Any:
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value.removeprefix("torch.") if isinstance(value, str) else value)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
        raise ValueError(f"{key}={value!r}: {key} takes a floating dtype, jnp.float16, "
                         "jnp.bfloat16 or jnp.float32 (or their names, torch's 'torch.float16' "
                         "included), or None.")
    return dtype


def _num_losses(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"num_losses={value!r}: num_losses is the number of losses with their "
                         "own loss scale, an integer >= 1 (default 1: one scale for all).")
    return value


def _extras(mp: MixedPrecision, num_losses: int = 1, verbose: bool = False) -> MixedPrecision:
    """``mp`` with the loss scale's ``num_losses`` and ``verbose`` (where its kind reads it)."""
    from jamp.policy import mixed_precision  # noqa: PLC0415

    extras: dict[str, Any] = {}
    if _num_losses(num_losses) != 1:
        extras["num_losses"] = num_losses
    if mp.loss_scale.uses("verbose"):
        extras["verbose"] = bool(verbose)
    return mixed_precision(mp, **extras) if extras else mp


# --------------------------------------------------------------------------- the seeds


def from_torch(init_scale: float = 2.0**16, growth_factor: float = 2.0,
               backoff_factor: float = 0.5, growth_interval: int = 2000,
               enabled: bool = True) -> MixedPrecision:
    """torch.amp (``GradScaler``'s settings): jamp's ``fp16`` with that dynamic scale.

    ``enabled=False`` gives ``fp32``. The scale is clamped to jamp's ``fp16``
    range [1, 2**24] (torch's has no floor and no ceiling).

    Example:
      >>> from jamp.seed_keys import from_torch
      >>> mp = from_torch(init_scale=2.**10, growth_interval=100)
      >>> mp.name, mp.loss_scale.kind, mp.loss_scale.init_scale, mp.loss_scale.growth_interval
      ('fp16', 'dynamic', 1024.0, 100)
      >>> from_torch(enabled=False).name
      'fp32'
    """
    from jamp.policy import mixed_precision  # noqa: PLC0415

    if not _flag("enabled", enabled, allow_none=False):
        return mixed_precision("fp32")
    return mixed_precision(
        "fp16", init_scale=_number("init_scale", init_scale),
        growth_factor=_number("growth_factor", growth_factor),
        backoff_factor=_number("backoff_factor", backoff_factor),
        growth_interval=_number("growth_interval", growth_interval, integer=True))


def FP16TorchMixedPrecision(init_scale: float = 2.0**16, growth_factor: float = 2.0,  # noqa: N802
                            backoff_factor: float = 0.5, growth_interval: int = 2000
                            ) -> MixedPrecision:
    """Colossal-AI's ``FP16TorchMixedPrecision``: :func:`from_torch`'s recipe.

    Example:
      >>> from jamp.seed_keys import FP16TorchMixedPrecision
      >>> mixed_precision = FP16TorchMixedPrecision(
      ...     init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
      >>> mixed_precision.name, mixed_precision.loss_scale.growth_interval
      ('fp16', 2000)
    """
    return from_torch(init_scale, growth_factor, backoff_factor, growth_interval)


def from_apex(opt_level: str = "O1", *, enabled: bool = True, cast_model_type: Any = None,
              patch_torch_functions: bool | None = None,
              keep_batchnorm_fp32: bool | str | None = None, master_weights: bool | None = None,
              loss_scale: float | str | None = None, cast_model_outputs: Any = None,
              num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
              max_loss_scale: float = 2.0**24) -> MixedPrecision:
    """apex ``amp.initialize``'s options (and Colossal-AI's ``mode=AMP_TYPE.APEX``).

    ``opt_level`` picks the jamp mode (O0 ``fp32``, O1 ``fp16``, O2 ``fp16_naive``,
    O3 ``fp16_pure``); the other keys override its properties as in apex:
    ``cast_model_type`` the parameter dtype, ``cast_model_outputs`` the output
    dtype, ``keep_batchnorm_fp32`` whether norms run in float32 (False: in the
    compute dtype), ``master_weights`` fp32 master copies, ``loss_scale`` a
    number (static) or ``"dynamic"`` (apex's scaler: init 2**16, x2 every 2000
    finite steps, /2 on overflow, no hysteresis, clamped to
    [``min_loss_scale``, ``max_loss_scale``]; ``None`` min is :data:`NO_FLOOR`),
    ``num_losses`` / ``verbosity`` the loss scale's ``num_losses`` / ``verbose``.
    ``enabled=False`` gives ``fp32``. ``patch_torch_functions=True`` has no JAX
    meaning and is refused (``jamp.apply_policy`` / ``jamp.autocast`` do the casting).

    Raises:
      ValueError: an unknown ``opt_level`` or a value of the wrong type, naming the
        valid values.

    Example:
      >>> from jamp.seed_keys import from_apex
      >>> mp = from_apex("O2", loss_scale=128.0)
      >>> mp.name, str(mp.policy), mp.master_weights, mp.loss_scale.kind, mp.loss_scale.init_scale
      ('fp16_naive', 'p=f16,c=f16,o=full', True, 'static', 128.0)
      >>> from_apex("O1").loss_scale.min_scale == 2.0**-126
      True
    """
    from jamp.policy import mixed_precision  # noqa: PLC0415

    if opt_level not in OPT_LEVELS:
        raise ValueError(f"opt_level={opt_level!r} is not an apex optimization level: use "
                         f"'O0', 'O1', 'O2' or 'O3' (jamp: {OPT_LEVELS}).")
    if not _flag("enabled", enabled, allow_none=False):
        return mixed_precision("fp32")
    if _flag("patch_torch_functions", patch_torch_functions):
        raise ValueError(
            "patch_torch_functions=True has no meaning in JAX: jamp patches no functions. Casting "
            "comes from the policy instead: jamp.apply_policy(model, mp) for Flax modules and "
            "jamp.autocast(fn, mp) for any JAX function (opt_level='O1' is already f16 compute "
            "with f32 norms and softmax). Drop the key.")
    base = mixed_precision(OPT_LEVELS[opt_level])
    policy = base.policy
    params = _dtype("cast_model_type", cast_model_type)
    outputs = _dtype("cast_model_outputs", cast_model_outputs)
    policy = Policy(params if params is not None else policy.param_dtype, policy.compute_dtype,
                    outputs if outputs is not None else policy.output_dtype)
    keep = _flag("keep_batchnorm_fp32", keep_batchnorm_fp32)
    keep = _KEEP_NORMS_DEFAULT[opt_level] if keep is None else keep
    others = tuple((k, p) for k, p in base.overrides if k is not NORMS)
    overrides = others + (float32_overrides(policy) if keep and opt_level != "O0" else ())
    master = _flag("master_weights", master_weights)
    if isinstance(loss_scale, str) and loss_scale != "dynamic":
        raise ValueError(f"loss_scale={loss_scale!r}: apex's loss_scale is a number (a static "
                         "scale), 'dynamic' or None (the opt_level's: O0 and O3 static 1.0, O1 "
                         "and O2 dynamic).")
    if loss_scale is None:
        kind = base.loss_scale.kind
    else:
        kind = "dynamic" if loss_scale == "dynamic" else "static"
    if kind == "dynamic":
        floor = NO_FLOOR if min_loss_scale is None else _number("min_loss_scale", min_loss_scale)
        config = LossScaleConfig("dynamic", init_scale=2.0**16, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=2000, hysteresis=1,
                                 min_scale=floor,
                                 max_scale=_number("max_loss_scale", max_loss_scale))
    elif kind == "static" and loss_scale is not None:
        config = LossScaleConfig("static", init_scale=_number("loss_scale", loss_scale))
    else:
        config = base.loss_scale  # O0: none; O3: static 1.0
    mp = dataclasses.replace(base, policy=policy, overrides=overrides, loss_scale=config,
                             master_weights=base.master_weights if master is None else master)
    if not isinstance(verbosity, int) or isinstance(verbosity, bool):
        raise ValueError(f"verbosity={verbosity!r}: apex's verbosity is an integer (0: quiet, "
                         "1: report loss-scale changes).")
    return _extras(mp, num_losses, verbose=verbosity > 0)


def from_naive(log_num_zeros_in_grad: bool = False, initial_scale: float = 2.0**32,
               growth_factor: float = 2.0, backoff_factor: float = 0.5,
               growth_interval: int = 1000, hysteresis: int = 2, max_scale: float = 2.0**32,
               min_scale: float = 1.0, clip_grad: float = 0.0, verbose: bool = False
               ) -> MixedPrecision:
    """Colossal-AI's naive (tensor-parallel) AMP: jamp's ``fp16_naive`` with these settings.

    The defaults are Colossal-AI's (``FP16NaiveMixedPrecision``), not jamp's
    ``fp16_naive`` ones. ``clip_grad`` clips the unscaled gradients to that global
    norm (0: none); ``log_num_zeros_in_grad`` is read by the trainer.

    Example:
      >>> from jamp.seed_keys import from_naive
      >>> mp = from_naive(initial_scale=2**16, hysteresis=3, clip_grad=1.0)
      >>> mp.name, mp.loss_scale.init_scale, mp.loss_scale.hysteresis, mp.clip_grad_norm
      ('fp16_naive', 65536.0, 3, 1.0)
    """
    from jamp.policy import mixed_precision  # noqa: PLC0415

    mp = mixed_precision(
        "fp16_naive", init_scale=_number("initial_scale", initial_scale),
        growth_factor=_number("growth_factor", growth_factor),
        backoff_factor=_number("backoff_factor", backoff_factor),
        growth_interval=_number("growth_interval", growth_interval, integer=True),
        hysteresis=_number("hysteresis", hysteresis, integer=True),
        max_scale=_number("max_scale", max_scale), min_scale=_number("min_scale", min_scale),
        clip_grad_norm=_number("clip_grad", clip_grad),
        log_num_zeros_in_grad=_flag("log_num_zeros_in_grad", log_num_zeros_in_grad, False))
    return _extras(mp, verbose=_flag("verbose", verbose, False))


def _amp_type(mode: Any) -> AMP_TYPE:
    try:
        return AMP_TYPE(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        raise ValueError(
            f"mode={mode!r} is not a Colossal-AI AMP mode: use AMP_TYPE.TORCH, AMP_TYPE.APEX or "
            "AMP_TYPE.NAIVE (AMP_TYPE.PARALLEL is NAIVE; 'torch', 'apex', 'naive' work too), "
            "with `from jamp import AMP_TYPE`.") from None


def from_fp16_dict(fp16: Mapping[str, Any]) -> MixedPrecision:
    """A Colossal-AI ``fp16=dict(mode=AMP_TYPE..., ...)`` block as a recipe.

    ``mode=AMP_TYPE.TORCH`` goes to :func:`from_torch`, ``AMP_TYPE.APEX`` to
    :func:`from_apex`, ``AMP_TYPE.NAIVE`` (= ``PARALLEL``) to :func:`from_naive`.

    Raises:
      ValueError: no ``mode``, an unknown mode or a key the mode does not take,
        naming the mode's keys.

    Example:
      >>> from jamp import AMP_TYPE
      >>> from jamp.seed_keys import from_fp16_dict
      >>> from_fp16_dict(dict(mode=AMP_TYPE.APEX, opt_level="O3")).name
      'fp16_pure'
    """
    if not isinstance(fp16, Mapping):
        raise ValueError(f"fp16={fp16!r}: fp16 is a dict such as "
                         "dict(mode=AMP_TYPE.TORCH, init_scale=2.**16).")
    keys = dict(fp16)
    if "mode" not in keys:
        raise ValueError(f"fp16={keys!r} has no mode: add mode=AMP_TYPE.TORCH, AMP_TYPE.APEX or "
                         "AMP_TYPE.NAIVE (from jamp import AMP_TYPE).")
    mode = _amp_type(keys.pop("mode"))
    valid = _MODE_KEYS[mode]
    unknown = sorted(set(keys) - set(valid))
    if unknown:
        elsewhere = [f"{k} ({', '.join(m.name for m, d in _MODE_KEYS.items() if k in d)})"
                     for k in unknown if any(k in d for d in _MODE_KEYS.values())]
        hint = f" Keys of other modes: {', '.join(elsewhere)}." if elsewhere else ""
        raise ValueError(f"fp16=dict(mode=AMP_TYPE.{mode.name}, ...) does not take "
                         f"{', '.join(unknown)}: its keys are {', '.join(valid)}.{hint}")
    builder = {AMP_TYPE.TORCH: from_torch, AMP_TYPE.APEX: from_apex,
               AMP_TYPE.NAIVE: from_naive}[mode]
    return builder(**keys)


def _is_tpu() -> bool:
    return jax.default_backend() == "tpu"


def from_lightning(precision: int | str | None = None, amp_backend: str | None = None,
                   amp_level: str | None = None) -> MixedPrecision:
    """Lightning ``Trainer(precision=..., amp_backend=..., amp_level=...)`` as a recipe.

    ``precision=16`` (or ``"16"``, ``"16-mixed"``) is ``fp16`` (torch amp), bfloat16
    on a TPU as in Lightning; ``32`` is ``fp32``; ``"bf16"`` is ``bf16``; the 2.x
    names (``"bf16-true"``, ...) are jamp aliases. ``amp_backend="apex"`` is apex
    at ``amp_level`` (Lightning's default ``"O2"``) with ``precision`` 16 (the
    default when a backend is named); ``amp_backend="native"`` is torch amp.
    ``precision=64`` is refused: jamp has no float64 mode.

    Example:
      >>> from jamp.seed_keys import from_lightning
      >>> from_lightning(16).name, from_lightning("bf16").name
      ('fp16', 'bf16')
      >>> mp = from_lightning(amp_backend="apex", amp_level="O2")
      >>> mp.name, mp.loss_scale.hysteresis
      ('fp16_naive', 1)
    """
    from jamp.policy import MODE_ALIASES, mixed_precision  # noqa: PLC0415

    if amp_backend not in (None, "native", "apex"):
        raise ValueError(f"amp_backend={amp_backend!r}: use 'native' (torch amp) or 'apex'.")
    if amp_level is not None and amp_backend != "apex":
        raise ValueError(f"amp_level={amp_level!r} goes with amp_backend='apex' only (Lightning "
                         "refuses it too); drop it or add amp_backend='apex'.")
    if isinstance(precision, bool) or not isinstance(precision, int | str | None):
        raise ValueError(f"precision={precision!r}: use 16, 32, 'bf16' or a Lightning 2 name "
                         "such as '16-mixed'.")
    text = None if precision is None else str(precision).strip()
    if text in ("64", "64-true"):
        raise ValueError(
            f"precision={precision!r}: jamp has no float64 mode (its modes train in float32 "
            "or lower). Use precision=32 (fp32), 16 or 'bf16'; for float64 math enable "
            "jax_enable_x64 and apply jamp.get_policy('f64') yourself.")
    half = text in ("16", "16-mixed")
    if amp_backend == "apex":
        if text in (None, "16", "16-mixed"):
            return from_apex(amp_level or "O2")
        if text in ("32", "32-true"):
            return mixed_precision("fp32")  # Lightning: AMP off at 32
        raise ValueError(f"precision={precision!r} with amp_backend='apex': apex does fp16 only; "
                         "use precision=16 (or 32 for no AMP).")
    if text is None:
        text = "32"
    if half:
        return mixed_precision("bf16" if _is_tpu() else "fp16")
    if text not in MODE_ALIASES or not any(c.isdigit() for c in text[:2]) and text != "bf16":
        raise ValueError(f"precision={precision!r} is not a Lightning precision: use 16, 32, "
                         "'bf16', '16-mixed', 'bf16-mixed', '32-true', '16-true' or "
                         "'bf16-true'.")
    return mixed_precision(text)


# --------------------------------------------------------------------------- jamp.mixed_precision


def is_seed_call(name: Any, keys: Mapping[str, Any]) -> bool:
    """Whether ``jamp.mixed_precision(name, **keys)`` is spelt in a seed's vocabulary.

    Example:
      >>> from jamp.seed_keys import is_seed_call
      >>> is_seed_call(16, {}), is_seed_call("fp16", {"init_scale": 2.0})
      (True, False)
      >>> is_seed_call(None, {"opt_level": "O2"})
      True
    """
    if name is None or isinstance(name, Mapping | AMP_TYPE):
        return True
    if isinstance(name, int) and not isinstance(name, bool):
        return True
    if isinstance(name, str) and name.strip() in ("fp16_apex", "64", "64-true"):
        return True
    seed_only = {"mode", *LIGHTNING_KEYS, *_APEX_ONLY, *_NAIVE_RENAMES}
    if seed_only & set(keys):
        return True
    scale = keys.get("loss_scale")
    return isinstance(scale, int | float) and not isinstance(scale, bool)


def translate(name: Any = None, **keys: Any) -> MixedPrecision:
    """``jamp.mixed_precision(name, **keys)`` for the seed forms (:func:`is_seed_call`).

    - a dict, an ``AMP_TYPE`` or ``mode=``: :func:`from_fp16_dict` (that mode's keys only);
    - an int precision, ``"64"``, ``precision=``/``amp_backend=``/``amp_level=``:
      :func:`from_lightning`;
    - ``"fp16_apex"``, an ``opt_level`` name or key, an apex-only key or a numeric
      ``loss_scale``: :func:`from_apex`;
    - ``initial_scale``/``clip_grad``: Colossal-AI naive names of jamp's
      ``init_scale``/``clip_grad_norm`` (the mode defaults to ``fp16_naive``).

    Other keys are jamp's (:func:`jamp.mixed_precision`) and apply afterwards.

    Example:
      >>> from jamp.seed_keys import translate
      >>> translate("O1", keep_batchnorm_fp32=False).overrides
      ()
    """
    from jamp.policy import mixed_precision  # noqa: PLC0415

    if isinstance(name, Mapping):
        return from_fp16_dict({**name, **keys})
    if isinstance(name, AMP_TYPE) or "mode" in keys:
        if name is not None and "mode" in keys:
            raise ValueError(f"mixed_precision({name!r}, mode=...): give the mode once.")
        mode = name if name is not None else keys.pop("mode")
        return from_fp16_dict({"mode": mode, **keys})
    lightning = {k: keys.pop(k) for k in LIGHTNING_KEYS if k in keys}
    text = name.strip() if isinstance(name, str) else None
    if (isinstance(name, int) and not isinstance(name, bool)) or lightning or text in (
            "64", "64-true"):
        if name is not None and "precision" in lightning:
            raise ValueError(f"mixed_precision({name!r}, precision=...): give the precision once.")
        precision = lightning.pop("precision", name)
        return _jamp_keys(from_lightning(precision, **lightning), keys)
    apex = {k: keys.pop(k) for k in list(keys) if k in _APEX_ONLY}
    scale = keys.get("loss_scale")
    if isinstance(scale, int | float) and not isinstance(scale, bool) or (
            apex and scale == "dynamic"):
        apex["loss_scale"] = keys.pop("loss_scale")
    if apex or text == "fp16_apex" or text in OPT_LEVELS and "opt_level" in apex:
        level = apex.pop("opt_level", None)
        if text in OPT_LEVELS:
            if level not in (None, text):
                raise ValueError(f"mixed_precision({name!r}, opt_level={level!r}): two levels.")
            level = text
        elif text not in (None, "fp16_apex"):
            raise ValueError(
                f"mixed_precision({name!r}, {', '.join(apex)}=...): apex keys go with an apex "
                "opt_level ('O0'..'O3', e.g. mixed_precision('O2', keep_batchnorm_fp32=False)) "
                f"or 'fp16_apex'; for mode {name!r} use jamp's fields (policy=, overrides=, "
                "master_weights=, init_scale=, ...).")
        for key in ("master_weights", "num_losses"):
            if key in keys:
                apex[key] = keys.pop(key)
        return _jamp_keys(from_apex(level or "O1", **apex), keys)
    for seed, jamp_key in _NAIVE_RENAMES.items():
        if seed in keys:
            if jamp_key in keys:
                raise ValueError(f"{seed} and {jamp_key} are the same setting: give one.")
            keys[jamp_key] = keys.pop(seed)
    if name is None and "init_scale" in keys or "clip_grad_norm" in keys and name is None:
        name = "fp16_naive"
    if name is None:
        raise ValueError(
            "jamp.mixed_precision needs a mode: a name ('fp16', 'bf16', 'O2', 'fp16_apex', ...), "
            "a Lightning precision (16, 32, 'bf16'), a Colossal-AI fp16 dict "
            "(dict(mode=AMP_TYPE.TORCH, ...)) or apex keys (opt_level='O1', ...).")
    return mixed_precision(name, **keys)


def _jamp_keys(mp: MixedPrecision, keys: dict[str, Any]) -> MixedPrecision:
    from jamp.policy import mixed_precision  # noqa: PLC0415

    seed = sorted(set(keys) & {"mode", *LIGHTNING_KEYS, *_APEX_ONLY, *_NAIVE_RENAMES})
    if seed:
        raise ValueError(f"{', '.join(seed)}: these keys belong to another library's form; "
                         "give a Lightning, apex or Colossal-AI form alone.")
    return mixed_precision(mp, **keys) if keys else mp


# --------------------------------------------------------------------------- trainer configs

CONFIG_KEY_ALIASES: dict[str, str] = {"gradient_accumulation": "grad_accum_steps",
                                      "clip_grad_norm": "grad_clip_norm"}
"""``--config.KEY`` spellings of Colossal-AI -> jamp.train's config keys."""

UPPER_KEYS: dict[str, str] = {
    "BATCH_SIZE": "batch_size", "LEARNING_RATE": "learning_rate", "LR": "learning_rate",
    "WEIGHT_DECAY": "weight_decay", "NUM_EPOCHS": "num_epochs",
    "WARMUP_EPOCHS": "warmup_steps", "WARMUP_STEPS": "warmup_steps",
    "IMG_SIZE": "image_size", "PATCH_SIZE": "patch_size", "HIDDEN_SIZE": "hidden_size",
    "DEPTH": "num_layers", "NUM_HEADS": "num_heads", "MLP_RATIO": "mlp_dim",
    "DROP_RATE": "dropout_rate", "NUM_MICRO_BATCHES": "pipeline_microbatches", "SEED": "seed",
    "TENSOR_PARALLEL_SIZE": "mesh.model", "TENSOR_PARALLEL_MODE": "(parallel's tensor mode)",
}
"""The upper-case hyper-parameters of a Colossal-AI config -> jamp.train's config keys
(``WARMUP_EPOCHS`` x steps per epoch, ``MLP_RATIO`` x ``HIDDEN_SIZE``)."""


def _has_get_config(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return any(isinstance(n, ast.FunctionDef) and n.name == "get_config" for n in tree.body)


def is_colossalai_file(path: str) -> bool:
    """Whether ``path`` is a Python config file without ``get_config`` (Colossal-AI style).

    Example:
      >>> import jamp.configs, os
      >>> is_colossalai_file(jamp.configs.resolve("vit_fp16"))
      False
    """
    if not (path.endswith(".py") and os.path.isfile(path)):
        return False
    try:
        return not _has_get_config(path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False


def get_config(path: str) -> Any:
    """absl's entry point: ``--config <this file>:<a Colossal-AI config file>``.

    ``jamp.train`` points ``--config`` here for a config file without
    ``get_config``; see :func:`config_from_file`.

    Example:
      >>> import os, tempfile
      >>> path = os.path.join(tempfile.mkdtemp(), "c.py")
      >>> _ = open(path, "w").write("BATCH_SIZE = 32\\n")
      >>> get_config(path).batch_size
      32
    """
    import jamp.seed_keys as this  # noqa: PLC0415  (absl loads this file as another module)

    return this.config_from_file(path)


def config_from_file(path: str) -> Any:
    """A Colossal-AI-style config file (module-level values) as jamp.train's config.

    Example:
      >>> import os, tempfile
      >>> path = os.path.join(tempfile.mkdtemp(), "c.py")
      >>> text = "from jamp import AMP_TYPE\\nfp16 = dict(mode=AMP_TYPE.TORCH)\\n"
      >>> _ = open(path, "w").write(text)
      >>> config_from_file(path).mode
      'fp16'
    """
    values = runpy.run_path(path)
    source = os.path.basename(path)
    try:
        return config_from_values(values, source=source)
    except ValueError as e:
        if str(e).startswith(f"{source}: "):
            raise
        raise ValueError(f"{source}: {e}") from None


def _parallel(value: Any, upper: Mapping[str, Any]) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise ValueError(f"parallel={value!r}: parallel is a dict such as "
                         "dict(pipeline=2, tensor=dict(size=2, mode='1d')).")
    unknown = sorted(set(value) - {"pipeline", "tensor", "data"})
    if unknown:
        raise ValueError(f"parallel does not take {', '.join(unknown)}: its keys are pipeline, "
                         "tensor (dict(size=..., mode='1d')) and data.")
    out: dict[str, int] = {}
    pipe = value.get("pipeline", 1)
    pipe = pipe.get("size", 1) if isinstance(pipe, Mapping) else pipe
    out["mesh.pipe"] = _number("parallel pipeline", pipe, integer=True)
    tensor = value.get("tensor", 1)
    tensor = tensor if isinstance(tensor, Mapping) else dict(size=tensor)
    size = _number("parallel tensor size", tensor.get("size", 1), integer=True)
    mode = tensor.get("mode", "1d" if size > 1 else None)
    if size > 1 and mode != "1d":
        raise ValueError(f"parallel tensor mode={mode!r}: jamp's tensor parallelism is "
                         "Megatron's, Colossal-AI's '1d'; '2d', '2.5d', '3d' and 'sequence' have "
                         "no jamp equivalent.")
    for key, got in (("TENSOR_PARALLEL_SIZE", size), ("TENSOR_PARALLEL_MODE", mode)):
        if key in upper and upper[key] != got and size > 1:
            raise ValueError(f"{key}={upper[key]!r} disagrees with parallel's tensor {got!r}.")
    out["mesh.model"] = size
    if "data" in value:
        out["mesh.data"] = _number("parallel data", value["data"], integer=True)
    return out


def config_from_values(values: Mapping[str, Any], source: str = "the config") -> Any:
    """Module-level values of a Colossal-AI config as jamp.train's locked config.

    ``fp16`` gives the mode and the loss scale (none: ``fp32``);
    ``gradient_accumulation`` is ``grad_accum_steps``; ``clip_grad_norm`` (or the
    naive dict's ``clip_grad``) is ``grad_clip_norm``, 0 when absent (no
    clipping, as in Colossal-AI); ``parallel`` gives ``mesh.pipe``/``mesh.model``;
    the upper-case names of :data:`UPPER_KEYS` their fields; a lower-case name
    of a jamp.train field (``dataset``, ``max_steps``, ...) is that field.

    Raises:
      ValueError: a name jamp cannot map, or an fp16 setting the trainer's config
        cannot express, listing what is accepted.

    Example:
      >>> from jamp import AMP_TYPE
      >>> c = config_from_values(dict(BATCH_SIZE=32, gradient_accumulation=4,
      ...                             fp16=dict(mode=AMP_TYPE.NAIVE)))
      >>> c.mode, c.batch_size, c.grad_accum_steps, c.loss_scale.init_scale, c.grad_clip_norm
      ('fp16_naive', 32, 4, 4294967296.0, 0.0)
    """
    from jamp.config import FIELDS, vit_config  # noqa: PLC0415
    from jamp.experiment import precision_from_config  # noqa: PLC0415

    values = {k: v for k, v in values.items() if not k.startswith("_") and not isinstance(
        v, types.ModuleType | types.FunctionType | type)}
    upper = {k: v for k, v in values.items() if k.isupper()}
    lower = {k: v for k, v in values.items() if not k.isupper()}
    top = {k for k in FIELDS if "." not in k}
    colossal = {"fp16", "gradient_accumulation", "clip_grad_norm", "parallel"}
    bad = sorted(set(upper) - set(UPPER_KEYS)) + sorted(set(lower) - top - colossal)
    if bad:
        raise ValueError(
            f"{source}: jamp cannot map {', '.join(bad)}. A Colossal-AI-style config takes "
            f"fp16=dict(mode=AMP_TYPE...), gradient_accumulation, clip_grad_norm, parallel, the "
            f"upper-case names {', '.join(UPPER_KEYS)}, and jamp.train's own field names "
            "(jamp.train --help lists them).")
    if "fp16" in lower and "mode" in lower:
        raise ValueError(f"{source}: fp16=dict(...) and mode= both set the mode; give one.")
    mp = from_fp16_dict(lower.pop("fp16")) if "fp16" in lower else None
    from jamp.policy import mixed_precision  # noqa: PLC0415

    mp = mp or mixed_precision(lower.pop("mode", "fp32"))
    settings: dict[str, Any] = {"grad_clip_norm": 0.0}
    if mp.clip_grad_norm:
        settings["grad_clip_norm"] = mp.clip_grad_norm
    if "clip_grad_norm" in lower:
        clip = _number("clip_grad_norm", lower.pop("clip_grad_norm"))
        if mp.clip_grad_norm and clip != mp.clip_grad_norm:
            raise ValueError(f"{source}: clip_grad_norm={clip} and fp16's clip_grad="
                             f"{mp.clip_grad_norm} disagree; give one.")
        settings["grad_clip_norm"] = clip
    if "gradient_accumulation" in lower:
        settings["grad_accum_steps"] = lower.pop("gradient_accumulation")
    if "parallel" in lower:
        settings.update(_parallel(lower.pop("parallel"), upper))
    if mp.loss_scale.num_losses != 1:
        raise ValueError(f"{source}: num_losses={mp.loss_scale.num_losses}: jamp.train has one "
                         "loss, so one loss scale; drop num_losses (or use jamp.scale_loss(..., "
                         "loss_id=i) in your own loop).")
    settings["log_num_zeros_in_grad"] = mp.log_num_zeros_in_grad
    for key, value in upper.items():
        field = UPPER_KEYS[key]
        if key in ("WARMUP_EPOCHS", "MLP_RATIO", "TENSOR_PARALLEL_SIZE", "TENSOR_PARALLEL_MODE"):
            continue
        settings[field] = value
    settings.update(lower)
    if "MLP_RATIO" in upper:
        if "HIDDEN_SIZE" not in upper:
            raise ValueError(f"{source}: MLP_RATIO needs HIDDEN_SIZE (mlp_dim = MLP_RATIO x "
                             "HIDDEN_SIZE).")
        settings["mlp_dim"] = int(upper["MLP_RATIO"] * upper["HIDDEN_SIZE"])
    if "TENSOR_PARALLEL_SIZE" in upper and "mesh.model" not in settings:
        settings["mesh.model"] = upper["TENSOR_PARALLEL_SIZE"]
    config = vit_config(mp.name)
    config.unlock()
    for key, value in settings.items():
        _set(config, key, value, source)
    kind = mp.loss_scale.kind
    if kind != config_kind(config):
        config.loss_scale.kind = kind
    reference = LossScaleConfig(kind)
    for f in dataclasses.fields(LossScaleConfig):
        if f.name in ("kind", "num_losses", "verbose") or not reference.uses(f.name):
            continue
        value = getattr(mp.loss_scale, f.name)
        if f"loss_scale.{f.name}" in FIELDS:
            _set(config, f"loss_scale.{f.name}", value, source)
    if "WARMUP_EPOCHS" in upper:
        from jamp import data  # noqa: PLC0415

        try:
            info = data.get_dataset_info(config.dataset, config.data_dir)
        except Exception as e:  # noqa: BLE001  (any reason: the message says which)
            raise ValueError(f"{source}: WARMUP_EPOCHS needs the dataset's size: {e}") from None
        steps = data.steps_per_epoch(info, config.batch_size) * upper["WARMUP_EPOCHS"]
        _set(config, "warmup_steps", int(steps), source)
    config.lock()
    _same_precision(precision_from_config(config), mp, source)
    return config


def config_kind(config: Any) -> str:
    """The loss-scale kind a jamp.train config's mode gives (before overrides).

    Example:
      >>> from jamp.config import vit_config
      >>> config_kind(vit_config("bf16"))
      'none'
    """
    from jamp.policy import mixed_precision  # noqa: PLC0415

    return config.loss_scale.kind or mixed_precision(config.mode).loss_scale.kind


def _set(config: Any, key: str, value: Any, source: str) -> None:
    *parents, leaf = key.split(".")
    node = config
    try:
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{source}: {key}={value!r} is not valid for jamp.train's {key}: "
                         f"{e}".replace("\n", " ")) from None


def _same_precision(got: MixedPrecision, want: MixedPrecision, source: str) -> None:
    neutral = dict(clip_grad_norm=0.0, log_num_zeros_in_grad=False)
    # The trainer shows scale changes in its progress bar: verbose is not a difference.
    want_ls = dataclasses.replace(want.loss_scale, verbose=got.loss_scale.verbose)
    a = dataclasses.replace(got, **neutral)
    b = dataclasses.replace(want, loss_scale=want_ls, **neutral)
    if a != b:
        diff = [f.name for f in dataclasses.fields(MixedPrecision)
                if getattr(a, f.name) != getattr(b, f.name)]
        raise ValueError(
            f"{source}: its fp16 setting changes {', '.join(diff)} of mode {want.name!r}, which "
            "jamp.train's config cannot express (it has mode and loss_scale.* fields). Use a "
            "plain opt_level, or the Python API: jamp.seed_keys.from_fp16_dict(...) with "
            "jamp.apply_policy and jamp.make_optimizer.")


def cli_alias(arg: str) -> str:
    """A ``--config.KEY[=VALUE]`` argument with a Colossal-AI key spelt jamp's way.

    Example:
      >>> cli_alias("--config.gradient_accumulation=4")
      '--config.grad_accum_steps=4'
    """
    for seed, key in CONFIG_KEY_ALIASES.items():
        for dashes in ("--", "-"):
            prefix = f"{dashes}config.{seed}"
            if arg == prefix or arg.startswith(prefix + "="):
                return f"{dashes}config.{key}{arg[len(prefix):]}"
    return arg
