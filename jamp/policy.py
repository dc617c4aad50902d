"""Precision policies and named mixed-precision modes.

A :class:`Policy` says in which dtype parameters are stored, in which dtype a
module computes, and in which dtype it returns its output. jamp reuses
``jmp.Policy`` as is; :func:`get_policy` accepts jmp's string grammar and gives
errors that list what is valid.

:func:`mixed_precision` turns a mode name ("fp16", "bf16", "O2", "16-mixed", ...)
into a :class:`MixedPrecision` recipe: the policy, the per-module-class
overrides, the loss-scaling recipe and whether fp32 master weights are kept.

Example:
  >>> import jamp
  >>> mp = jamp.mixed_precision("fp16")
  >>> str(mp.policy)
  'p=full,c=f16,o=full'
  >>> mp.loss_scale.kind, mp.loss_scale.init_scale
  ('dynamic', 65536.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import jmp
from flax import nnx

from jamp.loss_scale import LossScaleConfig

Policy = jmp.Policy
"""``jmp.Policy``: a frozen dataclass ``(param_dtype, compute_dtype, output_dtype)``."""

Overrides = tuple[tuple[type, Policy], ...]

_KEYS = ("params", "compute", "output")
_KEY_ALIASES = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
                "o": "output", "output": "output"}


_DTYPE_NAMES = ("bf16", "bfloat16", "f16", "float16", "f32", "float32", "f64", "float64",
                "full", "half")
"""The dtype names of jmp's grammar, for error messages (jmp's parser is the authority)."""


def _is_dtype_name(name: str) -> bool:
    try:
        jmp.get_policy(name)
    except ValueError:
        return False
    return True


def _policy_error(spec: object, problem: str) -> ValueError:
    return ValueError(
        f"Invalid precision policy {spec!r}: {problem}. A policy is either one dtype name "
        f"for everything (e.g. 'bf16') or comma-separated key=dtype pairs, e.g. "
        f"'params=float32,compute=float16,output=float32' or 'p=full,c=bf16,o=full'. "
        f"Valid keys: {', '.join(_KEYS)} (or p, c, o). Valid dtype names: "
        f"{', '.join(_DTYPE_NAMES)}. 'half' means float16 on GPU/CPU and bfloat16 on "
        f"TPU, resolved from the first local device when the policy is parsed."
    )


def get_policy(spec: str | Policy) -> Policy:
    """Returns a :class:`Policy` from jmp's string grammar or an existing policy.

    The grammar is jmp's: a single dtype name sets all three dtypes
    (``"bf16"``, ``"f32"``, ``"half"``); ``key=dtype`` pairs set some of them,
    with params defaulting to float32, compute following params and output
    following compute (``"c=f16"`` is ``p=f32,c=f16,o=f16``). ``"half"`` is
    resolved *when the policy is parsed*, from the first local device: bfloat16
    on TPU, float16 elsewhere.

    Args:
      spec: a policy string or a ``Policy`` (returned unchanged).

    Returns:
      The parsed ``jmp.Policy``.

    Raises:
      ValueError: for anything else, listing the valid keys and dtype names.

    Example:
      >>> import jamp
      >>> str(jamp.get_policy("params=float32,compute=bfloat16,output=float32"))
      'p=full,c=bf16,o=full'
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise _policy_error(spec, f"expected a string or jamp.Policy, got {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise _policy_error(spec, "it is empty")
    if "=" in text:
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or "=" in value:
                raise _policy_error(spec, f"{part.strip()!r} is not of the form key=dtype")
            if key.strip() not in _KEY_ALIASES:
                raise _policy_error(spec, f"unknown key {key.strip()!r}")
            if not _is_dtype_name(value.strip()):
                raise _policy_error(spec, f"unknown dtype {value.strip()!r}")
        text = ",".join(p.strip().replace(" ", "") for p in text.split(","))
    elif not _is_dtype_name(text):
        raise _policy_error(spec, f"unknown dtype {text!r}")
    return jmp.get_policy(text)


def _norm_classes() -> tuple[type, ...]:
    return (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm,
            nnx.LayerNorm, nnx.BatchNorm, nnx.GroupNorm, nnx.RMSNorm)


def float32_overrides(policy: Policy) -> Overrides:
    """Overrides that run normalisation layers in float32 and return compute dtype.

    Args:
      policy: the model-wide policy; its compute dtype is what the norms return.

    Returns:
      A tuple of ``(module class, Policy)`` pairs for LayerNorm, BatchNorm,
      GroupNorm and RMSNorm, linen's and NNX's.

    Example:
      >>> import jamp
      >>> ov = jamp.float32_overrides(jamp.get_policy("p=f32,c=f16,o=f32"))
      >>> str(dict(ov)[nn.LayerNorm])
      'p=full,c=full,o=f16'
    """
    norm = Policy(jnp.float32, jnp.float32, policy.compute_dtype)
    return tuple((cls, norm) for cls in _norm_classes())


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A named mixed-precision recipe: everything a mode decides.

    Attributes:
      name: canonical mode name ("fp32", "fp16", "bf16", ...).
      policy: model-wide param/compute/output dtypes.
      overrides: ``(module class, Policy)`` pairs; a module uses the policy of the
        first class in its MRO that has one (so subclasses follow their parent).
      softmax_fp32: compute attention softmax in float32.
      loss_scale: a :class:`~jamp.loss_scale.LossScaleConfig`: the kind ("none",
        "static" or "dynamic") and every scaling setting, ``divergence_steps``
        included.
      master_weights: keep fp32 master copies of half-precision params in the
        optimizer state (apex O2 / Colossal-AI naive AMP).

    Example:
      >>> import jamp
      >>> mp = jamp.mixed_precision("O2", hysteresis=1)
      >>> mp.name, mp.master_weights, mp.loss_scale.hysteresis
      ('fp16_naive', True, 1)
    """

    name: str
    policy: Policy
    overrides: Overrides = ()
    softmax_fp32: bool = False
    loss_scale: LossScaleConfig = LossScaleConfig()
    master_weights: bool = False

    def __post_init__(self):
        if isinstance(self.loss_scale, str):  # a kind with its default settings
            object.__setattr__(self, "loss_scale", LossScaleConfig(self.loss_scale))
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ValueError(
                f"loss_scale must be a jamp.LossScaleConfig or one of 'none', 'static', "
                f"'dynamic', got {self.loss_scale!r}.")
        object.__setattr__(self, "policy", get_policy(self.policy))
        if isinstance(self.overrides, Mapping):
            object.__setattr__(self, "overrides", tuple(self.overrides.items()))
        overrides = tuple((cls, get_policy(p)) for cls, p in self.overrides)
        for cls, _ in overrides:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module | nnx.Module)):
                raise ValueError(
                    f"overrides keys must be flax.linen.Module or flax.nnx.Module subclasses, "
                    f"got {cls!r}."
                )
        object.__setattr__(self, "overrides", overrides)

    def policy_for(self, module_cls: type) -> Policy:
        """Returns the policy a module of ``module_cls`` runs under.

        Example:
          >>> import jamp, flax.linen as nn
          >>> str(jamp.mixed_precision("fp16").policy_for(nn.Dense))
          'p=full,c=f16,o=full'
        """
        table = dict(self.overrides)
        for klass in module_cls.__mro__:
            if klass in table:
                return table[klass]
        return self.policy


def _mode_table() -> dict[str, dict[str, Any]]:
    f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
    mixed16 = Policy(f32, f16, f32)
    mixedbf = Policy(f32, bf16, f32)
    naive = Policy(f16, f16, f32)
    return {
        "fp32": dict(policy=Policy(f32, f32, f32)),
        "fp16": dict(policy=mixed16, overrides=float32_overrides(mixed16), softmax_fp32=True,
                     loss_scale=LossScaleConfig("dynamic")),
        "bf16": dict(policy=mixedbf, overrides=float32_overrides(mixedbf), softmax_fp32=True),
        "fp16_naive": dict(policy=naive, overrides=float32_overrides(naive), softmax_fp32=True,
                           master_weights=True,
                           loss_scale=LossScaleConfig("dynamic", hysteresis=2)),
        "fp16_pure": dict(policy=Policy(f16, f16, f16),
                          loss_scale=LossScaleConfig("static", init_scale=1.0)),
        "bf16_pure": dict(policy=Policy(bf16, bf16, bf16)),
    }


MODE_ALIASES: dict[str, str] = {
    "fp32": "fp32", "32": "fp32", "32-true": "fp32", "O0": "fp32",
    "fp16": "fp16", "16": "fp16", "16-mixed": "fp16", "O1": "fp16", "torch": "fp16",
    "amp": "fp16",
    "bf16": "bf16", "bf16-mixed": "bf16",
    "fp16_naive": "fp16_naive", "O2": "fp16_naive", "naive": "fp16_naive",
    "fp16_pure": "fp16_pure", "O3": "fp16_pure", "16-true": "fp16_pure",
    "bf16_pure": "bf16_pure", "bf16-true": "bf16_pure",
}
"""Every accepted mode name (Lightning, apex and Colossal-AI spellings) -> canonical name."""

MODES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp16_naive", "fp16_pure", "bf16_pure")
"""The canonical mode names."""


def mixed_precision(name: str | MixedPrecision, **overrides: Any) -> MixedPrecision:
    """Returns the :class:`MixedPrecision` recipe for a named mode.

    Modes (aliases in brackets):
      - ``fp32`` ("32", "32-true", "O0"): everything float32, no loss scaling.
      - ``fp16`` ("16", "16-mixed", "O1", "amp", "torch"): params f32, compute f16,
        output f32; norms and softmax in f32; dynamic loss scaling (init 2**16,
        growth 2, backoff 0.5, interval 2000).
      - ``bf16`` ("bf16-mixed"): params f32, compute bf16, output f32; norms and
        softmax in f32; no loss scaling.
      - ``fp16_naive`` ("O2", "naive"): params held in f16 for forward and
        backward, fp32 master weights in the optimizer, norms f32, dynamic
        scaling with hysteresis 2 (Colossal-AI's naive AMP).
      - ``fp16_pure`` ("O3", "16-true"): everything f16, static scale 1.0.
        Unsafe: small gradients underflow and updates below f16 resolution are
        lost; for speed baselines only.
      - ``bf16_pure`` ("bf16-true"): everything bf16 (TPU-style pure bf16).

    Args:
      name: a mode name or alias, or an existing ``MixedPrecision``.
      **overrides: replace individual fields, e.g. ``policy="p=f32,c=bf16,o=f32"``,
        ``master_weights=True``; and the loss-scale settings by name
        (``init_scale=2**15``, ``hysteresis=1``, ``divergence_steps=20``, ...), or
        ``loss_scale="dynamic"`` / a whole ``LossScaleConfig``.

    Returns:
      A frozen ``MixedPrecision``.

    Raises:
      ValueError: for an unknown mode name or field, or a loss-scale setting the
        mode's kind of scaling does not use (``hysteresis`` for ``bf16``), naming
        the mode.

    Example:
      >>> import jamp
      >>> jamp.mixed_precision("16-mixed", init_scale=2**15).loss_scale.init_scale
      32768
    """
    if isinstance(name, MixedPrecision):
        base = name
    else:
        canonical = MODE_ALIASES.get(str(name).strip()) if isinstance(name, str) else None
        if canonical is None:
            raise ValueError(
                f"Unknown mixed-precision mode {name!r}. Valid modes: {', '.join(MODES)}; "
                f"aliases: {', '.join(k for k in MODE_ALIASES if k not in MODES)}."
            )
        base = MixedPrecision(name=canonical, **_mode_table()[canonical])
    fields = {f.name for f in dataclasses.fields(MixedPrecision)} - {"name"}
    scaling = {f.name for f in dataclasses.fields(LossScaleConfig)} - {"kind"}
    unknown = sorted(set(overrides) - fields - scaling)
    if unknown:
        raise ValueError(
            f"Unknown field(s) {', '.join(unknown)} for mixed_precision({base.name!r}). "
            f"Valid fields: {', '.join(sorted(fields | scaling))}."
        )
    if "policy" in overrides and "overrides" not in overrides and base.overrides:
        # Norms return the compute dtype: follow a replaced policy.
        overrides["overrides"] = float32_overrides(get_policy(overrides["policy"]))
    settings = {k: overrides.pop(k) for k in sorted(scaling & set(overrides))}
    config = overrides.pop("loss_scale", base.loss_scale)
    if isinstance(config, str):
        config = dataclasses.replace(base.loss_scale, kind=config)
    unused = [k for k in settings if not config.uses(k)]
    if unused:
        raise ValueError(
            f"mixed_precision({base.name!r}): {', '.join(unused)} does not apply, because mode "
            f"{base.name!r} uses loss scaling of kind {config.kind!r}, which reads "
            f"{', '.join(f for f in _scaling_fields() if config.uses(f)) or 'no setting'}. "
            "Drop the setting, use a mode with dynamic scaling ('fp16', 'fp16_naive'), or "
            "choose the kind: loss_scale='dynamic' (jamp.train: --config.loss_scale.kind)."
        )
    overrides["loss_scale"] = dataclasses.replace(config, **settings)
    return dataclasses.replace(base, **overrides)


def _scaling_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(LossScaleConfig) if f.name != "kind"]


PolicyLike = str | Policy | MixedPrecision


def to_mixed_precision(
    policy_or_mode: PolicyLike, overrides: Mapping[type, Any] | None = None
) -> MixedPrecision:
    """Normalises a mode name, policy string, ``Policy`` or ``MixedPrecision``.

    A mode name ("fp16", "O2", ...) gives that mode with its default overrides.
    A policy (``Policy`` or jmp-style string such as ``"p=f32,c=f16,o=f32"``)
    gives a recipe with that policy and no overrides. ``overrides``, when given,
    maps module classes to policies (or policy strings) and replaces the
    recipe's overrides.

    Example:
      >>> import jamp
      >>> jamp.to_mixed_precision("p=f32,c=bf16,o=f32").overrides
      ()
    """
    if isinstance(policy_or_mode, MixedPrecision):
        mp = policy_or_mode
    elif isinstance(policy_or_mode, Policy):
        mp = MixedPrecision(name="custom", policy=policy_or_mode)
    elif isinstance(policy_or_mode, str):
        try:
            mp = mixed_precision(policy_or_mode)
        except ValueError as mode_error:
            try:
                mp = MixedPrecision(name="custom", policy=get_policy(policy_or_mode))
            except ValueError as policy_error:
                raise ValueError(
                    f"{policy_or_mode!r} is neither a mode nor a policy.\n"
                    f"As a mode: {mode_error}\nAs a policy: {policy_error}"
                ) from None
    else:
        raise TypeError(
            "Expected a mode name, a policy string, a jamp.Policy or a jamp.MixedPrecision, "
            f"got {type(policy_or_mode).__name__}."
        )
    if overrides is not None:
        mp = dataclasses.replace(mp, overrides=tuple(overrides.items()))
    return mp
