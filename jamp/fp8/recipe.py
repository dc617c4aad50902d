"""The fp8 recipe and its two scaling strategies, the one place where they differ.

:class:`Fp8Recipe` says how a mode runs its fp8 matmuls; its :attr:`~Fp8Recipe.strategy`
(:class:`DelayedScaling` or :class:`CurrentScaling`, both :class:`ScalingStrategy`)
answers every question whose answer depends on the kind of scaling: what the linen
and NNX installs set (:mod:`jamp.fp8.linen`, :mod:`jamp.fp8.nnx`), the matmul of
``jamp.autocast``, whether the train step has state to differentiate and which train
state holds it, and the hook a pipeline runs its stages' variables through. Nothing
else branches on the scaling (as MaxText's layers see one quantization object).

Example:
  >>> import jamp
  >>> delayed, current = jamp.fp8.Fp8Recipe("delayed"), jamp.fp8.Fp8Recipe("current")
  >>> delayed.strategy.collection == jamp.fp8.COLLECTION, current.strategy.collection
  (True, None)
  >>> [r.strategy.linen_field()[0] for r in (delayed, current)]
  ['dot_general_cls', 'dot_general']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import jax
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from jamp.fp8 import linen, ops, state
from jamp.fp8 import nnx as fp8_nnx


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a mode runs its fp8 matmuls.

    Attributes:
      scaling: ``"delayed"`` (scale from an amax history, state in
        :data:`COLLECTION`) or ``"current"`` (scale from the tensor itself).
      amax_history_length: steps of amax history kept per tensor (delayed only).
      keep_bf16: names of layers that keep their bf16 matmul (matched against the
        last component of the module path; absent names are fine). By default
        the classifier ``"head"``: like Transformer Engine and torchao recipes,
        the last layer stays in higher precision (its logits feed the loss
        directly and its matmul is too small to gain from fp8).

    Example:
      >>> import jamp
      >>> recipe = jamp.fp8.Fp8Recipe("delayed", amax_history_length=16)
      >>> recipe.strategy
      DelayedScaling(amax_history_length=16)
    """

    scaling: Literal["delayed", "current"] = "delayed"
    amax_history_length: int = 1024
    keep_bf16: tuple[str, ...] = ("head",)

    def __post_init__(self):
        if isinstance(self.keep_bf16, str) or not all(
                isinstance(n, str) for n in self.keep_bf16):
            raise ValueError(
                f"keep_bf16 must be a tuple of layer names, got {self.keep_bf16!r}; e.g. "
                "keep_bf16=('head',) or ().")
        object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))
        if self.scaling not in STRATEGIES:
            raise ValueError(
                f"fp8 scaling must be 'delayed' or 'current', got {self.scaling!r}.")
        n = self.amax_history_length
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(
                f"amax_history_length must be an int >= 1, got {n!r}; e.g. 1024 (Transformer "
                "Engine's default) or 16.")

    @property
    def strategy(self) -> ScalingStrategy:
        """The strategy of :attr:`scaling`: :class:`DelayedScaling` or :class:`CurrentScaling`.

        Example:
          >>> import jamp
          >>> jamp.fp8.Fp8Recipe("current").strategy
          CurrentScaling()
        """
        return STRATEGIES[self.scaling].from_recipe(self)

    def applies_to(self, name: str | None) -> bool:
        """Whether a layer named ``name`` (the last component of its path) runs in fp8.

        Example:
          >>> import jamp
          >>> r = jamp.fp8.Fp8Recipe()
          >>> r.applies_to("Dense_0"), r.applies_to("head"), r.applies_to(None)
          (True, False, True)
        """
        return name is None or name not in self.keep_bf16



class ScalingStrategy:
    """What a kind of fp8 scaling installs and keeps; one subclass per kind.

    Attributes:
      collection: the linen variable collection of the state the step
        differentiates (:data:`jamp.fp8.COLLECTION`), or ``None``: stateless.
    """

    collection: ClassVar[str | None] = None

    @classmethod
    def from_recipe(cls, recipe: Fp8Recipe) -> ScalingStrategy:
        """The strategy for ``recipe`` (its settings, e.g. the amax history length)."""
        return cls()

    def linen_field(self) -> tuple[str, Any]:
        """The field of a linen layer (flax's injection convention) to set, and its value."""
        raise NotImplementedError

    def linen_einsum_dot(self) -> Callable[..., jax.Array]:
        """The ``_dot_general`` of an ``nn.Einsum``'s ``jnp.einsum`` (inside its call)."""
        raise NotImplementedError

    def nnx_dot(self, einsum: bool, stacked: tuple[int, ...]) -> Any:
        """The ``dot_general`` (``einsum_op`` if ``einsum``) of an NNX layer stacked ``stacked``."""
        raise NotImplementedError

    def nnx_declared_dot(self, names: tuple[str, ...], stacked: tuple[int, ...]) -> Any:
        """The ``dot_general`` of an NNX module declaring the matmuls ``names``."""
        raise NotImplementedError

    def autocast_dot_general(self) -> Callable[..., jax.Array]:
        """The projection matmul of ``jamp.autocast``; a ValueError naming the fix if none."""
        raise NotImplementedError

    def pipeline_hook(self) -> Callable[[Any, jax.Array], Any] | None:
        """``hook(stage_variables, real)`` for each pipeline tick (``GPipe(on_tick=...)``)."""
        return None

    def nnx_variables(self, model: nnx.Module) -> dict[str, Any]:
        """An NNX model's state for the step, as linen collections (``{}``: none)."""
        return {}

    def create_train_state(self, *, apply_fn: Any, params: Any,
                           tx: optax.GradientTransformation,
                           variables: dict[str, Any]) -> train_state.TrainState:
        """The train state of a model with initial ``variables`` (``init``'s collections)."""
        del variables
        return train_state.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)


