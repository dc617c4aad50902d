"""Training throughput, memory and MFU of a jamp ViT per precision mode.

For each mode, builds ``jamp.apply_policy(vit.create(...), mode)`` with AdamW
wrapped by ``jamp.make_optimizer`` (the mode's loss scale, master weights),
places a synthetic batch on the device (no input pipeline), compiles
``jamp.train_step`` with the train state donated, runs warm-up steps, then times
steps one by one with ``block_until_ready``. Reports per mode:

- images/s from the median step time (and the p10/p90 step times);
- peak device memory from ``device.memory_stats()`` (GPU/TPU; ``None`` on CPU).
  The allocator's peak covers the whole process, so for one figure per mode run
  one mode per process (``run_all`` does);
- the compiled step's XLA memory analysis (arguments + outputs - aliased + temps);
- the JAX-level memory report (``jamp.memory_report``: params, grads, optimizer
  state, residuals, activations);
- MFU: analytic training FLOPs per image (``sizes.train_flops_per_image``)
  times images/s over the device's dense bf16/fp16 peak (known GPUs only);
- with ``--max-batch``: the largest batch (multiple of 8) whose compiled step
  fits the device's memory limit, from XLA's compile-time memory analysis
  (two compiles give bytes per example, the search starts at the predicted
  batch), then confirmed by running two steps (GPU; on CPU only with an explicit
  ``--memory-limit-gib``, without the confirmation, else ``None``).

XLA:CPU computes float16/bfloat16 by upcasting to float32, so CPU runs show
that the pipeline works, not what half precision gains.

Usage::

  python -m benchmarks.throughput                                   # ViT-B/16, 224px, batch 128
  python -m benchmarks.throughput --variant ti16 --image-size 64 --batch 8 --steps 5 \\
      --modes fp32,bf16 --json /tmp/tp.json
  python -m benchmarks.throughput --modes bf16 --max-batch --remat
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import jamp
from benchmarks import common
from jamp.models import sizes, vit
from jamp.step import cross_entropy


def build_model(mode: str | jamp.MixedPrecision, args: argparse.Namespace) -> nn.Module:
    """The ViT of ``args`` (``variant``, ``patch_size``, ``num_classes``...) under a mode's policy.

    Example:
      >>> args = parse_args(["--variant", "ti4", "--num-layers", "1"])
      >>> build_model("bf16", args).inner.num_layers
      1
    """
    layers = {"num_layers": args.num_layers} if args.num_layers else {}
    return jamp.apply_policy(vit.create(args.variant, num_classes=args.num_classes,
                                        patch_size=args.patch_size or 16, remat=args.remat,
                                        **layers), mode)


def loss_fn(model: nn.Module,
            collections: dict[str, Any] | None = None) -> Callable[[Any, jax.Array, jax.Array],
                                                                  jax.Array]:
    """``loss(params, images, labels)``: the float32 cross-entropy of a train-mode forward pass.

    ``collections``: other variables the forward pass reads (mode "fp8": the
    delayed-scaling state).

    Example:
      >>> model = build_model("fp32", parse_args(["--variant", "ti4", "--num-layers", "1",
      ...                                         "--num-classes", "3"]))
      >>> x, y = jnp.zeros((2, 8, 8, 3)), jnp.array([0, 1])
      >>> params = nn.unbox(model.init(jax.random.key(0), x))["params"]
      >>> round(float(loss_fn(model)(params, x, y)), 4)  # zero-initialised head: ln 3
      1.0986
    """

    def loss(params: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        return cross_entropy(model.apply({"params": params, **(collections or {})}, images,
                                         train=True), labels)

    return loss


def model_and_init(mode: str, args: argparse.Namespace) -> tuple[nn.Module, Callable]:
    """The policy-wrapped ViT and ``create(rng) -> TrainState`` (AdamW wrapped for the mode)."""
    mp = jamp.mixed_precision(mode)
    model = build_model(mp, args)
    tx = jamp.make_optimizer(mp, optax.adamw(args.learning_rate, weight_decay=0.05))
    image = jnp.zeros((1, args.image_size, args.image_size, 3), jnp.float32)

    def create(rng):
        variables = nn.unbox(model.init(rng, image))
        if mp.fp8 is not None and mp.fp8.scaling == "delayed":  # state beside the params
            return jamp.fp8.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                              tx=tx, fp8=variables[jamp.fp8.COLLECTION])
        return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                             tx=tx)

    return model, create


def build_state(mode: str, args: argparse.Namespace) -> tuple[nn.Module, train_state.TrainState]:
    """The policy-wrapped ViT and its train state, initialised on the device."""
    model, create = model_and_init(mode, args)
    return model, jax.jit(create)(jax.random.key(0))


def abstract_state(mode: str, args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The policy-wrapped ViT and its train state as shapes only (nothing allocated)."""
    model, create = model_and_init(mode, args)
    return model, jax.eval_shape(create, jax.random.key(0))


