"""Precision policies and named mixed-precision modes.

A :class:`Policy` says in which dtype parameters are stored, in which dtype a
module computes, and in which dtype it returns its output. jamp reuses
``jmp.Policy`` as is; :func:`get_policy` accepts jmp's string grammar and gives
errors that list what is valid.

:func:`mixed_precision` turns a mode name ("fp16", "bf16", "O2", "16-mixed", ...)
into a :class:`MixedPrecision` recipe: the policy, the overrides (per module
class, and per module path: regular expressions like Keras 3's
``DTypePolicyMap``), the loss-scaling recipe and whether fp32 master weights are
kept.

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
import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import jmp

from jamp.fp8 import Fp8Recipe
from jamp.loss_scale import LossScaleConfig

Policy = jmp.Policy
"""``jmp.Policy``: a frozen dataclass ``(param_dtype, compute_dtype, output_dtype)``."""



class NormLayers:
    """The override key of the normalisation layers, whatever the framework.

    jamp's half-precision modes run LayerNorm, BatchNorm, GroupNorm and RMSNorm
    in float32 (:func:`float32_overrides`). This key names them without
    importing a framework: each adapter of :mod:`jamp.apply` registers its own
    norm classes (linen's, NNX's) with :meth:`register`, and
    :meth:`MixedPrecision.override_for` gives the key's policy to those classes
    and their subclasses (a class key of their own beats it). There is one
    instance, :data:`NORMS`.

    Example:
      >>> import jamp, flax.linen as nn
      >>> jamp.policy.NORMS.covers(nn.LayerNorm), jamp.policy.NORMS.covers(nn.Dense)
      (True, False)
    """

    _classes: list[type] = []

    def register(self, *classes: type) -> None:
        """Adds a framework's norm classes (called by the adapters when imported)."""
        self._classes.extend(c for c in classes if c not in self._classes)

    def covers(self, cls: type) -> bool:
        """Whether ``cls`` itself is a registered norm class (subclasses: walk the MRO)."""
        return cls in self._classes

    def __repr__(self) -> str:
        return "jamp.policy.NORMS"

    def __reduce__(self) -> str:
        return "NORMS"  # pickles and copies as the module's one instance


NORMS = NormLayers()
"""The symbolic override key of every framework's norms (see :class:`NormLayers`)."""

OverrideKey = type | NormLayers | str
"""A module class, :data:`NORMS`, or a regular expression matched in full against a path."""

Overrides = tuple[tuple[OverrideKey, Policy], ...]

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


def float32_overrides(policy: Policy) -> Overrides:
    """Overrides that run normalisation layers in float32 and return compute dtype.

    Args:
      policy: the model-wide policy; its compute dtype is what the norms return.

    Returns:
      One ``(NORMS, Policy)`` pair: :data:`NORMS` stands for LayerNorm,
      BatchNorm, GroupNorm and RMSNorm, linen's and NNX's (each adapter resolves
      it to its own classes).

    Example:
      >>> import jamp, flax.linen as nn
      >>> ov = jamp.float32_overrides(jamp.get_policy("p=f32,c=f16,o=f32"))
      >>> str(dict(ov)[jamp.policy.NORMS])
      'p=full,c=full,o=f16'
      >>> mp = jamp.MixedPrecision("custom", jamp.get_policy("f32"), overrides=ov)
      >>> str(mp.policy_for(nn.LayerNorm))
      'p=full,c=full,o=f16'
    """
    norm = Policy(jnp.float32, jnp.float32, policy.compute_dtype)
    return ((NORMS, norm),)


def module_path(path: str | Sequence[Any]) -> str:
    """A module path as override patterns see it: its names joined with ``"/"``.

    Linen paths are ``module.path`` (``("Encoder_0", "Dense_1")``); NNX paths are
    graph paths, where list items are numbered (``("blocks", 0, "mlp")``). The
    root module's path is ``""``.

    Example:
      >>> import jamp
      >>> jamp.policy.module_path(("blocks", 0, "mlp"))
      'blocks/0/mlp'
    """
    if isinstance(path, str):
        return path
    return "/".join(str(name) for name in path)