@dataclasses.dataclass(frozen=True)
class CurrentScaling(ScalingStrategy):
    """Scale by the tensor's own amax: no state (:func:`jamp.fp8.current_scaling_dot_general`).

    Example:
      >>> import jamp
      >>> jamp.fp8.CurrentScaling().autocast_dot_general().__name__
      'current_scaling_dot_general'
    """

    def linen_field(self) -> tuple[str, Any]:
        return "dot_general", ops.current_scaling_dot_general

    def linen_einsum_dot(self) -> Callable[..., jax.Array]:
        return ops.current_scaling_dot_general

    def nnx_dot(self, einsum: bool, stacked: tuple[int, ...]) -> Any:
        return ops.current_scaling_einsum if einsum else ops.current_scaling_dot_general

    def nnx_declared_dot(self, names: tuple[str, ...], stacked: tuple[int, ...]) -> Any:
        return ops.current_scaling_dot_general

    def autocast_dot_general(self) -> Callable[..., jax.Array]:
        return ops.current_scaling_dot_general


@dataclasses.dataclass(frozen=True)
class DelayedScaling(ScalingStrategy):
    """Scale by an amax history: state per matmul, trained in a :class:`jamp.fp8.TrainState`.

    Example:
      >>> import jamp
      >>> jamp.fp8.Fp8Recipe("delayed").strategy.autocast_dot_general()  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: jamp.autocast with delayed-scaling fp8 ...
    """

    amax_history_length: int = 1024
    collection: ClassVar[str | None] = ops.COLLECTION

    @classmethod
    def from_recipe(cls, recipe: Fp8Recipe) -> DelayedScaling:
        return cls(recipe.amax_history_length)

    def linen_field(self) -> tuple[str, Any]:
        return "dot_general_cls", linen.dot_general_op(self.amax_history_length)

    def linen_einsum_dot(self) -> Callable[..., jax.Array]:
        return linen.delayed_einsum_dot(self.amax_history_length)

    def nnx_dot(self, einsum: bool, stacked: tuple[int, ...]) -> Any:
        return nnx.data(fp8_nnx.delayed_dot(self.amax_history_length, stacked))

    def nnx_declared_dot(self, names: tuple[str, ...], stacked: tuple[int, ...]) -> Any:
        return nnx.data(nnx.Dict({n: fp8_nnx.delayed_dot(self.amax_history_length, stacked)
                                  for n in names}))

    def autocast_dot_general(self) -> Callable[..., jax.Array]:
        raise ValueError(
            "jamp.autocast with delayed-scaling fp8 (mode 'fp8'/'fp8_delayed', "
            "Fp8Recipe(scaling='delayed')): delayed scaling keeps an amax history per matmul "
            "from step to step, and autocast is a stateless function transform with nowhere "
            "to keep it. Use mode 'fp8_current' with jamp.autocast (current scaling, no "
            "state), or apply mode 'fp8' to a Flax linen/NNX model with jamp.apply_policy, "
            f"whose state lives in the {self.collection!r} collection (jamp.fp8.COLLECTION, "
            "linen) or in jamp.fp8.Fp8Meta variables (NNX).")

    def pipeline_hook(self) -> Callable[[Any, jax.Array], Any] | None:
        return state.only_on_real_data  # bubble ticks must not enter the amax

    def nnx_variables(self, model: nnx.Module) -> dict[str, Any]:
        return {self.collection: fp8_nnx.nnx_state(model)}

    def create_train_state(self, *, apply_fn: Any, params: Any,
                           tx: optax.GradientTransformation,
                           variables: dict[str, Any]) -> train_state.TrainState:
        # The state rides in the train state, outside the optimizer.
        return state.TrainState.create(apply_fn=apply_fn, params=params, tx=tx,
                                       fp8=variables.get(self.collection, {}))


STRATEGIES: dict[str, type[ScalingStrategy]] = {
    "delayed": DelayedScaling, "current": CurrentScaling}
"""The strategy of each ``Fp8Recipe.scaling``."""