def synthetic_batch(args: argparse.Namespace, batch: int) -> dict[str, jax.Array]:
    """Random images and labels, created on the device."""
    kx, ky = jax.random.split(jax.random.key(1))
    shape = (batch, args.image_size, args.image_size, 3)
    return {"image": jax.random.normal(kx, shape, jnp.float32),
            "label": jax.random.randint(ky, (batch,), 0, args.num_classes)}


def _step_fn(state, batch, rng):
    return jamp.train_step(state, batch, rng)


def _avals(tree: Any) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(tree)]


def compile_step(state: Any, batch: Any, donate: bool) -> Any:
    """Lowers and compiles the train step for these (possibly abstract) arguments."""
    fn = jax.jit(_step_fn, donate_argnums=(0,) if donate else ())
    return fn.lower(state, batch, jax.random.key(2)).compile()


def compiled_bytes(compiled: Any) -> int | None:
    """Device bytes of a compiled step from XLA's memory analysis (None if unavailable)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def jax_memory(model: nn.Module, state: train_state.TrainState,
               args: argparse.Namespace) -> jamp.MemoryReport:
    """``jamp.memory_report`` of one step at the benchmark's batch (shapes only)."""
    images = jax.ShapeDtypeStruct((args.batch, args.image_size, args.image_size, 3), jnp.float32)
    labels = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
    abstract = lambda t: jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
    fp8_state = getattr(state, "fp8", None) or None
    collections = None if fp8_state is None else {jamp.fp8.COLLECTION: fp8_state}
    model_state = None if fp8_state is None else abstract((state.fp8, state.fp8_pending))
    return jamp.memory_report(loss_fn(model, collections), abstract(state.params), images,
                              labels, opt_state=abstract(state.opt_state),
                              model_state=model_state)


def memory_limit(device: jax.Device, args: argparse.Namespace) -> int | None:
    """Bytes a step may use: ``--memory-limit-gib``, else the allocator's limit (GPU/TPU)."""
    if args.memory_limit_gib is not None:
        return int(args.memory_limit_gib * 2**30)
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit * args.memory_headroom) if limit else None


def max_batch(state: Any, args: argparse.Namespace,
              limit: int) -> tuple[int | None, int]:
    """Largest batch whose compiled step fits ``limit`` bytes; and the compiles it took.

    Compiles (never runs) the step on abstract inputs. Two compiles give the
    bytes per example; the search starts from the batch that predicts.
    """
    abstract_state = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    cache: dict[int, int | None] = {}

    def needed(batch: int) -> int | None:
        if batch not in cache:
            shapes = jax.eval_shape(lambda: synthetic_batch(args, batch))
            try:
                cache[batch] = compiled_bytes(compile_step(abstract_state, shapes, args.donate))
            except Exception as e:  # noqa: BLE001 - XLA reports OOM at compile time variously
                if "memory" not in str(e).lower():
                    raise
                cache[batch] = None
        return cache[batch]

    def fits(batch: int) -> bool:
        nbytes = needed(batch)
        return nbytes is not None and nbytes <= limit

    g = args.max_batch_granularity
    b0, b1 = args.batch, 2 * args.batch
    m0, m1 = needed(b0), needed(b1)
    guess, step = b0, None
    if m0 is not None and m1 is not None and m1 > m0:
        per_example = (m1 - m0) / (b1 - b0)
        guess, step = int((limit - (m0 - per_example * b0)) / per_example), g
    found = common.largest_batch(fits, max(guess, g), granularity=g, step=step)
    return found, len(cache)


