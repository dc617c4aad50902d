"""Training throughput, memory and MFU of a jamp ViT per precision mode (linen and/or NNX).

Per mode, times ``jamp.train_step`` (train state donated) of
``jamp.apply_policy(vit.create(...), mode)`` with AdamW wrapped by ``jamp.make_optimizer``
on a synthetic device-resident batch, step by step after warm-up; ``--frameworks nnx``
trains the same weights as the NNX ViT (``vit_nnx.from_linen``) through
``jamp.nnx_functional.functional``'s ``apply_fn``. Reports images/s (median, p10/p90), peak device
memory (whole process: ``run_all`` runs one mode per process; ``None`` on CPU), the compiled
step's XLA memory, ``jamp.memory_report``, MFU (known GPUs) and, with ``--max-batch`` (GPU),
the largest batch (multiple of 8) that fits by XLA's compile-time analysis, confirmed by
running it. XLA:CPU upcasts float16/bfloat16: CPU runs check the pipeline, not speed.

Usage::

  python -m benchmarks.throughput                                   # ViT-B/16, 224px, batch 128
  python -m benchmarks.throughput --variant ti16 --image-size 64 --batch 8 --steps 5 \\
      --modes fp32,bf16 --json /tmp/tp.json
  python -m benchmarks.throughput --modes bf16 --max-batch --remat
  python -m benchmarks.throughput --modes bf16 --profile /tmp/trace   # + a profiler trace
  python -m benchmarks.throughput --frameworks linen,nnx --variant ti4 --image-size 32 \\
      --batch 32 --num-layers 4 --num-classes 10 --modes fp32,bf16,fp16   # NNX vs linen
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
from jamp import nnx_functional
from jamp.models import sizes, vit, vit_nnx
from jamp.step import cross_entropy

GRANULARITY = 8
"""The largest batch is searched in multiples of this."""


def build_model(mode: str | jamp.MixedPrecision, args: argparse.Namespace) -> nn.Module:
    """The linen ViT of ``args`` (``variant``, ``patch_size``, ``num_classes``...) under a mode.

    Example:
      >>> args = parse_args(["--variant", "ti4", "--num-layers", "1"])
      >>> build_model("bf16", args).inner.num_layers
      1
    """
    layers = {"num_layers": args.num_layers} if args.num_layers else {}
    return jamp.apply_policy(vit.create(args.variant, num_classes=args.num_classes,
                                        patch_size=args.patch_size or 16, remat=args.remat,
                                        **layers), mode)


def loss_fn(apply_fn: Callable, collections: dict[str, Any] | None = None) -> Callable:
    """``loss(params, images, labels)``: the float32 cross-entropy of a train-mode pass.

    ``collections``: other variables the pass reads (mode "fp8": the scaling state).

    Example:
      >>> model = build_model("fp32", parse_args(["--variant", "ti4", "--num-layers", "1",
      ...                                         "--num-classes", "3"]))
      >>> x, y = jnp.zeros((2, 8, 8, 3)), jnp.array([0, 1])
      >>> params = nn.unbox(model.init(jax.random.key(0), x))["params"]
      >>> round(float(loss_fn(model.apply)(params, x, y)), 4)  # zero-initialised head: ln 3
      1.0986
    """
    return lambda params, images, labels: cross_entropy(
        apply_fn({"params": params, **(collections or {})}, images, train=True), labels)


def init_state(mode: str, args: argparse.Namespace, abstract: bool = False) -> Any:
    """The train state of the ViT of ``args`` under ``mode`` (AdamW wrapped for the mode), on
    the device or, with ``abstract``, as shapes only; ``args.framework`` "nnx": the NNX ViT.

    Example:
      >>> args = parse_args(["--variant", "ti4", "--num-layers", "1", "--frameworks", "nnx"])
      >>> state = init_state("bf16", args, abstract=True)
      >>> state.params["encoder"]["layers"]["mlp"]["fc1"]["kernel"].shape
      (1, 192, 768)
    """
    mp, rng = jamp.mixed_precision(mode), jax.random.key(0)
    tx = jamp.make_optimizer(mp, optax.adamw(1e-4, weight_decay=0.05))
    x = jnp.zeros((1, args.image_size, args.image_size, 3))

    def create(apply_fn, params, fp8):  # delayed-scaling fp8: its state beside the params
        if fp8:
            return jamp.fp8.TrainState.create(apply_fn=apply_fn, params=params, tx=tx, fp8=fp8)
        return train_state.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)

    if args.framework == "nnx":  # the same weights, stepped through nnx_functional
        params = nn.unbox(jax.jit(build_model("fp32", args).init)(rng, x))["params"]
        model = jamp.apply_policy(vit_nnx.from_linen(build_model("fp32", args), params), mp)
        state = jax.tree.map(jnp.asarray, create(*nnx_functional.functional(model),
                                                 nnx_functional.fp8_state(model)))
        return jax.eval_shape(lambda: state) if abstract else state
    model = build_model(mp, args)

    def linen(rng):
        variables = nn.unbox(model.init(rng, x))
        return create(model.apply, variables["params"], variables.get(jamp.fp8.COLLECTION))

    return jax.eval_shape(linen, rng) if abstract else jax.jit(linen)(rng)


def synthetic_batch(args: argparse.Namespace, batch: int) -> dict[str, jax.Array]:
    """Random images and labels, created on the device.

    Example:
      >>> args = parse_args(["--image-size", "4", "--num-classes", "3"])
      >>> synthetic_batch(args, 2)["image"].shape
      (2, 4, 4, 3)
    """
    kx, ky = jax.random.split(jax.random.key(1))
    shape = (batch, args.image_size, args.image_size, 3)
    return {"image": jax.random.normal(kx, shape, jnp.float32),
            "label": jax.random.randint(ky, (batch,), 0, args.num_classes)}


def _abstract(tree: Any) -> Any:
    """The shapes and dtypes of a tree's arrays."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _step(donate: bool) -> Callable:
    """The jitted train step, the train state donated or not."""
    return jax.jit(jamp.train_step, donate_argnums=(0,) if donate else ())