def _check_override_key(key: object) -> None:
    if isinstance(key, str):
        try:
            re.compile(key)
        except re.error as error:
            raise ValueError(
                f"Invalid override pattern {key!r}: {error}. A string key of overrides is a "
                "Python regular expression matched in full against module paths such as "
                "'Encoder_0/Dense_1' (linen) or 'blocks/0/mlp' (NNX); escape special "
                "characters with re.escape(...).") from None
    elif not (isinstance(key, type) or key is NORMS):
        raise ValueError(
            "overrides keys must be module classes (flax.linen.Module or flax.nnx.Module "
            "subclasses), jamp.policy.NORMS (the norm layers) or module-path patterns (str, "
            f"e.g. 'head' or 'Encoder_0/.*'), got {key!r}.")


def _override_policy(key: OverrideKey, spec: Any) -> Policy:
    try:
        return get_policy(spec)
    except ValueError as error:
        raise ValueError(f"overrides[{key!r}]: {error}") from None


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A named mixed-precision recipe: everything a mode decides.

    A module runs under the first of these that applies to it (precedence):

    1. a *path pattern* of ``overrides`` matching its module path;
    2. a *class* of ``overrides`` in its MRO (the first one: subclasses follow
       their parent unless they have their own);
    3. ``policy``.

    Path patterns are Python regular expressions matched in full
    (``re.fullmatch``) against the path of each module, names joined with
    ``"/"`` (:func:`module_path`): ``"head"`` matches the module ``head`` only,
    not ``head_norm`` nor ``head``'s submodules (``"head(/.*)?"`` covers the
    subtree, ``"Encoder_0/.*"`` the modules inside ``Encoder_0``). As in Keras
    3's ``DTypePolicyMap``, a key equal to the path itself wins; otherwise a
    path matched by two patterns is an error naming both.

    Attributes:
      name: canonical mode name ("fp32", "fp16", "bf16", ...).
      policy: model-wide param/compute/output dtypes.
      overrides: ``(module class or path pattern, Policy)`` pairs (a mapping, and
        policy strings such as ``"f32"``, are accepted and normalised).
      softmax_fp32: compute attention softmax in float32.
      loss_scale: a :class:`~jamp.loss_scale.LossScaleConfig`: the kind ("none",
        "static" or "dynamic") and every scaling setting, ``divergence_steps``
        included.
      master_weights: keep fp32 master copies of half-precision params in the
        optimizer state (apex O2 / Colossal-AI naive AMP): True or ``"float32"``; or,
        for bf16 params, ``"remainders"`` (the low 16 bits: exact), ``"kahan"``,
        ``"stochastic"`` (rounding, no copy) or ``"none"`` (lossy): see
        :mod:`jamp.optim_state`.
      optimizer_state: how the optimizer's per-parameter state is stored:
        ``"float32"``, ``"bf16"``, ``"fp8"`` (fp8 first moment, float16 second) or a
        mapping ``{state name: dtype}`` (:func:`jamp.low_precision_state`).
      fp8: a :class:`jamp.fp8.Fp8Recipe` (or ``"delayed"``/``"current"``): the
        Dense-type layers under ``policy`` (no override) run fp8 matmuls
        (:mod:`jamp.fp8`); ``None``: no fp8.
      clip_grad_norm: clip the unscaled gradients to this global norm inside the
        loss scale (:func:`jamp.make_optimizer`; Colossal-AI naive AMP's
        ``clip_grad``); 0: no clipping.
      log_num_zeros_in_grad: ask the trainer to log the number of zero gradient
        elements (Colossal-AI/Megatron's ``log_num_zeros_in_grad``).

    Raises:
      ValueError: for an override key that is neither a module class nor a valid
        regular expression (naming it), or a value that is not a policy.

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
    master_weights: bool | str = False
    fp8: Fp8Recipe | None = None
    clip_grad_norm: float = 0.0
    log_num_zeros_in_grad: bool = False
    optimizer_state: Any = "float32"

    def __post_init__(self):
        from jamp import optim_state  # noqa: PLC0415  (optim_state is policy-free)

        state = optim_state.check_optimizer_state(self.optimizer_state)
        # A mapping is kept as (name, format) pairs in order: the recipe stays hashable.
        object.__setattr__(self, "optimizer_state",
                           state if isinstance(state, str) else tuple(state.items()))
        optim_state.check_master_weights(self.master_weights)
        clip = self.clip_grad_norm
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not clip >= 0:
            raise ValueError(f"clip_grad_norm must be a number >= 0 (0: no clipping), got "
                             f"{clip!r}.")
        object.__setattr__(self, "clip_grad_norm", float(clip))
        if not isinstance(self.log_num_zeros_in_grad, bool):
            raise ValueError(f"log_num_zeros_in_grad must be True or False, got "
                             f"{self.log_num_zeros_in_grad!r}.")
        if isinstance(self.fp8, str):
            object.__setattr__(self, "fp8", Fp8Recipe(self.fp8))
        if not (self.fp8 is None or isinstance(self.fp8, Fp8Recipe)):
            raise ValueError(
                f"fp8 must be None, 'delayed', 'current' or a jamp.fp8.Fp8Recipe, got "
                f"{self.fp8!r}; e.g. fp8=jamp.fp8.Fp8Recipe('delayed', amax_history_length=16).")
        if isinstance(self.loss_scale, str):  # a kind with its default settings
            object.__setattr__(self, "loss_scale", LossScaleConfig(self.loss_scale))
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ValueError(
                f"loss_scale must be a jamp.LossScaleConfig or one of 'none', 'static', "
                f"'dynamic', got {self.loss_scale!r}.")
        object.__setattr__(self, "policy", get_policy(self.policy))
        optim_state.check_combination(self.optimizer_state, self.master_weights,
                                      self.policy.param_dtype)
        if isinstance(self.overrides, Mapping):
            object.__setattr__(self, "overrides", tuple(self.overrides.items()))
        for key, _ in self.overrides:
            _check_override_key(key)
        overrides = tuple((key, _override_policy(key, p)) for key, p in self.overrides)
        object.__setattr__(self, "overrides", overrides)

    @property
    def path_overrides(self) -> tuple[tuple[str, Policy], ...]:
        """The ``(path pattern, Policy)`` pairs of ``overrides``.

        Example:
          >>> import jamp
          >>> mp = jamp.mixed_precision("bf16", overrides={"head": "f32"})
          >>> [(pattern, str(p)) for pattern, p in mp.path_overrides]
          [('head', 'p=full,c=full,o=full')]
        """
        return tuple((k, p) for k, p in self.overrides if isinstance(k, str))

    def override_for(self, module_cls: type, path: str | Sequence[Any] | None = None
                     ) -> Policy | None:
        """The override a module runs under, or ``None`` if it runs under ``policy``.

        Args:
          module_cls: the module's class.
          path: its module path (a string, or names joined with ``"/"``); ``None``
            looks at class overrides only.

        Raises:
          ValueError: if two path patterns match ``path`` (neither equal to it),
            naming both and the path.

        Example:
          >>> import jamp, flax.linen as nn
          >>> mp = jamp.mixed_precision("fp16", overrides={"head": "f32"})
          >>> str(mp.override_for(nn.Dense, "head")), mp.override_for(nn.Dense, "Dense_0")
          ('p=full,c=full,o=full', None)
        """
        if path is not None:
            path = module_path(path)
            patterns = self.path_overrides
            for pattern, policy in patterns:
                if pattern == path:
                    return policy
            hits = [(pattern, policy) for pattern, policy in patterns
                    if re.fullmatch(pattern, path)]
            if len(hits) > 1:
                names = " and ".join(repr(pattern) for pattern, _ in hits)
                raise ValueError(
                    f"Module path {path!r} matches the override patterns {names}: a path may "
                    "match at most one pattern. Make the patterns exclusive (e.g. "
                    "'(?!head$).*' for every path but 'head') or add the path itself as a key "
                    "(a key equal to the path wins).")
            if hits:
                return hits[0][1]
        classes = {key: policy for key, policy in self.overrides if not isinstance(key, str)}
        norms = classes.get(NORMS)
        for klass in module_cls.__mro__:
            if klass in classes:
                return classes[klass]
            if norms is not None and NORMS.covers(klass):
                return norms
        return None

    def policy_for(self, module_cls: type, path: str | Sequence[Any] | None = None) -> Policy:
        """Returns the policy a module of ``module_cls`` at ``path`` runs under.

        A path pattern matching ``path`` beats a class override, which beats
        ``policy`` (see the class docstring); without ``path`` only classes count.

        Raises:
          ValueError: if two path patterns match ``path``, naming both.

        Example:
          >>> import jamp, flax.linen as nn
          >>> str(jamp.mixed_precision("fp16").policy_for(nn.Dense))
          'p=full,c=f16,o=full'
          >>> mp = jamp.mixed_precision("fp16", overrides={"head": "f32"})
          >>> str(mp.policy_for(nn.Dense, ("head",))), str(mp.policy_for(nn.LayerNorm, "norm"))
          ('p=full,c=full,o=full', 'p=full,c=full,o=f16')
        """
        override = self.override_for(module_cls, path)
        return self.policy if override is None else override

    def check_paths(self, paths: Iterable[str | Sequence[Any]], model: str = "the model"
                    ) -> None:
        """Raises unless every path pattern matches one of ``paths`` and none is ambiguous.

        :func:`jamp.apply_policy` calls it with every module path of an NNX model,
        and with the paths of the linen modules called when the model is
        initialised with ``__call__``, so a misspelt pattern does not silently
        leave a layer in half precision.

        Args:
          paths: the module paths of a model.
          model: how to name the model in the error.

        Raises:
          ValueError: naming a pattern that matches none of ``paths`` (with close
            matches and a few real paths), or a path two patterns match.

        Example:
          >>> import jamp
          >>> mp = jamp.mixed_precision("fp16", overrides={"haed": "f32"})
          >>> try:
          ...   mp.check_paths(["Dense_0", "head"])
          ... except ValueError as e:
          ...   print(str(e)[:58], "Did you mean 'head'?" in str(e))
          The override pattern 'haed' matches no module of the model True
        """
        paths = sorted({module_path(p) for p in paths})
        for path in paths:
            self.override_for(object, path)
        unmatched = [pattern for pattern, _ in self.path_overrides
                     if not any(pattern == p or re.fullmatch(pattern, p) for p in paths)]
        if unmatched:
            pattern = unmatched[0]
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.5)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            others = (f" (nor do {', '.join(map(repr, unmatched[1:]))})"
                      if len(unmatched) > 1 else "")
            shown = ", ".join(repr(p) for p in paths[:12]) + (", ..." if len(paths) > 12 else "")
            raise ValueError(
                f"The override pattern {pattern!r} matches no module of {model}{others}: a "
                f"pattern must match a module path in full, names joined with '/'; the paths "
                f"are {shown}.{hint} A pattern names modules, not parameters; 'Encoder_0/.*' "
                "covers the modules inside Encoder_0.")


