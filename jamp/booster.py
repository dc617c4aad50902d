"""``jamp.boost``: Colossal-AI's Booster in JAX's idiom, a training loop's set-up in one call.

One call takes a model (Flax linen, Flax NNX, or a plain function of its parameters,
which then runs under :func:`jamp.autocast`), an optax optimizer, a loss function and
a precision (a mode name, an alias such as ``"O2"`` or ``"16-mixed"``, or a
:func:`jamp.mixed_precision` recipe), and optionally a mesh, a ZeRO stage and a
gradient-accumulation count. It returns a :class:`Boosted` with what a loop needs:

- ``init(rng, batch)``: the state, created sharded on the mesh: params in their param
  dtype, optimizer state with the loss scale (and the fp32 master copy of
  ``fp16_naive``), fp8 state, and the model's mutable collections (batch norm);
- ``step(state, batch)``: the jitted, sharded, loss-scaled step with the state
  donated, returning the new state and metrics (``loss``, ``loss_scale``, ``skipped``,
  ``grad_norm``, ``num_zeros_in_grad``, ...). A non-finite gradient skips the step
  exactly: params, master copy, optimizer, fp8 and batch-norm state stay bit-identical;
- ``eval_step(state, batch)``: the loss (and metrics) without dropout;
- ``log(step, metrics)``: with ``log_dir=``, the trainer's ``metrics.jsonl``, TensorBoard
  scalars, skip reasons and per-layer statistics (:mod:`jamp.boost_log`);
- ``save(directory, state)`` / ``restore(directory)``: the whole state, with orbax.

It is assembled from jamp's public pieces, which stay available for a loop of your
own: :func:`jamp.apply_policy` / :func:`jamp.autocast`, :func:`jamp.make_optimizer`,
:func:`jamp.parallel.zero.make_plan`, :func:`jamp.parallel.step.value_and_grad`
(``accumulate=``) and :func:`jamp.step.loss_scaled_step`.

Example (ZeRO-3 over every device, a NaN batch skipped):
  >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
  >>> model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
  >>> loss_fn = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  >>> boosted = jamp.boost(model, optax.adam(1e-2), loss_fn, "fp16", mesh={"data": -1},
  ...                      zero_stage=3, accumulate=2)
  >>> batch = (jnp.ones((16, 8)), jnp.zeros(16, jnp.int32))
  >>> state = boosted.init(jax.random.key(0), batch)
  >>> state, metrics = boosted.step(state, (batch[0].at[0, 0].set(jnp.nan), batch[1]))
  >>> bool(metrics["skipped"]), float(metrics["loss_scale"])
  (True, 65536.0)
  >>> state, metrics = boosted.step(state, batch)
  >>> bool(metrics["skipped"]), float(jamp.loss_scale(state.opt_state))
  (False, 32768.0)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx, struct
from flax.training import train_state

from jamp import boost_log, fp8, grad_accum, optim_state, parallel
from jamp import tensor_stats as tensor_stats_module
from jamp.apply import PolicyModule, apply_policy
from jamp.autocast import autocast
from jamp.function_activations import SCAN as FUNCTION_SCAN
from jamp.function_activations import function_activations
from jamp.metrics import MetricsWriter
from jamp.parallel import zero
from jamp.parallel.read_dtypes import read_dtypes
from jamp.policy import MixedPrecision, to_mixed_precision
from jamp.step import (
    ValueAndGrad,
    combined_by_max,
    differentiated_variables,
    loss_scaled_step,
    make_optimizer,
)

__all__ = ["Boosted", "PytreeTrainState", "StatefulTrainState", "assemble_step", "boost",
           "gradient_function"]

Key = str | int | Callable[[Any], Any]
"""Where a batch holds something: a dict key, a tuple index, or a function of the batch."""

_TRAIN_FLAGS = {"train": lambda t: t, "training": lambda t: t, "is_training": lambda t: t,
                "deterministic": lambda t: not t}


class StatefulTrainState(train_state.TrainState):
    """A flax ``TrainState`` with the model's mutable collections (e.g. ``batch_stats``).

    ``model_state`` is updated by every applied step and kept bit-identical by a
    skipped one.

    Example:
      >>> import optax
      >>> s = StatefulTrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
      ...                               model_state={"batch_stats": {}})
      >>> s.model_state
      {'batch_stats': {}}
    """

    model_state: Any = struct.field(default_factory=dict)


class PytreeTrainState(train_state.TrainState):
    """A flax ``TrainState`` whose params may be any pytree (an Equinox model's arrays...).

    flax's ``apply_gradients`` looks for a key in the params, so they must be a mapping;
    this one applies the optimizer to whatever pytree the params are.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> s = PytreeTrainState.create(apply_fn=None, params=(jnp.ones(2),), tx=optax.sgd(1.0))
      >>> s.apply_gradients(grads=(jnp.ones(2),)).params[0].tolist()
      [0.0, 0.0]
    """

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation,
               **kwargs: Any) -> PytreeTrainState:
        """The state at step 0: ``tx.init(params)``."""
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params),
                   **kwargs)

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> PytreeTrainState:
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                            opt_state=opt_state, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Model:
    """One interface over linen, NNX and plain functions (what :func:`boost` needs)."""

    init: Callable[[jax.Array, Any], tuple[Any, dict[str, Any], dict[str, Any]]]
    """``init(rng, inputs) -> (params, differentiated collections, mutable collections)``"""
    apply: Callable[..., tuple[Any, dict[str, Any]]]
    """``apply(variables, inputs, train, rng, mutable) -> (outputs, new mutable collections)``"""
    activations: Callable[..., Any] | None = None
    """``activations(variables, inputs, train, rng, mutable, reduce) -> reduce(output)`` of
    every layer output in call order (:mod:`jamp.tensor_stats`); None: the model does not
    expose them."""
    scanned: tuple[str, ...] = ()
    """Path components of its layer outputs stacked over layers (a function's scans)."""


def _train_kwargs(call: Callable) -> Callable[[bool], dict[str, bool]]:
    """The keyword a model's ``__call__`` takes for train/eval mode, if any."""
    try:
        names = inspect.signature(call).parameters
    except (TypeError, ValueError):
        return lambda train: {}
    for name, value in _TRAIN_FLAGS.items():
        if name in names:
            return lambda train, name=name, value=value: {name: value(train)}
    return lambda train: {}


def _linen(model: nn.Module, mp: MixedPrecision) -> _Model:
    inner = model.inner if isinstance(model, PolicyModule) else model
    module = model if isinstance(model, PolicyModule) else apply_policy(model, mp)
    train_kwargs = _train_kwargs(type(inner).__call__)
    differentiated = {mp.fp8.strategy.collection} if mp.fp8 is not None else set()

    def init(rng, inputs):
        params_rng, dropout_rng = jax.random.split(rng)
        variables = module.init({"params": params_rng, "dropout": dropout_rng}, inputs,
                                **train_kwargs(False))
        variables = dict(variables)
        params = variables.pop("params", {})
        extras = {k: v for k, v in variables.items() if k in differentiated}
        mutable = {k: v for k, v in variables.items() if k not in differentiated}
        return params, extras, mutable

    def apply(variables, inputs, train, rng, mutable):
        rngs = None if rng is None else {"dropout": rng}
        if mutable and train:
            return module.apply(variables, inputs, rngs=rngs, mutable=list(mutable),
                                **train_kwargs(train))
        return module.apply(variables, inputs, rngs=rngs, **train_kwargs(train)), {}

    def activations(variables, inputs, train, rng, mutable, reduce):
        rngs = None if rng is None else {"dropout": rng}
        return tensor_stats_module.linen_activations(module.apply, variables, inputs,
                                                     rngs=rngs, mutable=list(mutable),
                                                     reduce=reduce, **train_kwargs(train))

    return _Model(init, apply, activations)


def _nnx(model: nnx.Module, mp: MixedPrecision) -> _Model:
    model = apply_policy(model, mp)
    # The RNG streams stay as built (each step reseeds 'dropout' with its own key); the
    # rest of the non-parameter state (batch statistics...) is the carried model state.
    graphdef, params, meta, streams, rest = nnx.split(model, nnx.Param, fp8.Fp8Meta,
                                                      nnx.RngState, ...)
    train_kwargs = _train_kwargs(type(model).__call__)

    def init(rng, inputs):
        del rng, inputs  # an NNX model is built with its initial values
        extras = {}
        if jax.tree_util.tree_leaves(meta):
            extras = {fp8.COLLECTION: nnx.to_pure_dict(meta)}
        mutable = {"nnx": nnx.to_pure_dict(rest)} if jax.tree_util.tree_leaves(rest) else {}
        return nnx.to_pure_dict(params), extras, mutable

    def merged(variables, train, rng):
        state = nnx.merge(graphdef, nn.unbox(variables["params"]),
                          variables.get(fp8.COLLECTION, nnx.to_pure_dict(meta)),
                          nnx.to_pure_dict(streams),
                          variables.get("nnx", nnx.to_pure_dict(rest)))
        state.train() if train else state.eval()
        if rng is not None and train and hasattr(nnx, "reseed"):
            # A model with a 'dropout' stream: this step's (and shard's) key.
            with contextlib.suppress(KeyError, ValueError, AttributeError):
                nnx.reseed(state, dropout=rng)
        return state

    def apply(variables, inputs, train, rng, mutable):
        state = merged(variables, train, rng)
        outputs = state(inputs, **train_kwargs(train))
        if not (mutable and train):
            return outputs, {}
        *_, new_rest = nnx.split(state, nnx.Param, fp8.Fp8Meta, nnx.RngState, ...)
        return outputs, {"nnx": nnx.to_pure_dict(new_rest)}

    def activations(variables, inputs, train, rng, mutable, reduce):
        del mutable  # the extra forward pass's state updates are dropped
        return tensor_stats_module.nnx_activations(merged(variables, train, rng), inputs,
                                                   reduce=reduce, **train_kwargs(train))

    return _Model(init, apply, activations)


def _function(fn: Callable, mp: MixedPrecision, params: Any,
              init_params: Callable | None) -> _Model:
    if (params is None) == (init_params is None):
        raise ValueError(
            "jamp.boost of a plain function needs its parameters: pass params=<pytree> (or "
            "init_params=lambda rng, inputs: <pytree>), e.g. for Equinox "
            "params, static = eqx.partition(model, eqx.is_array) and "
            "fn = lambda p, x: eqx.combine(p, static)(x).")
    run = autocast(fn, mp)
    names = _signature_names(fn)
    takes_rng = next((n for n in ("rng", "key") if n in names), None)
    train_kwargs = _train_kwargs(fn)

    def init(rng, inputs):
        tree = init_params(rng, inputs) if params is None else params
        return mp.policy.cast_to_param(tree), {}, {}

    def call_kwargs(train, rng):
        kwargs = train_kwargs(train)
        if takes_rng and rng is not None:
            kwargs[takes_rng] = rng
        return kwargs

    def apply(variables, inputs, train, rng, mutable):
        del mutable
        return run(variables["params"], inputs, **call_kwargs(train, rng)), {}

    def activations(variables, inputs, train, rng, mutable, reduce):
        del mutable
        return function_activations(run, variables["params"], inputs, reduce=reduce,
                                    **call_kwargs(train, rng))

    return _Model(init, apply, activations, scanned=(FUNCTION_SCAN,))


def _signature_names(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _adapter(model: Any, mp: MixedPrecision, params: Any, init_params: Callable | None
             ) -> _Model:
    if isinstance(model, nn.Module):
        return _linen(model, mp)
    if isinstance(model, nnx.Module):
        return _nnx(model, mp)
    if callable(model):
        return _function(model, mp, params, init_params)
    raise TypeError(
        f"jamp.boost takes a flax.linen.Module, a flax.nnx.Module or a function "
        f"fn(params, inputs) (with params=...), not {type(model).__name__}.")


def _getter(key: Key, what: str) -> Callable[[Any], Any]:
    if callable(key):
        return key

    def get(batch):
        try:
            return batch[key]
        except (KeyError, IndexError, TypeError):
            raise ValueError(
                f"jamp.boost reads the {what} as batch[{key!r}], and this batch has no such "
                f"entry ({_describe(batch)}). Pass {what}=<key, index or function of the "
                f"batch>, e.g. {what}='image' for a dict batch.") from None

    return get


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"keys {sorted(batch)}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return type(batch).__name__


def _loss_and_metrics(out: Any) -> tuple[jax.Array, dict[str, Any]]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], dict(out[1])
    return out, {}


def _as_mesh(mesh: Any) -> jax.sharding.Mesh | None:
    if mesh is None:
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        if zero.DATA not in mesh.axis_names:
            raise ValueError(f"jamp.boost's mesh needs a {zero.DATA!r} axis (the batch is split "
                             f"over it); this one has {mesh.axis_names}. Use "
                             "jamp.parallel.make_mesh({'data': -1, 'model': 1}).")
        return mesh
    if isinstance(mesh, Mapping):
        return parallel.make_mesh(mesh)
    raise TypeError(f"mesh={mesh!r}: pass None (one device), a dict of axis sizes such as "
                    "{'data': -1} or {'data': 4, 'model': 2}, or a jax.sharding.Mesh.")


_CONSTANT_CARRY = (
    "This model runs a lax.scan (e.g. flax's nn.RNN) whose initial carry is built from "
    "constants, and on a mesh whose 'data' axis has several devices jamp.boost differentiates "
    "each shard inside jax.shard_map, where such a carry must vary over 'data' like the batch "
    "(JAX's scan-vma rule). Build the carry from the inputs (e.g. "
    "cell.initialize_carry(...) + 0 * x[:, 0, :1]), or pass an initial carry that is, or run "
    "with mesh=None / a 'data' axis of 1 device.")


@dataclasses.dataclass(frozen=True)
class Boosted:
    """What :func:`jamp.boost` returns: init, a train and an eval step, save and restore.

    Attributes:
      precision: the mixed-precision recipe in force.
      mesh: the device mesh (None: one device, plain ``jax.jit``).
      zero_stage: the ZeRO stage over the mesh's 'data' axis.
      accumulate: micro-batches per optimizer step.
      log_dir: where :meth:`log` writes (None: nowhere).

    Example: see the module docstring.
    """

    precision: MixedPrecision
    mesh: jax.sharding.Mesh | None
    zero_stage: int
    accumulate: int
    log_num_zeros_in_grad: bool
    model: _Model
    optimizer: optax.GradientTransformation
    loss_fn: Callable
    inputs: Callable[[Any], Any]
    targets: Callable[[Any], Any]
    seed: int
    tensor_stats: tensor_stats_module.Collector | None = None
    log_dir: str | None = None
    _built: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    _writer: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    """:meth:`log`'s open ``MetricsWriter`` and the step it holds back."""

    # ------------------------------------------------------------------ state

    def _create(self, rng: jax.Array, inputs: Any) -> train_state.TrainState:
        params, extras, mutable = self.model.init(rng, inputs)
        apply_fn = self.model.apply
        if mutable:
            if extras:
                raise ValueError(
                    "jamp.boost does not combine mode 'fp8' (delayed scaling, with state) with "
                    f"a model that has mutable collections ({sorted(mutable)}): use "
                    "mixed_precision='fp8_current' (no state).")
            return StatefulTrainState.create(apply_fn=apply_fn, params=params,
                                             tx=self.optimizer, model_state=mutable)
        if not isinstance(params, Mapping):  # e.g. an Equinox model's arrays
            return PytreeTrainState.create(apply_fn=apply_fn, params=params, tx=self.optimizer)
        if self.precision.fp8 is not None:
            return self.precision.fp8.strategy.create_train_state(
                apply_fn=apply_fn, params=params, tx=self.optimizer, variables=extras)
        return train_state.TrainState.create(apply_fn=apply_fn, params=params,
                                             tx=self.optimizer)

    def _build(self, batch: Any) -> dict[str, Any]:
        """Shapes, shardings, the ZeRO plan and the jitted steps, from the first batch."""
        if self._built:
            return self._built
        inputs = _abstract(self.inputs(batch))
        one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype),
                                     inputs)
        key = jax.random.key(self.seed)
        create = lambda rng: self._create(rng, _zeros(one))
        with _context(self.mesh):
            boxed = jax.eval_shape(create, key)
        abstract = nn.unbox(boxed)
        built: dict[str, Any] = {"create": create}
        shardings, batch_sharding, plan = None, None, None
        if self.mesh is not None:
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), self.mesh,
                                                    parallel.LOGICAL_AXIS_RULES)
            shardings = zero.state_shardings(shardings, abstract, self.zero_stage)
            batch_sharding = parallel.batch_sharding(self.mesh)
            plan = self._plan(abstract, shardings, inputs) if self.zero_stage else None
        built["step"] = assemble_step(
            lambda state, variables, batch, rng: self._forward_loss(state, variables, batch,
                                                                    rng, True),
            mesh=self.mesh, shardings=shardings, plan=plan, accumulate=self.accumulate,
            max_leaves=combined_by_max(abstract),
            log_num_zeros_in_grad=self.log_num_zeros_in_grad, finish=_keep_model_state,
            tensor_stats=self._collector())
        if shardings is not None:
            abstract = jax.tree_util.tree_map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                shardings)
        built.update(abstract=abstract, shardings=shardings, batch_sharding=batch_sharding,
                     plan=plan)
        built["eval"] = jax.jit(self._eval)
        built["init"] = jax.jit(lambda r: nn.unbox(create(r)), out_shardings=shardings)
        self._built.update(built)
        return self._built

    def _collector(self) -> tensor_stats_module.Collector | None:
        """The statistics collector, with this model's activations (where it has them)."""
        c = self.tensor_stats
        if c is None or c.activations is not None or self.model.activations is None:
            return c
        if not c.every:  # skip reasons only: the gradient search, no extra forward pass
            return c

        def activations(state, variables, batch, rng, reduce):
            mutable = getattr(state, "model_state", {})
            return self.model.activations({**variables, **mutable}, self.inputs(batch), True,
                                          rng, mutable, reduce)

        scanned = tuple(dict.fromkeys((*c.scanned, *self.model.scanned)))
        collector = dataclasses.replace(c, activations=activations, scanned=scanned)
        object.__setattr__(self, "tensor_stats", collector)  # rows recorded on this one
        return collector

    def explain(self, metrics: Mapping[str, Any]) -> str | None:
        """Why the step of ``metrics`` was skipped (or its loss non-finite), in words; None
        for a finite step (:func:`jamp.tensor_stats.explain`).

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
          >>> b = jamp.boost(nn.Dense(1), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2),
          ...                "fp16")
          >>> batch = (jnp.full((4, 2), jnp.inf), jnp.ones((4, 1)))
          >>> state, m = b.step(b.init(jax.random.key(0), batch), batch)
          >>> b.explain(jax.device_get(m))
          'inf in the gradient of bias (element (0,); 1 more non-finite)'
        """
        if self.tensor_stats is None:
            return None
        shardings = self._built.get("shardings")
        if shardings is not None:
            shardings = jax.tree_util.tree_leaves(shardings.params)
        return self.tensor_stats.explain(metrics, shardings)

    def stats_table(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``{group: {layer: {statistic: value}}}`` of a step that collected statistics
        (``metrics["tensor_stats_collected"]``; :func:`jamp.tensor_stats.table`).

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
          >>> b = jamp.boost(nn.Dense(1), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2),
          ...                tensor_stats=1)
          >>> batch = (jnp.ones((4, 2)), jnp.ones((4, 1)))
          >>> state, m = b.step(b.init(jax.random.key(0), batch), batch)
          >>> sorted(b.stats_table(jax.device_get(m)))
          ['activations', 'grads', 'params']
        """
        return tensor_stats_module.table(metrics, {} if self.tensor_stats is None
                                  else self.tensor_stats.rows)

    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "train/") -> None:
        """Writes a step's ``metrics`` to ``log_dir`` as the trainer does: ``metrics.jsonl``
        and TensorBoard (:mod:`jamp.boost_log`).

        Each step: the scalars (``train/loss``, ``train/loss_scale``,
        ``train/steps_skipped``, ``train/grad_norm``, the loss function's metrics); a
        skipped step: ``train/skip_reasons`` (:meth:`explain`, also TensorBoard text); a step
        that collected statistics: ``tensor_stats.jsonl``, per-layer scalars and histograms.
        Only that is fetched from the device.

        A call holds its metrics and writes the previous call's, which are ready by then:
        the fetch does not wait for the step just dispatched, so logging every step keeps
        the device busy. :meth:`close` (or the interpreter's exit) writes the last one.
        Nothing happens without ``log_dir`` or on a process other than 0. An existing
        ``log_dir`` is appended to.

        Args:
          step: the step number (>= 0), e.g. the loop's counter.
          metrics: what :meth:`step` (or :meth:`eval_step`) returned.
          prefix: put before each name; ``"eval/"`` for :meth:`eval_step`'s metrics.

        Raises:
          ValueError / TypeError: a negative or non-integer step, metrics that are not a
            step's (a non-scalar value).

        Example:
          >>> import tempfile, jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
          >>> from jamp.metrics import read_metrics
          >>> log_dir = tempfile.mkdtemp()
          >>> b = jamp.boost(nn.Dense(1), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2),
          ...                jamp.mixed_precision("fp16", init_scale=1024.0), log_dir=log_dir)
          >>> batch = (jnp.ones((4, 2)), jnp.ones((4, 1)))
          >>> state, metrics = b.step(b.init(jax.random.key(0), batch), batch)
          >>> b.log(1, metrics)
          >>> b.close()
          >>> read_metrics(log_dir)[0]["train/loss_scale"]
          1024.0
        """
        step = boost_log.check_step(step)  # on every process; a refused call opens nothing
        boost_log.check_metrics(metrics, prefix)
        if self.log_dir is None or jax.process_index() != 0:
            return
        if "writer" not in self._writer:
            self._writer["writer"] = MetricsWriter(self.log_dir)
            atexit.register(self.close)  # the last held-back step, if close() is forgotten
        self._write_pending()
        self._writer["pending"] = (step, dict(metrics), prefix)

    def _write_pending(self) -> None:
        """Writes the metrics the last :meth:`log` call held back, if any."""
        pending = self._writer.pop("pending", None)
        if pending is None:
            return
        shardings = self._built.get("shardings")
        if shardings is not None:
            shardings = jax.tree_util.tree_leaves(shardings.params)
        step, metrics, prefix = pending
        boost_log.write_step(self._writer["writer"], step, metrics,
                             collector=self.tensor_stats, shardings=shardings, prefix=prefix)

    def close(self) -> None:
        """Writes what :meth:`log` held back, then flushes and closes its files (a later
        :meth:`log` appends to them).

        Example: see :meth:`log`.
        """
        writer = self._writer.get("writer")
        if writer is None:
            return
        atexit.unregister(self.close)
        try:
            self._write_pending()
        finally:
            self._writer.pop("writer").close()

    def _plan(self, abstract: Any, shardings: Any, inputs: Any) -> zero.Plan:
        params = abstract.params
        specs = jax.tree_util.tree_map(lambda s: zero.without_data(s.spec), shardings.params)
        extras = differentiated_variables(abstract)
        read = None
        if self.zero_stage == 3:
            plain = lambda tree: jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
            forward = lambda p, x, e: self.model.apply({"params": p, **e}, x, False, None, {})[0]
            readable = {**extras, **getattr(abstract, "model_state", {})}  # e.g. batch_stats
            with _context(self.mesh):
                read = read_dtypes(forward, plain(params), inputs, plain(readable))
        return zero.make_plan(self.zero_stage, params, self.mesh, specs, read_dtypes=read,
                              beside=extras)

    # ------------------------------------------------------------------ public

    @property
    def batch_sharding(self) -> jax.sharding.NamedSharding | None:
        """How :meth:`step` lays out a batch: its leading axis over 'data' (None: one device).

        ``step`` places host arrays with it. In a multi-process run pass global arrays
        instead: ``jax.make_array_from_process_local_data(boosted.batch_sharding, local)``.

        Example:
          >>> import flax.linen as nn, optax, jamp
          >>> jamp.boost(nn.Dense(1), optax.sgd(0.1), lambda y, t: y.mean()).batch_sharding is None
          True
        """
        return None if self.mesh is None else parallel.batch_sharding(self.mesh)

    def init(self, rng: jax.Array, batch: Any) -> train_state.TrainState:
        """The initial state for batches shaped like ``batch``, created sharded.

        Example: see the module docstring.
        """
        self._check_batch(batch)
        built = self._build(batch)
        with _context(self.mesh):
            return built["init"](rng)

    def step(self, state: train_state.TrainState, batch: Any,
             rng: jax.Array | None = None) -> tuple[train_state.TrainState, dict[str, Any]]:
        """One loss-scaled step; ``state`` is donated. ``rng``: the dropout key (default:
        the boost seed folded with ``state.step``).

        Example: see the module docstring.
        """
        self._check_batch(batch)
        built = self._build(batch)
        if rng is None:
            rng = jax.random.fold_in(jax.random.key(self.seed), state.step)
        with _context(self.mesh):
            if built["batch_sharding"] is not None:
                batch = jax.device_put(batch, built["batch_sharding"])
            try:
                return built["step"](state, batch, rng)
            except (ValueError, TypeError) as e:
                if "manual axis types do not match" not in str(e):
                    raise
                raise ValueError(_CONSTANT_CARRY) from None

    def eval_step(self, state: train_state.TrainState, batch: Any) -> dict[str, Any]:
        """The loss (and ``loss_fn``'s metrics) on ``batch``, without dropout.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
          >>> b = jamp.boost(nn.Dense(1), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2))
          >>> batch = (jnp.ones((4, 2)), jnp.ones((4, 1)))
          >>> sorted(b.eval_step(b.init(jax.random.key(0), batch), batch))
          ['loss']
        """
        built = self._build(batch)
        with _context(self.mesh):
            return built["eval"](state, batch)

    def save(self, directory: str | os.PathLike, state: train_state.TrainState) -> None:
        """Writes the whole state (params, optimizer, loss scale, master copy, fp8 and model
        state, step) to ``directory`` with orbax; an existing checkpoint there is replaced.

        Example:
          >>> import tempfile, jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
          >>> b = jamp.boost(nn.Dense(1), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2),
          ...                jamp.mixed_precision("fp16", init_scale=1024.0))
          >>> batch = (jnp.ones((4, 2)), jnp.ones((4, 1)))
          >>> state, _ = b.step(b.init(jax.random.key(0), batch), batch)
          >>> path = tempfile.mkdtemp() + "/ckpt"
          >>> b.save(path, state)
          >>> int(b.restore(path).step), float(jamp.loss_scale(b.restore(path).opt_state))
          (1, 1024.0)
        """
        path = os.path.abspath(os.fspath(directory))
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, state, force=True)
            checkpointer.wait_until_finished()

    def restore(self, directory: str | os.PathLike) -> train_state.TrainState:
        """The state saved in ``directory``, placed with this boost's shardings.

        Call :meth:`init` (or :meth:`step`) once first: the first batch fixes the
        state's shapes.

        Raises:
          ValueError: nothing is built yet, or the checkpoint is missing or holds
            another model's state (shapes differ).

        Example: see :meth:`save`.
        """
        if not self._built:
            raise ValueError("Boosted.restore needs the state's shapes: call "
                             "boosted.init(rng, batch) first (its result can be discarded).")
        path = os.path.abspath(os.fspath(directory))
        if not os.path.isdir(path):
            raise ValueError(f"No checkpoint at {path}: save one with boosted.save(path, state).")
        abstract = self._built["abstract"]
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                return checkpointer.restore(path, abstract)
        except (ValueError, KeyError, TypeError) as e:
            try:
                with ocp.StandardCheckpointer() as checkpointer:
                    saved = getattr(checkpointer.metadata(path), "item_metadata", None)
            except Exception:  # noqa: BLE001  (no readable metadata: the general message)
                saved = None
            mismatch = saved is not None and optim_state.checkpoint_mismatch(abstract, saved)
            if mismatch:
                raise ValueError(f"{mismatch} ({path})") from None
            raise ValueError(
                f"The checkpoint at {path} does not fit this model, optimizer and precision "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Restore it with the "
                "jamp.boost arguments it was saved with.") from None

    # ------------------------------------------------------------------ the steps

    def _check_batch(self, batch: Any) -> None:
        inputs = self.inputs(batch)
        leaves = jax.tree_util.tree_leaves(inputs)
        if not leaves or jnp.ndim(leaves[0]) == 0:
            raise ValueError("jamp.boost needs batched inputs: every input leaf with the batch "
                             "as its leading axis.")
        size = jnp.shape(leaves[0])[0]
        shards = 1 if self.mesh is None else self.mesh.shape[zero.DATA]
        if size % (shards * self.accumulate):
            split = shards * self.accumulate
            raise ValueError(
                f"A batch of {size} examples cannot be split into {shards} 'data' shard(s) x "
                f"{self.accumulate} accumulated micro-batch(es) = {split}: use a batch that is "
                f"a multiple of {split} (e.g. {max(split, size // split * split)}) or change "
                "accumulate= / the mesh.")

    def _forward_loss(self, state: Any, variables: dict[str, Any], batch: Any,
                      rng: jax.Array | None, train: bool) -> tuple[jax.Array, dict[str, Any]]:
        mutable = getattr(state, "model_state", {})
        outputs, new_state = self.model.apply({**variables, **mutable}, self.inputs(batch),
                                              train, rng, mutable)
        loss, metrics = _loss_and_metrics(self.loss_fn(outputs, self.targets(batch)))
        if mutable and train:
            metrics["_model_state"] = new_state
        return jnp.asarray(loss), metrics

    def _eval(self, state: Any, batch: Any) -> dict[str, Any]:
        variables = {"params": state.params, **differentiated_variables(state)}
        loss, metrics = self._forward_loss(state, variables, batch, None, False)
        return {"loss": loss, **metrics}


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                                  tree)


def _zeros(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _keep_model_state(before: Any, state: Any, metrics: dict[str, Any]
                      ) -> tuple[Any, dict[str, Any]]:
    """The step's new mutable collections for an applied step; bit-identical for a skip."""
    new_model_state = metrics.pop("_model_state", None)
    if new_model_state is not None:
        state = state.replace(model_state=optax.tree_utils.tree_where(
            metrics["grad_finite"], new_model_state, before.model_state))
    return state, metrics