def _compile_step(state: Any, batch: Any, donate: bool) -> Any:
    """Lowers and compiles the train step for these (possibly abstract) arguments."""
    return _step(donate).lower(state, batch, jax.random.key(2)).compile()


def _compiled_bytes(compiled: Any) -> int | None:
    """Device bytes of a compiled step from XLA's memory analysis (None if unavailable)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def jax_memory(state: Any, args: argparse.Namespace) -> jamp.MemoryReport:
    """``jamp.memory_report`` of one step of ``state`` at the benchmark's batch (shapes only).

    Example:
      >>> args = parse_args(["--variant", "ti4", "--num-layers", "1", "--batch", "2"])
      >>> jax_memory(init_state("bf16", args, abstract=True), args).total_bytes > 0
      True
    """
    images = jax.ShapeDtypeStruct((args.batch, args.image_size, args.image_size, 3), jnp.float32)
    labels = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
    fp8 = isinstance(state, jamp.fp8.TrainState) and state.fp8
    return jamp.memory_report(
        loss_fn(state.apply_fn, {jamp.fp8.COLLECTION: state.fp8} if fp8 else None),
        _abstract(state.params), images, labels, opt_state=_abstract(state.opt_state),
        model_state=_abstract((state.fp8, state.fp8_pending)) if fp8 else None)


def _runs_at(mode: str, args: argparse.Namespace, batch: int) -> bool:
    """Whether two real train steps at ``batch`` run without running out of device memory."""
    try:
        state, data = init_state(mode, args), synthetic_batch(args, batch)
        step = _step(args.donate)
        for _ in range(2):
            state, metrics = step(state, data, jax.random.key(2))
            jax.block_until_ready((state, metrics))
        return True
    except Exception as e:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            return False
        raise
    finally:
        state = data = None
        gc.collect()


def _max_batch(mode: str, args: argparse.Namespace, device: jax.Device) -> tuple[int | None, str]:
    """The largest batch whose compiled step fits the allocator's limit, and how it was found.

    Compiles (never runs) the step on abstract inputs: two compiles give the bytes per
    example, the search starts from the batch that predicts; the answer is then confirmed
    by running steps (the analysis does not see fragmentation).
    """
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit is None:
        return None, f"n/a on {device.platform} (no memory limit)"
    state = init_state(mode, args, abstract=True)
    cache: dict[int, int | None] = {}

    def needed(batch: int) -> int | None:
        if batch not in cache:
            shapes = jax.eval_shape(lambda: synthetic_batch(args, batch))
            try:
                cache[batch] = _compiled_bytes(_compile_step(state, shapes, args.donate))
            except Exception as e:  # noqa: BLE001 - XLA reports OOM at compile time variously
                if "memory" not in str(e).lower():
                    raise
                cache[batch] = None
        return cache[batch]

    g = GRANULARITY
    b0, b1 = args.batch, 2 * args.batch
    m0, m1 = needed(b0), needed(b1)
    guess, step = b0, None
    if m0 is not None and m1 is not None and m1 > m0:
        per_example = (m1 - m0) / (b1 - b0)
        guess, step = int((limit - (m0 - per_example * b0)) / per_example), g
    found = common.largest_batch(lambda b: (n := needed(b)) is not None and n <= limit,
                                 max(guess, g), granularity=g, step=step)
    method = f"XLA compile-time memory analysis <= {limit / 2**30:.2f} GiB ({len(cache)} compiles)"
    tries = 0
    while found and tries < 4 and not _runs_at(mode, args, found):
        found, tries = found - g if found > g else None, tries + 1
    return found, method + f", confirmed by running 2 steps ({tries} step-downs of {g})"


def _run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Measures one precision mode with ``args.framework``; returns its row of figures."""
    device = jax.devices()[0]
    state, batch, rng = init_state(mode, args), synthetic_batch(args, args.batch), jax.random.key(2)
    report = jax_memory(state, args)
    t0 = time.perf_counter()
    compiled = _compile_step(state, batch, args.donate)
    compile_s = time.perf_counter() - t0
    xla_bytes = _compiled_bytes(compiled)
    # The first step runs untimed. If it returns a state of other dtypes than it was
    # given (an optimizer state promoted to float32), the step is compiled again for
    # the new state, as jax.jit would do on the second call.
    new_state, metrics = jax.block_until_ready(compiled(state, batch, rng))
    leaves = lambda tree: jax.tree_util.tree_leaves(_abstract(tree))
    changed = leaves(new_state) != leaves(state)
    if changed:
        compiled = _compile_step(new_state, batch, args.donate)
    carry: dict[str, Any] = {"state": new_state, "metrics": metrics}

    def step():
        carry["state"], carry["metrics"] = compiled(carry["state"], batch, rng)
        jax.block_until_ready(carry)

    times = common.time_steps({mode: step}, warmup=max(args.warmup - 1, 0),
                              steps=args.steps)[mode]
    if args.profile:  # a few steps in a JAX profiler trace (xplane.pb), after the timing
        with jax.profiler.trace(f"{args.profile}/{mode}"):
            for _ in range(3):
                step()
    metrics = jax.device_get(carry["metrics"])
    flops = common.train_flops(args)
    row: dict[str, Any] = dict(
        framework="jamp", flax=args.framework, mode=mode, batch=args.batch, compile_s=compile_s,
        **common.summarize_times(times, args.batch),
        peak_bytes=(device.memory_stats() or {}).get("peak_bytes_in_use"),
        xla_step_bytes=xla_bytes, jax_memory=report.as_dict(), flops_per_image=flops,
        final_loss=float(metrics["loss"]), loss_finite=bool(np.isfinite(metrics["loss"])),
        steps_skipped=int(metrics["steps_skipped"]), loss_scale=float(metrics["loss_scale"]),
        state_dtypes_changed_after_step1=changed)
    row["mfu"] = common.mfu(row["images_per_sec"], flops, common.peak_tflops(device.device_kind))
    row["max_batch"], row["max_batch_method"] = None, "skipped (--max-batch not given)"
    if args.max_batch:
        del carry, compiled, state, new_state  # free the device for bigger steps
        gc.collect()
        row["max_batch"], row["max_batch_method"] = _max_batch(mode, args, device)
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (see the module docstring).

    Example:
      >>> args = parse_args(["--variant", "s8", "--modes", "O1,bf16"])
      >>> args.patch_size, args.modes
      (8, ['fp16', 'bf16'])
    """
    ap = common.parser(__doc__, json_out=True, timing=(20, 3))
    common.add_vit(ap)
    ap.add_argument("--modes", type=common.modes, default=list(jamp.MODES),
                    help="comma-separated, aliases accepted")
    ap.add_argument("--remat", action="store_true", help="rematerialise each block")
    ap.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True,
                    help="donate the train state to the step (default on)")
    ap.add_argument("--max-batch", action="store_true", help="search the largest batch")
    ap.add_argument("--profile", default=None,
                    help="after the timing, trace 3 steps with jax.profiler into DIR/<mode>")
    ap.add_argument("--frameworks", type=common.split, default=["linen"],
                    help="the ViT's Flax API(s): linen, nnx or both")
    args = ap.parse_args(argv)
    args.patch_size = sizes.parse_variant(args.variant, args.patch_size or 16)[1]
    args.framework = args.frameworks[0]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints one line per mode; returns (and optionally writes) results."""
    args = parse_args(argv)
    device = jax.devices()[0]
    info = dict(platform=device.platform, device_kind=device.device_kind,
                peak_tflops=common.peak_tflops(device.device_kind), jax=jax.__version__,
                jaxlib=getattr(jax.lib, "__version__", jax.__version__),
                optax=optax.__version__, machine=common.machine())
    print(f"jamp throughput: ViT-{args.variant} {args.image_size}px batch {args.batch} on "
          f"{info['device_kind']} ({info['platform']}), jax {info['jax']}", flush=True)
    rows = []
    for framework, mode in ((f, m) for f in args.frameworks for m in args.modes):
        rows.append(row := _run_mode(mode, argparse.Namespace(**{**vars(args),
                                                                 "framework": framework})))
        print(f"  {mode:<11} {framework:<5} {row['images_per_sec']:9.1f} img/s  "
              f"step {row['step_ms']:8.1f} ms  "
              f"compile {row['compile_s']:5.1f} s  peak {common.gib(row['peak_bytes'])}  "
              f"XLA step {common.gib(row['xla_step_bytes'])}  "
              f"JAX-level {common.gib(row['jax_memory']['total_bytes'])}  "
              f"MFU {common.fmt(row['mfu'], '.1%')}  max batch {common.fmt(row['max_batch'], 'd')}"
              f"  loss {row['final_loss']:.3f}", flush=True)
    return common.process_result(args, "jamp", info, rows)


if __name__ == "__main__":
    main()