def _mode_table() -> dict[str, dict[str, Any]]:
    f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
    mixed16 = Policy(f32, f16, f32)
    mixedbf = Policy(f32, bf16, f32)
    naive = Policy(f16, f16, f32)
    lowmem = Policy(bf16, bf16, f32)
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
        "fp8": dict(policy=mixedbf, overrides=float32_overrides(mixedbf), softmax_fp32=True,
                    fp8=Fp8Recipe("delayed")),
        "fp8_current": dict(policy=mixedbf, overrides=float32_overrides(mixedbf),
                            softmax_fp32=True, fp8=Fp8Recipe("current")),
        "bf16_lowmem": dict(policy=lowmem, overrides=float32_overrides(lowmem),
                            softmax_fp32=True, optimizer_state="fp8",
                            master_weights="stochastic"),
        "bf16_lowmem_exact": dict(policy=lowmem, overrides=float32_overrides(lowmem),
                                  softmax_fp32=True, optimizer_state="fp8",
                                  master_weights="remainders"),
    }


MODE_ALIASES: dict[str, str] = {
    "fp32": "fp32", "32": "fp32", "32-true": "fp32", "O0": "fp32",
    "fp16": "fp16", "16": "fp16", "16-mixed": "fp16", "O1": "fp16", "torch": "fp16",
    "amp": "fp16", "fp16_apex": "fp16",
    "bf16": "bf16", "bf16-mixed": "bf16",
    "fp16_naive": "fp16_naive", "O2": "fp16_naive", "naive": "fp16_naive",
    "fp16_pure": "fp16_pure", "O3": "fp16_pure", "16-true": "fp16_pure",
    "bf16_pure": "bf16_pure", "bf16-true": "bf16_pure",
    "fp8": "fp8", "fp8_delayed": "fp8", "fp8_current": "fp8_current",
    "bf16_lowmem": "bf16_lowmem", "bf16_lowmem_exact": "bf16_lowmem_exact",
}
"""Every accepted mode name (Lightning, apex and Colossal-AI spellings) -> canonical name."""