def _is_oom(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def runs_at(mode: str, args: argparse.Namespace, batch: int) -> bool:
    """Whether two real train steps at ``batch`` run without running out of device memory."""
    try:
        state = build_state(mode, args)[1]
        data = synthetic_batch(args, batch)
        step = jax.jit(_step_fn, donate_argnums=(0,) if args.donate else ())
        for _ in range(2):
            state, metrics = step(state, data, jax.random.key(2))
            jax.block_until_ready((state, metrics))
        return True
    except Exception as e:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
        if _is_oom(e):
            return False
        raise
    finally:
        state = data = None
        gc.collect()


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Measures one precision mode; returns its row of figures."""
    device = jax.devices()[0]
    model, state = build_state(mode, args)
    batch = synthetic_batch(args, args.batch)
    rng = jax.random.key(2)
    report = jax_memory(model, state, args)
    t0 = time.perf_counter()
    compiled = compile_step(state, batch, args.donate)
    compile_s = time.perf_counter() - t0
    xla_bytes = compiled_bytes(compiled)

    # The first step runs untimed. If it returns a state of other dtypes than it was
    # given (an optimizer state promoted to float32), the step is compiled again for
    # the new state, as jax.jit would do on the second call.
    new_state, metrics = jax.block_until_ready(compiled(state, batch, rng))
    changed = _avals(new_state) != _avals(state)
    if changed:
        compiled = compile_step(new_state, batch, args.donate)
    carry: dict[str, Any] = {"state": new_state, "metrics": metrics}

    def step():
        carry["state"], carry["metrics"] = compiled(carry["state"], batch, rng)
        jax.block_until_ready(carry)

    times = common.time_steps(step, warmup=max(args.warmup - 1, 0), steps=args.steps)
    metrics = jax.device_get(carry["metrics"])
    stats = device.memory_stats() or {}
    flops = sizes.train_flops_per_image(
        args.variant, image_size=args.image_size, patch_size=args.patch_size,
        num_classes=args.num_classes, num_layers=args.num_layers)
    row: dict[str, Any] = dict(
        framework="jamp", mode=mode, batch=args.batch, compile_s=compile_s,
        **common.summarize_times(times, args.batch),
        peak_bytes=stats.get("peak_bytes_in_use"), xla_step_bytes=xla_bytes,
        jax_memory=report.as_dict(), flops_per_image=flops, final_loss=float(metrics["loss"]),
        loss_finite=bool(np.isfinite(metrics["loss"])), steps_skipped=int(metrics["steps_skipped"]),
        loss_scale=float(metrics["loss_scale"]), state_dtypes_changed_after_step1=changed)
    row["mfu"] = common.mfu(row["images_per_sec"], flops, common.peak_tflops(device.device_kind))
    row["max_batch"], row["max_batch_method"] = None, "skipped (--max-batch not given)"
    if args.max_batch:
        limit = memory_limit(device, args)
        if limit is None:
            row["max_batch_method"] = f"n/a on {device.platform} (no memory limit)"
        else:
            del carry, compiled, state, new_state  # free the device for bigger steps
            gc.collect()
            found, n = max_batch(abstract_state(mode, args)[1], args, limit)
            method = f"XLA compile-time memory analysis <= {limit / 2**30:.2f} GiB ({n} compiles)"
            if found and args.memory_limit_gib is None:
                # The analysis does not see fragmentation: confirm by running steps.
                tries = 0
                g = args.max_batch_granularity
                while found and tries < 4 and not runs_at(mode, args, found):
                    found, tries = found - g if found > g else None, tries + 1
                method += f", confirmed by running 2 steps ({tries} step-downs of {g})"
            row["max_batch"], row["max_batch_method"] = found, method
    return row


def device_info() -> dict[str, Any]:
    """The device the benchmark ran on, and the software versions."""
    device = jax.devices()[0]
    return dict(platform=device.platform, device_kind=device.device_kind,
                peak_tflops=common.peak_tflops(device.device_kind),
                jax=jax.__version__, jaxlib=getattr(jax.lib, "__version__", jax.__version__),
                optax=optax.__version__, machine=common.machine())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (see the module docstring).

    Example:
      >>> args = parse_args(["--variant", "s8", "--modes", "O1,bf16"])
      >>> args.patch_size, args.modes
      (8, ['fp16', 'bf16'])
    """
    ap = common.parser(__doc__, json_out=True)
    common.add_vit(ap)
    common.add_timing(ap, steps=20, warmup=3)
    ap.add_argument("--modes", type=common.modes, default=list(jamp.MODES),
                    help="comma-separated, aliases accepted")
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--remat", action="store_true", help="rematerialise each block")
    ap.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True,
                    help="donate the train state to the step (default on)")
    ap.add_argument("--max-batch", action="store_true", help="search the largest batch")
    ap.add_argument("--max-batch-granularity", type=int, default=8,
                    help="the largest batch is searched in multiples of this")
    ap.add_argument("--memory-limit-gib", type=float, default=None,
                    help="limit for --max-batch (default: the device allocator's limit)")
    ap.add_argument("--memory-headroom", type=float, default=1.0,
                    help="fraction of the allocator's limit a step may use")
    args = ap.parse_args(argv)
    args.patch_size = sizes.parse_variant(args.variant, args.patch_size or 16)[1]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints one line per mode; returns (and optionally writes) results."""
    args = parse_args(argv)
    info = device_info()
    print(f"jamp throughput: ViT-{args.variant} {args.image_size}px batch {args.batch} on "
          f"{info['device_kind']} ({info['platform']}), jax {info['jax']}", flush=True)
    rows = []
    for mode in args.modes:
        row = run_mode(mode, args)
        rows.append(row)
        print(f"  {mode:<11} {row['images_per_sec']:9.1f} img/s  step {row['step_ms']:8.1f} ms  "
              f"compile {row['compile_s']:5.1f} s  peak {common.gib(row['peak_bytes'])}  "
              f"XLA step {common.gib(row['xla_step_bytes'])}  "
              f"JAX-level {common.gib(row['jax_memory']['total_bytes'])}  "
              f"MFU {common.fmt(row['mfu'], '.1%')}  max batch {common.fmt(row['max_batch'], 'd')}"
              f"  loss {row['final_loss']:.3f}", flush=True)
    return common.process_result(args, "jamp", info, rows)


if __name__ == "__main__":
    main()
