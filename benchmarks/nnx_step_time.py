"""Step time of the NNX ViT against the linen ViT: the same model, the same weights.

Three jitted train steps of one ViT (``jamp.models.vit`` and ``jamp.models.vit_nnx``,
the NNX one built with ``vit_nnx.from_linen`` from the linen weights), per mode:

- **linen**: ``jax.jit(jamp.train_step)`` on a ``TrainState`` with the linen ``apply``;
- **NNX bridge**: the same step with ``vit_nnx.functional``'s ``apply_fn`` (what the
  trainer runs);
- **nnx.jit**: ``nnx.jit`` of ``nnx.grad`` + ``nnx.Optimizer.update`` with
  ``jamp.scale_loss``, the NNX idiom (its Python side splits and merges the graph on
  every call).

Each step is warmed up, then the three are timed step by step in turn (so drift in
the machine's load hits them alike); the table gives median step times and their
ratio to linen. Writes ``results/nnx_step_time-<platform>-<date>.md`` and ``.json``.

Usage::

  python -m benchmarks.nnx_step_time                  # ViT-Ti/4, 4 layers, 32px, batch 32
  python -m benchmarks.nnx_step_time --steps 2 --warmup 1 --no-write   # smoke run
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jamp
from benchmarks import common
from jamp.models import sizes, vit, vit_nnx
from jamp.step import cross_entropy


def steps(mode: str, args: Any) -> dict[str, Callable[[], Any]]:
    """``{variant: run one step and block}`` for the three variants of one mode.

    Example:
      >>> import argparse
      >>> a = argparse.Namespace(variant="ti2", patch_size=None, image_size=4, batch=2,
      ...                        num_classes=3, num_layers=1)
      >>> sorted(steps("fp32", a))
      ['NNX bridge', 'linen', 'nnx.jit']
    """
    size, patch = sizes.parse_variant(args.variant, args.patch_size or 16)
    module = vit.create(size, num_classes=args.num_classes, patch_size=patch,
                        **({"num_layers": args.num_layers} if args.num_layers else {}))
    mp = jamp.mixed_precision(mode)
    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.normal(size=(args.batch, args.image_size,
                                                   args.image_size, 3)), jnp.float32),
             "label": jnp.asarray(rng.integers(0, args.num_classes, args.batch), jnp.int32)}
    linen = jamp.apply_policy(module, mp)
    params = nn.unbox(jax.jit(jamp.apply_policy(module, "fp32").init)(
        jax.random.key(0), batch["image"][:1]))["params"]
    model = jamp.apply_policy(vit_nnx.from_linen(module, params), mp)
    apply_fn, nnx_params = vit_nnx.functional(model)
    tx = jamp.make_optimizer(mp, optax.adamw(1e-3))
    step = jax.jit(jamp.train_step, donate_argnums=0)
    key, copy = jax.random.key(1), lambda tree: jax.tree.map(jnp.copy, tree)  # donated
    states = {"linen": train_state.TrainState.create(
                  apply_fn=linen.apply, params=copy(vit_nnx.to_linen(model)), tx=tx),
              "NNX bridge": train_state.TrainState.create(
                  apply_fn=apply_fn, params=copy(nnx_params), tx=tx)}

    def functional(name):
        def run():
            states[name], metrics = step(states[name], batch, key)
            jax.block_until_ready(metrics)
        return run

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, batch):
        def loss_fn(m):
            return jamp.scale_loss(cross_entropy(m(batch["image"], train=True), batch["label"]),
                                   optimizer)

        optimizer.update(model, nnx.grad(loss_fn)(model))
        return jamp.loss_scale(optimizer)

    return {"linen": functional("linen"), "NNX bridge": functional("NNX bridge"),
            "nnx.jit": lambda: jax.block_until_ready(nnx_step(model, optimizer, batch))}


def measure(mode: str, args: Any) -> dict[str, float]:
    """Median step time (ms) per variant, timed in turn after ``args.warmup`` steps each.

    Example: see :func:`main`.
    """
    runs = steps(mode, args)
    for run in runs.values():
        for _ in range(args.warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measures every mode, prints the table and writes the results (unless ``--no-write``).

    Example (``--no-write``: prints only):
      >>> r = main(["--steps", "1", "--warmup", "1", "--modes", "fp32", "--image-size", "4",
      ...           "--variant", "ti2", "--num-layers", "1", "--batch", "2", "--no-write"])
      | mode | linen (ms) | NNX bridge (ms) | ratio | nnx.jit (ms) | ratio |
      ...
      >>> sorted(r["results"][0])
      ['NNX bridge', 'linen', 'mode', 'nnx.jit']
    """
    ap = common.parser(__doc__)
    common.add_timing(ap, steps=50, warmup=3)
    common.add_vit(ap, variant="ti4", batch=32)
    ap.set_defaults(image_size=32, num_classes=10, num_layers=4)
    ap.add_argument("--modes", type=common.modes, default=["fp32", "bf16", "fp16"])
    args = ap.parse_args(argv)
    rows = [{"mode": mode, **measure(mode, args)} for mode in args.modes]
    result = {**common.header("nnx_step_time", argv), "config": {
        k: v for k, v in vars(args).items() if k not in ("out_dir", "no_write")},
        "results": rows}
    size = sizes.vit_label(args.variant, args.patch_size)
    lines = [f"# NNX ViT vs linen ViT: step time ({result['platform']}, {result['date']})", "",
             f"{size}, {args.num_layers or 'all'} layers, {args.image_size}px, batch "
             f"{args.batch}, AdamW; median of {args.steps} steps after {args.warmup} warm-up "
             f"steps, the three variants timed in turn. `{result['command']}`; machine: "
             f"{result['machine']}.", "",
             "| mode | linen (ms) | NNX bridge (ms) | ratio | nnx.jit (ms) | ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['linen']:.2f} | {r['NNX bridge']:.2f} | "
                     f"{r['NNX bridge'] / r['linen']:.2f} | {r['nnx.jit']:.2f} | "
                     f"{r['nnx.jit'] / r['linen']:.2f} |")
    markdown = "\n".join(lines) + "\n"
    print(markdown[markdown.index("| mode"):], end="")
    if not args.no_write:
        common.write_results(common.results_stem(args.out_dir, "nnx_step_time",
                                                  result["platform"]), result, markdown)
    return result


if __name__ == "__main__":
    main()