MODES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp16_naive", "fp16_pure", "bf16_pure")
"""The canonical mode names without fp8 matmuls."""

FP8_MODES: tuple[str, ...] = ("fp8", "fp8_current")
"""The canonical fp8 mode names (bf16 plus fp8 matmuls, :mod:`jamp.fp8`)."""

STATE_MODES: tuple[str, ...] = ("bf16_lowmem", "bf16_lowmem_exact")
"""The canonical mode names with small optimizer state and master (:mod:`jamp.optim_state`)."""

_CANONICAL = MODES + FP8_MODES + STATE_MODES


_PENDING_SCALE_FIELDS = {"num_losses": 1, "verbose": False}
"""Loss-scale settings accepted by name before :class:`LossScaleConfig` has them (their
defaults only)."""


def mixed_precision(name: str | int | Mapping[str, Any] | MixedPrecision | None = None,
                    **overrides: Any) -> MixedPrecision:
    """Returns the :class:`MixedPrecision` recipe for a named mode.

    The seeds' spellings work too (:mod:`jamp.seed_keys`): a Lightning precision
    (``16``, ``"bf16"``, ``amp_backend="apex", amp_level="O2"``), a Colossal-AI
    ``fp16`` dict (``dict(mode=AMP_TYPE.TORCH, init_scale=2.**16)``) or its keys
    (``mode=AMP_TYPE.NAIVE, clip_grad=1.0``), a Booster string (``"fp16_apex"``)
    and apex's ``amp.initialize`` keys (``opt_level="O2", loss_scale=128.0``).

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
      - ``fp8`` ("fp8_delayed"): ``bf16`` plus fp8 matmuls with delayed scaling
        (E4M3 operands, E5M2 gradients, amax history of 1024 steps) in linen
        ``Dense``/``DenseGeneral``/``Einsum`` and NNX ``Linear``/``LinearGeneral``/
        ``Einsum`` (attention projections included); the state lives in the
        ``"_overwrite_with_gradient"`` collection (:mod:`jamp.fp8`). Attention's
        score and value matmuls stay bf16 (both operands are activations whose
        range changes per batch, and the float32 softmax sits between them), so
        does a layer named ``head`` (``Fp8Recipe.keep_bf16``: the classifier
        feeds the loss directly and is too small to gain) and any layer with an
        override (``overrides={"out": "p=f32,c=bf16,o=f32"}``). Linen
        ``nn.Einsum`` and modules with Flax's ``dot_general``/``dot_general_cls``
        fields (the jamp ViT's attention projections) run fp8 too; raw
        ``jnp.einsum``/``@`` on parameters inside a module stay bf16 (no hook).
      - ``fp8_current``: the same with current scaling (stateless).
      - ``bf16_lowmem``: params and compute bf16 (norms f32), output f32; AdamW's
        ``mu`` fp8 and ``nu`` float16 (``optimizer_state="fp8"``), no master copy:
        stochastic rounding (``master_weights="stochastic"``). 7 bytes per parameter
        with bf16 gradients (16 for ``bf16``).
      - ``bf16_lowmem_exact``: the same with an exact master kept as 16-bit
        remainders (``master_weights="remainders"``): 9 bytes per parameter.

    Args:
      name: a mode name or alias, or an existing ``MixedPrecision``.
      **overrides: replace individual fields, e.g. ``policy="p=f32,c=bf16,o=f32"``,
        ``master_weights=True``, ``optimizer_state="bf16"``,
        ``overrides={"head": "f32"}`` (replaces the
        mode's overrides of the same kind, classes or path patterns: see
        :func:`replace_overrides`); and the loss-scale settings by name
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
      >>> jamp.mixed_precision(opt_level="O2", loss_scale=128.0).loss_scale.kind
      'static'
    """
    from jamp import seed_keys  # noqa: PLC0415  (seed_keys imports this module)

    if seed_keys.is_seed_call(name, overrides):
        return seed_keys.translate(name, **overrides)
    if isinstance(name, MixedPrecision):
        base = name
    else:
        canonical = MODE_ALIASES.get(str(name).strip()) if isinstance(name, str) else None
        if canonical is None:
            raise ValueError(
                f"Unknown mixed-precision mode {name!r}. Valid modes: "
                f"{', '.join(_CANONICAL)}; aliases: "
                f"{', '.join(k for k in MODE_ALIASES if k not in _CANONICAL)}."
            )
        base = MixedPrecision(name=canonical, **_mode_table()[canonical])
    fields = {f.name for f in dataclasses.fields(MixedPrecision)} - {"name"}
    scaling = {f.name for f in dataclasses.fields(LossScaleConfig)} - {"kind"}
    for key, default in _PENDING_SCALE_FIELDS.items():
        if key in overrides and key not in scaling:
            value = overrides.pop(key)
            if value != default or type(value) is not type(default):
                raise ValueError(
                    f"mixed_precision({base.name!r}, {key}={value!r}): this version's "
                    f"jamp.LossScaleConfig has no {key} field, so only {key}={default!r} is "
                    "accepted (one loss scale for every loss, no loss-scale messages).")
    unknown = sorted(set(overrides) - fields - scaling)
    if unknown:
        raise ValueError(
            f"Unknown field(s) {', '.join(unknown)} for mixed_precision({base.name!r}). "
            f"Valid fields: {', '.join(sorted(fields | scaling))}."
        )
    base_overrides = base.overrides
    if "policy" in overrides and _classes(base.overrides):
        # Norms return the compute dtype: follow a replaced policy.
        default = float32_overrides(get_policy(overrides["policy"]))
        base_overrides = replace_overrides(base.overrides, default)
    if "overrides" in overrides or base_overrides is not base.overrides:
        overrides["overrides"] = replace_overrides(
            base_overrides, overrides.get("overrides", base_overrides))
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


