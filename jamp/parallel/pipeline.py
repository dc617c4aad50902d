"""GPipe pipeline parallelism over the 'pipe' mesh axis with ``jax.shard_map``.

A stack of identical layers whose parameters have a leading layer axis (the
``nn.scan``-ed encoder of :mod:`jamp.models.vit`) is split into ``S`` contiguous
stages, one per position on the 'pipe' mesh axis (``in_specs=P('pipe')`` on the
layer axis). The batch is split into ``M`` microbatches and run through the
GPipe schedule: at tick ``t`` stage ``s`` works on microbatch ``t - s`` and
hands its output to stage ``s + 1`` with ``jax.lax.ppermute``. The schedule has
``M + S - 1`` ticks, so a fraction ``(S - 1) / (M + S - 1)`` of each stage's
time is bubble; bubble slots compute on zeros, so every value stays finite and
the loss-scale overflow check only ever sees real overflows, and state
combined by max (the fp8 amax histories of mode ``"fp8"``, flax's ``fm32``
leaves) must take its new value from real microbatches only: the caller passes
a hook, ``on_tick(stage_params, real)``, that the schedule runs the stage's
variables through on every tick (``jamp.fp8``'s strategy gives
:func:`jamp.fp8.only_on_real_data`). ``jax.grad``
differentiates straight through the schedule (the transpose of a ``ppermute``
is the reverse ``ppermute``), which gives GPipe's backward pass.

Only the ``'pipe'`` axis needs to be manual inside the schedule: 'model' stays
automatic, so the stages are still tensor-parallel through the logical axis
rules (the trainer's step makes 'data' manual too, see :mod:`jamp.parallel.step`).
The last stage's outputs reach every stage through one ``psum``, so whatever
follows the pipeline (the ViT's head) runs replicated over 'pipe'.

A model does not pipeline by itself: :class:`GPipe` is a layer runner that the
trainer hands to the ViT (``vit.create(..., layer_runner=GPipe(S, M))``) when
its mesh has ``S > 1`` pipeline stages.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp.parallel import make_mesh, pipeline
  >>> mesh = make_mesh({"data": 1, "model": 1, "pipe": 2})
  >>> weights = jnp.arange(1.0, 5.0)                     # 4 "layers": x -> x * w
  >>> stage = lambda w, x, mb: x * jnp.prod(w)           # a stage = its 2 layers
  >>> with jax.set_mesh(mesh):
  ...     y = pipeline.pipelined(stage, weights, jnp.ones((8, 3)), stages=2, microbatches=4)
  >>> y[0].tolist()
  [24.0, 24.0, 24.0]
  >>> pipeline.bubble_fraction(stages=2, microbatches=4)
  0.2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

PIPE = "pipe"
"""The mesh axis the stages are laid out on."""

StageFn = Callable[[Any, jax.Array, jax.Array], jax.Array]
"""``stage_fn(stage_params, x, microbatch_index) -> y`` with ``y`` shaped like ``x``."""

TickHook = Callable[[Any, jax.Array], Any]
"""``on_tick(stage_params, real) -> stage_params``: run on every tick; ``real`` (a bool
scalar) is whether the tick carries a real microbatch, not the bubble's filler."""


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle fraction ``(S - 1) / (M + S - 1)`` of a GPipe schedule.

    Example:
      >>> from jamp.parallel.pipeline import bubble_fraction
      >>> bubble_fraction(stages=4, microbatches=13)
      0.1875
    """
    return (stages - 1) / (microbatches + stages - 1)


def _is_manual(axis_name: str) -> bool:
    return axis_name in jax.sharding.get_abstract_mesh().manual_axes


def gpipe(stage_fn: StageFn, stage_params: Any, inputs: jax.Array, *,
          axis_name: str = PIPE, on_tick: TickHook | None = None) -> jax.Array:
    """The GPipe schedule, to be called inside ``jax.shard_map`` manual over ``axis_name``.

    Args:
      stage_fn: ``stage_fn(stage_params, x, microbatch_index) -> y``, ``y`` shaped
        like ``x``: this stage's layers. ``microbatch_index`` (int32 scalar) lets
        it fold per-microbatch randomness (dropout) into its keys.
      stage_params: this stage's parameters (varying over ``axis_name``).
      inputs: ``[M, ...]`` microbatches, the same on every stage.
      on_tick: optional :data:`TickHook` the stage's parameters pass through on
        every tick (e.g. to keep the bubble's filler out of state combined by max).

    Returns:
      ``[M, ...]``: the last stage's outputs, on every stage.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jamp.parallel import make_mesh
      >>> from jamp.parallel.pipeline import gpipe
      >>> mesh = make_mesh({"data": 1, "model": 1, "pipe": 2})
      >>> run = jax.shard_map(lambda w, x: gpipe(lambda w, x, i: x + w.sum(), w, x),
      ...                     mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P())
      >>> run(jnp.array([1.0, 2.0]), jnp.zeros((3, 2)))[:, 0].tolist()
      [3.0, 3.0, 3.0]
    """
    stages = jax.lax.axis_size(axis_name)
    stage = jax.lax.axis_index(axis_name)
    microbatches = inputs.shape[0]
    # Stage 0 reads microbatch t at tick t; after the last one it is fed zeros.
    feed = jnp.concatenate(
        [inputs, jnp.zeros((stages - 1, *inputs.shape[1:]), inputs.dtype)])
    if axis_name not in varying_axes(feed):
        # Explicitly varying, so the transpose (the inputs' gradient, summed over the stages
        # of which only stage 0 reads them) is an all-reduce in _wide's dtype.
        feed = jax.lax.pcast(_wide(feed), axis_name, to="varying").astype(inputs.dtype)
    forward = [(i, i + 1) for i in range(stages - 1)]

    def tick(carry, xs):
        received = carry
        t, fresh = xs
        x = jnp.where(stage == 0, fresh, received)
        microbatch = t - stage
        # Bubble ticks run on filler: the caller's hook may keep it out (e.g. of fp8 amax).
        real = (microbatch >= 0) & (microbatch < microbatches)
        params = stage_params if on_tick is None else on_tick(stage_params, real)
        y = stage_fn(params, x, jnp.clip(microbatch, 0, microbatches - 1))
        # Stage s + 1 gets y next tick; stage 0 receives zeros (ppermute fills gaps).
        return jax.lax.ppermute(y, axis_name, forward), y

    # Before its first microbatch arrives, stage s > 0 computes on zeros.
    start = jax.lax.pcast(jnp.zeros_like(inputs[0]), axis_name, to="varying")
    ticks = jnp.arange(microbatches + stages - 1, dtype=jnp.int32)
    _, outputs = jax.lax.scan(tick, start, (ticks, feed))
    # The last stage emits microbatch m at tick m + S - 1; keep only its outputs and
    # give them to every stage (a sum in which the other stages add zeros: exact).
    last = jnp.where(stage == stages - 1, outputs[stages - 1:], jnp.zeros_like(inputs))
    return jax.lax.psum(_wide(last), axis_name).astype(last.dtype)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (inside ``jax.shard_map``; empty outside).

    Example:
      >>> import jax.numpy as jnp
      >>> varying_axes(jnp.ones(2))
      frozenset()
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9; .vma before
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _wide(x: jax.Array) -> jax.Array:
    """``x`` in float32 if half precision: for the schedule's two all-reduces (forward and
    backward), which accumulate in float32 like every sum of the step (:mod:`jamp.accumulate`).

    Both add one stage's values to zeros, exact in any dtype; bfloat16 would not
    even compile: XLA:CPU aborts compiling a bfloat16 all-reduce inside a partly
    manual ``shard_map`` (its AllReducePromotion pass: "Invalid binary instruction
    opcode copy").
    """
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


def pipelined(stage_fn: StageFn, layer_params: Any, x: jax.Array, *, stages: int,
              microbatches: int, axis_name: str = PIPE,
              on_tick: TickHook | None = None) -> jax.Array:
    """Runs ``[L, ...]``-stacked layers as a GPipe pipeline over ``axis_name`` of the mesh.

    ``x`` (``[B, ...]``) is split into ``microbatches`` interleaved microbatches
    (example ``i`` goes to microbatch ``i % M``, so a batch sharded over 'data'
    keeps every microbatch sharded over 'data' too); the ``L`` layers into
    ``S`` stages of ``L / S`` consecutive layers. Must run under ``jax.set_mesh``
    with a mesh whose ``axis_name`` has ``S`` devices.
    Inside a ``jax.shard_map`` that is already manual over ``axis_name``,
    ``layer_params`` are this stage's ``[L / S, ...]`` slice and the schedule
    runs in place (JAX cannot differentiate a ``shard_map`` nested in one over
    another axis, so :mod:`jamp.parallel.step` makes 'data' and 'pipe' manual
    together).

    Args:
      stage_fn: ``stage_fn(stage_params, x, microbatch_index) -> y`` applying
        ``L / S`` layers whose parameters have a leading ``L / S`` axis.
      layer_params: pytree of ``[L, ...]`` arrays (``[L / S, ...]`` when manual).
      x: ``[B, ...]`` activations, ``B`` divisible by ``microbatches``.
      stages: ``S``, the number of stages.
      microbatches: ``M``, the number of microbatches.
      on_tick: optional hook for the stages' parameters on every tick (:func:`gpipe`).

    Returns:
      ``[B, ...]``, what applying all ``L`` layers in order to ``x`` gives.

    Raises:
      ValueError: the mesh's ``axis_name`` is not ``S`` devices, ``B`` not
        divisible by ``M`` or ``L`` not divisible by ``S``.

    Example: see the module docstring.
    """
    mesh = jax.sharding.get_abstract_mesh()
    size = 1 if mesh.empty or axis_name not in mesh.axis_names else mesh.shape[axis_name]
    if size != stages:
        raise ValueError(
            f"A {stages}-stage pipeline runs under a mesh (jax.set_mesh) whose {axis_name!r} "
            f"axis has {stages} devices; this one has {size}.")
    batch = x.shape[0]
    if microbatches < 1 or batch % microbatches:
        raise ValueError(
            f"The batch of {batch} examples (per data shard) cannot be split into "
            f"{microbatches} pipeline microbatches; make the batch a multiple of "
            "data x pipeline_microbatches.")
    # [B, ...] -> [M, B / M, ...] with example i in microbatch i % M.
    micro = jnp.swapaxes(x.reshape(batch // microbatches, microbatches, *x.shape[1:]), 0, 1)
    if _is_manual(axis_name):
        out = gpipe(stage_fn, layer_params, micro, axis_name=axis_name, on_tick=on_tick)
    else:
        layers = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(layer_params)}
        if len(layers) != 1 or next(iter(layers)) % stages:
            raise ValueError(
                f"{sorted(layers)} stacked layers cannot be split into {stages} pipeline "
                "stages; use a number of layers divisible by the 'pipe' mesh axis.")
        out = jax.shard_map(
            lambda p, xs: gpipe(stage_fn, p, xs, axis_name=axis_name, on_tick=on_tick),
            in_specs=(P(axis_name), P()), out_specs=P(), axis_names={axis_name},
        )(layer_params, micro)
    return jnp.swapaxes(out, 0, 1).reshape(x.shape)



@dataclasses.dataclass(frozen=True)
class GPipe:
    """A layer runner that runs a model's stacked layers as a GPipe pipeline.

    Hand it to the ViT (``vit.create(..., layer_runner=GPipe(S, M))``, see
    :class:`jamp.models.vit.Encoder`) and apply the model under a mesh whose
    ``axis_name`` axis has ``stages`` devices. Stage ``s`` folds ``s`` and the
    microbatch index into the dropout key, so every microbatch of every stage
    draws its own mask.

    Attributes:
      stages: ``S``, the size of the mesh's ``axis_name`` axis.
      microbatches: ``M``, microbatches per (data-shard) batch.
      axis_name: the mesh axis the stages are laid out on.
      on_tick: optional :data:`TickHook` for the stages' variables on every tick
        (the trainer passes its fp8 strategy's, which keeps the bubble's filler
        out of the amax histories).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.parallel import make_mesh
      >>> from jamp.parallel.pipeline import GPipe
      >>> runner = GPipe(stages=2, microbatches=4)
      >>> apply_layers = lambda w, x, rng: x * jnp.prod(w)   # "layers" x -> x * w
      >>> with jax.set_mesh(make_mesh({"data": 1, "model": 1, "pipe": 2})):
      ...     y = runner(apply_layers, jnp.arange(1.0, 5.0), jnp.ones((8, 3)), None)
      >>> float(y[0, 0]), runner.bubble_fraction
      (24.0, 0.2)
    """

    stages: int
    microbatches: int
    axis_name: str = PIPE
    on_tick: TickHook | None = dataclasses.field(default=None, repr=False)

    @property
    def bubble_fraction(self) -> float:
        """The idle fraction of the schedule, :func:`bubble_fraction`."""
        return bubble_fraction(self.stages, self.microbatches)

    def __call__(self, apply_layers: Callable[[Any, jax.Array, jax.Array | None], jax.Array],
                 layer_params: Any, x: jax.Array, rng: jax.Array | None) -> jax.Array:
        """Applies the ``[L, ...]``-stacked ``layer_params`` to ``x`` through the schedule.

        ``apply_layers(params, x, dropout_rng)`` applies a ``[n, ...]`` stack of the
        layers (a stage's share); ``rng`` is the dropout key, or None.
        """

        def stage_fn(params, h, microbatch):
            key = None
            if rng is not None:
                key = jax.random.fold_in(rng, jax.lax.axis_index(self.axis_name))
                key = jax.random.fold_in(key, microbatch)
            return apply_layers(params, h, key)

        return pipelined(stage_fn, layer_params, x, stages=self.stages,
                         microbatches=self.microbatches, axis_name=self.axis_name,
                         on_tick=self.on_tick)
