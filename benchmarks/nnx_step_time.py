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
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

import jamp
from benchmarks import common, throughput
from jamp.models import sizes, vit_nnx
from jamp.step import cross_entropy


def steps(mode: str, args: Any) -> dict[str, Callable[[], Any]]:
    """``{variant: run one step and block}`` for the three variants of one mode.

    Example:
      >>> import argparse
      >>> a = argparse.Namespace(variant="ti2", patch_size=None, image_size=4, batch=2,
      ...                        num_classes=3, num_layers=1, remat=False)
      >>> sorted(steps("fp32", a))
      ['NNX bridge', 'linen', 'nnx.jit']
    """
    module, mp = throughput.vit_module(args), jamp.mixed_precision(mode)
    batch = throughput.synthetic_batch(args, args.batch)
    params = nn.unbox(jax.jit(jamp.apply_policy(module, "fp32").init)(
        jax.random.key(0), batch["image"][:1]))["params"]
    model = jamp.apply_policy(vit_nnx.from_linen(module, params), mp)
    apply_fn, nnx_params = vit_nnx.functional(model)
    tx = jamp.make_optimizer(mp, optax.adamw(1e-3))
    step = jax.jit(jamp.train_step, donate_argnums=0)
    key, copy = jax.random.key(1), lambda tree: jax.tree.map(jnp.copy, tree)  # donated
    states = {"linen": train_state.TrainState.create(
                  apply_fn=jamp.apply_policy(module, mp).apply,
                  params=copy(vit_nnx.to_linen(model)), tx=tx),
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
    ap = common.parser(__doc__, timing=(50, 3))
    common.add_vit(ap, variant="ti4", batch=32)
    ap.set_defaults(image_size=32, num_classes=10, num_layers=4, remat=False)
    ap.add_argument("--modes", type=common.modes, default=["fp32", "bf16", "fp16"])
    args = ap.parse_args(argv)
    rows = [{"mode": mode, **{name: 1e3 * statistics.median(t) for name, t in common.time_steps(
        steps(mode, args), warmup=args.warmup, steps=args.steps).items()}} for mode in args.modes]
    result = {**common.header("nnx_step_time", argv), "config": {
        k: v for k, v in vars(args).items() if k not in ("out_dir", "no_write", "remat")},
        "results": rows}
    size = sizes.vit_label(args.variant, args.patch_size)
    markdown = "\n".join([
        f"# NNX ViT vs linen ViT: step time ({result['platform']}, {result['date']})", "",
        f"{size}, {args.num_layers or 'all'} layers, {args.image_size}px, batch "
        f"{args.batch}, AdamW; median of {args.steps} steps after {args.warmup} warm-up "
        f"steps, the three variants timed in turn. `{result['command']}`; machine: "
        f"{result['machine']}.", "",
        *common.table("mode | linen (ms) | NNX bridge (ms) | ratio | nnx.jit (ms) | ratio", (
            [r["mode"], f"{r['linen']:.2f}", f"{r['NNX bridge']:.2f}",
             f"{r['NNX bridge'] / r['linen']:.2f}", f"{r['nnx.jit']:.2f}",
             f"{r['nnx.jit'] / r['linen']:.2f}"] for r in rows))]) + "\n"
    print(markdown[markdown.index("| mode"):], end="")
    if not args.no_write:
        common.write_results(common.results_stem(args.out_dir, "nnx_step_time",
                                                  result["platform"]), result, markdown)
    return result


if __name__ == "__main__":
    main()