def _classes(overrides: Overrides) -> Overrides:
    return tuple((k, p) for k, p in overrides if not isinstance(k, str))


def replace_overrides(base: Iterable[tuple[OverrideKey, Any]],
                      new: Mapping[OverrideKey, Any] | Iterable[tuple[OverrideKey, Any]]
                      ) -> tuple[tuple[OverrideKey, Any], ...]:
    """``base`` overrides with those of ``new`` in place of the same kind.

    Class keys of ``new`` replace every class override of ``base`` (pass the
    mode's ones along to keep them); path patterns of ``new`` replace every path
    override of ``base``; a kind ``new`` does not mention is kept. So
    ``{"head": "f32"}`` keeps the mode's float32 norms, and ``{nn.Dense: "f32"}``
    drops them. An empty ``new`` removes every override.

    Example:
      >>> import jamp, flax.linen as nn
      >>> base = jamp.mixed_precision("fp16").overrides
      >>> kept = jamp.policy.replace_overrides(base, {"head": "f32"})
      >>> len(kept) == len(base) + 1, len(jamp.policy.replace_overrides(base, {nn.Dense: "f32"}))
      (True, 1)
    """
    base = tuple(base)
    new = tuple(new.items()) if isinstance(new, Mapping) else tuple(new)
    if not new:
        return ()
    has_path = any(isinstance(k, str) for k, _ in new)
    has_class = any(not isinstance(k, str) for k, _ in new)
    kept = tuple((k, p) for k, p in base if not (has_path if isinstance(k, str) else has_class))
    return kept + new