@contextlib.contextmanager
def _context(mesh: jax.sharding.Mesh | None) -> Iterator[None]:
    """``jax.set_mesh(mesh)`` and jamp's logical axis rules; nothing without a mesh."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        yield


def gradient_function(*, mesh: jax.sharding.Mesh | None = None, plan: zero.Plan | None = None,
                      accumulate: int = 1, max_leaves: Any = None, param_specs: Any = None,
                      pipelined: bool = False) -> ValueAndGrad:
    """How :func:`assemble_step` differentiates: on ``mesh`` (data-parallel in float32, the
    ZeRO ``plan``, a pipeline over 'pipe' when ``pipelined``:
    :func:`jamp.parallel.step.value_and_grad`), or on one device
    (:func:`jamp.grad_accum.value_and_grad`); ``accumulate`` micro-batches either way.

    Example:
      >>> import jax.numpy as jnp
      >>> f = gradient_function(accumulate=2)(lambda w, b: (jnp.mean(b @ w), {}))
      >>> (value, _), grads = f(jnp.ones(2), jnp.ones((4, 2)))
      >>> float(value), grads.tolist()
      (2.0, [1.0, 1.0])
    """
    if mesh is None:
        return lambda fun: grad_accum.value_and_grad(fun, accumulate, max_leaves)
    return parallel.step.value_and_grad(param_specs, pipelined=pipelined, plan=plan,
                                        accumulate=accumulate, max_leaves=max_leaves)


def assemble_step(
    loss_fn: Callable[..., tuple[jax.Array, dict[str, Any]]],
    *,
    mesh: jax.sharding.Mesh | None = None,
    shardings: Any = None,
    plan: zero.Plan | None = None,
    accumulate: int = 1,
    max_leaves: Any = None,
    param_specs: Any = None,
    pipelined: bool = False,
    log_num_zeros_in_grad: bool = False,
    finish: Callable[[Any, Any, dict[str, Any]], tuple[Any, dict[str, Any]]] | None = None,
    tensor_stats: Any = None,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """The jitted train step: the one place jamp assembles one (:func:`boost` and ``jamp.train``).

    ``loss_fn(state, variables, batch, rng) -> (loss, metrics)`` gives the unscaled
    mean loss; the step scales it, differentiates it on ``mesh`` (data-parallel in
    float32, ZeRO ``plan``, ``accumulate`` micro-batches, a pipeline over 'pipe'
    when ``pipelined``: :func:`jamp.parallel.step.value_and_grad`; one device with
    :func:`jamp.grad_accum.value_and_grad` when ``mesh`` is None), applies the update
    through the state's loss-scaled optimizer (:func:`jamp.step.loss_scaled_step`),
    then calls ``finish(state_before, state_after, metrics)`` if given; a ``tensor_stats``
    :class:`jamp.tensor_stats.Collector` adds per-layer statistics and skip reasons. The state is
    donated; on a mesh it is laid out as ``shardings`` says and the batch over 'data'.
    Call the result under ``jax.set_mesh(mesh)`` and jamp's logical axis rules.

    Returns:
      ``step(state, batch, rng) -> (state, metrics)``; metrics as
      :func:`jamp.step.loss_scaled_step`'s, plus ``skipped``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> from jamp.booster import assemble_step
      >>> state = jamp.step.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
      ...                                     tx=jamp.make_optimizer("fp16", optax.sgd(0.1)))
      >>> loss = lambda s, v, b, r: (jnp.mean(b @ v["params"]["w"]), {})
      >>> step = assemble_step(loss, accumulate=2)
      >>> state, metrics = step(state, jnp.ones((4, 2)), None)
      >>> float(metrics["loss"]), bool(metrics["skipped"])
      (2.0, False)
    """
    value_and_grad = gradient_function(mesh=mesh, plan=plan, accumulate=accumulate,
                                       max_leaves=max_leaves, param_specs=param_specs,
                                       pipelined=pipelined)

    def step(state, batch, rng):
        new, metrics = loss_scaled_step(state, batch, rng,
                                        lambda v, b, r: loss_fn(state, v, b, r), value_and_grad,
                                        log_num_zeros_in_grad=log_num_zeros_in_grad,
                                        tensor_stats=tensor_stats)
        if finish is not None:
            new, metrics = finish(state, new, metrics)
        metrics["skipped"] = ~metrics["grad_finite"]
        return new, metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=(0,))
    return jax.jit(step, in_shardings=(shardings, parallel.batch_sharding(mesh), None),
                   out_shardings=(shardings, None), donate_argnums=(0,))


def boost(
    model: Any,
    optimizer: optax.GradientTransformation,
    loss_fn: Callable[[Any, Any], Any],
    mixed_precision: Any = "fp32",
    *,
    mesh: Any = None,
    zero_stage: int = 0,
    accumulate: int = 1,
    inputs: Key = 0,
    targets: Key = 1,
    log_num_zeros_in_grad: bool = False,
    params: Any = None,
    init_params: Callable | None = None,
    seed: int = 0,
    tensor_stats: int | tensor_stats_module.Collector = 0,
    log_dir: str | os.PathLike | None = None,
) -> Boosted:
    """Colossal-AI's ``Booster(...).boost(model, optimizer, criterion)`` for JAX.

    Args:
      model: a ``flax.linen.Module`` (the policy is applied unless it is a
        ``jamp.apply_policy`` result already), a ``flax.nnx.Module`` (the policy is
        applied to it in place; its non-parameter state, e.g. batch statistics and
        RNG counts, is carried in ``state.model_state``), or a function
        ``fn(params, inputs)`` run under :func:`jamp.autocast` (give ``params=`` or
        ``init_params=``; for Equinox, ``params, static = eqx.partition(model,
        eqx.is_array)`` and ``fn = lambda p, x: eqx.combine(p, static)(x)``). A model
        whose ``__call__`` takes ``train``, ``training``, ``is_training`` or
        ``deterministic`` gets it set (a function: also ``rng``/``key``, the dropout key).
      optimizer: any optax optimizer; the mode's loss scale (and master weights)
        wrap it (:func:`jamp.make_optimizer`).
      loss_fn: ``loss_fn(outputs, targets) -> loss`` (a scalar mean) or
        ``-> (loss, {name: scalar})``, computed in float32 as you write it.
      mixed_precision: a mode or alias (``"fp16"``, ``"bf16"``, ``"fp16_naive"``,
        ``"O2"``, ``"16-mixed"``, ...) or a :func:`jamp.mixed_precision` recipe.
      mesh: None (one device), a dict of axis sizes (``{"data": -1}``,
        ``{"data": 4, "model": 2}``) or a ``jax.sharding.Mesh`` with a 'data' axis.
        The batch is split over 'data'; gradients are all-reduced (or
        reduce-scattered) in float32; one overflow decision covers every device.
      zero_stage: 0-3, over 'data' (:mod:`jamp.parallel.zero`): 1 splits the
        optimizer state and master copy, 2 also the gradients, 3 also the params.
      accumulate: micro-batches per optimizer step (:mod:`jamp.grad_accum`): a
        ``lax.scan``, float32 sums, one loss scale and one overflow decision per
        window, one reduction per window.
      inputs, targets: where the batch holds the model's inputs and the loss's
        targets: a dict key, a tuple index or a function (default: ``(x, y)`` tuples).
      log_num_zeros_in_grad: add ``num_zeros_in_grad`` to the step's metrics (also on when
        the precision says so: Colossal-AI's naive ``fp16=dict(..., log_num_zeros_in_grad=True)``).
      params, init_params: a plain function's parameters, or ``init_params(rng,
        inputs)`` making them.
      seed: the default dropout key's seed (folded with the step).
      tensor_stats: per-layer statistics (:mod:`jamp.tensor_stats`) every this many steps
        (gradients, parameters and every layer's output: a function's matmuls and
        convolutions, :mod:`jamp.function_activations`), read with
        :meth:`Boosted.stats_table`; 0: none. Either way a skipped step's gradients are
        searched for the first non-finite leaf (:meth:`Boosted.explain`). A
        :class:`jamp.tensor_stats.Collector` sets every detail.
      log_dir: where :meth:`Boosted.log` writes ``metrics.jsonl``, TensorBoard events
        (``tensorboard/``) and ``tensor_stats.jsonl``, from process 0; created if missing,
        appended to if not. None: ``log`` writes nothing.

    Returns:
      A :class:`Boosted`: ``init(rng, batch)``, ``step(state, batch)``,
      ``eval_step(state, batch)``, ``log(step, metrics)``, ``save(dir, state)``,
      ``restore(dir)``.

    Raises:
      ValueError / TypeError: one message naming the fix, for an unknown model kind,
        mode, mesh, ZeRO stage or accumulation count, or a ``log_dir`` that is a file or
        cannot be written, before anything is traced.

    Example: see the module docstring.
    """
    mp = to_mixed_precision(mixed_precision)
    stage = zero.check_stage(zero_stage)
    accumulate = grad_accum.check_steps(accumulate)
    the_mesh = _as_mesh(mesh)
    if stage and the_mesh is None:
        raise ValueError(
            f"zero_stage={stage} splits state over the mesh's 'data' axis, and no mesh was "
            "given: pass mesh={'data': -1} (every device; on a CPU start Python with "
            f"{parallel.CPU_DEVICES_FLAG} for 8 devices).")
    unsplit = parallel.zero_splits_nothing(stage, the_mesh, "mesh={'data': -1}")
    if unsplit:
        warnings.warn(unsplit, UserWarning, stacklevel=2)
    if not isinstance(optimizer, optax.GradientTransformation) and not (
            hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"optimizer must be an optax GradientTransformation, e.g. "
                        f"optax.adamw(1e-3); got {type(optimizer).__name__}.")
    adapter = _adapter(model, mp, params, init_params)
    log_dir = boost_log.check_log_dir(log_dir)
    zeros = bool(log_num_zeros_in_grad) or mp.log_num_zeros_in_grad  # the seed's naive key
    collector = tensor_stats
    if not isinstance(collector, tensor_stats_module.Collector):
        collector = tensor_stats_module.Collector(
            every=collector, compute_dtype=mp.policy.compute_dtype or jnp.float32)
    return Boosted(mp, the_mesh, stage, accumulate, zeros, adapter,
                   make_optimizer(mp, optimizer, seed=seed), loss_fn, _getter(inputs, "inputs"),
                   _getter(targets, "targets"), seed, collector, log_dir)