def _scaling_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(LossScaleConfig) if f.name != "kind"]


PolicyLike = str | int | Mapping[str, Any] | Policy | MixedPrecision
"""``str | int | Mapping[str, Any] | jamp.Policy | jamp.MixedPrecision``: what a
``policy_or_mode`` argument accepts (a mode name, a jmp policy string, ...; see
:func:`to_mixed_precision`)."""


def to_mixed_precision(
    policy_or_mode: PolicyLike, overrides: Mapping[OverrideKey, Any] | None = None
) -> MixedPrecision:
    """Normalises a mode name, policy string, ``Policy`` or ``MixedPrecision``.

    A Colossal-AI ``fp16`` dict and a Lightning precision (``16``) are modes too
    (:mod:`jamp.seed_keys`).

    A mode name ("fp16", "O2", ...) gives that mode with its default overrides.
    A policy (``Policy`` or jmp-style string such as ``"p=f32,c=f16,o=f32"``)
    gives a recipe with that policy and no overrides. ``overrides``, when given,
    maps module classes and module-path patterns to policies (or policy
    strings); its classes replace the recipe's class overrides and its patterns
    the recipe's patterns (:func:`replace_overrides`): ``{"head": "f32"}`` keeps
    the mode's float32 norms.

    Example:
      >>> import jamp
      >>> jamp.to_mixed_precision("p=f32,c=bf16,o=f32").overrides
      ()
    """
    if isinstance(policy_or_mode, MixedPrecision):
        mp = policy_or_mode
    elif isinstance(policy_or_mode, Policy):
        mp = MixedPrecision(name="custom", policy=policy_or_mode)
    elif isinstance(policy_or_mode, Mapping | int) and not isinstance(policy_or_mode, bool):
        mp = mixed_precision(policy_or_mode)  # a Colossal-AI fp16 dict, a Lightning precision
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
            "Expected a mode name, a policy string, a jamp.Policy, a jamp.MixedPrecision, "
            "a Lightning precision (16, 32) or a Colossal-AI fp16=dict(...), "
            f"got {type(policy_or_mode).__name__}."
        )
    if overrides is not None:
        mp = dataclasses.replace(mp, overrides=replace_overrides(mp.overrides, overrides))
    return mp
