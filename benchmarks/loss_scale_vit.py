"""Step-time overhead of ``DynamicLossScale(adamw)`` over ``adamw`` on a ViT train step.

The MLP measurement (``loss_scale_overhead.py``) bounds the loss scale's cost on a
model whose step is cheap per parameter. This one uses a real ViT (ViT-S/16 by
default, 22M parameters): the same float32 model is trained with plain
``optax.adamw`` and with ``jamp.DynamicLossScale(optax.adamw)`` plus
``jamp.scale_loss``, in one process, both jitted with donated params and
optimizer state, alternating step by step so that load on a shared machine hits
both alike; the ratio of median step times is the overhead. Writes
``benchmarks/results/loss_scale_vit-<platform>-<date>.md`` and ``.json``.

Usage::

  python benchmarks/loss_scale_vit.py                  # ViT-S/16, 224px, batch 8, 20 steps
  python benchmarks/loss_scale_vit.py --variant ti4 --image-size 16 --batch 2 \\
      --num-layers 1 --steps 1 --no-write              # smoke run

Example:
  >>> # result = main(["--variant", "ti4", "--image-size", "16", "--steps", "1", "--no-write"])
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jamp  # noqa: E402
from benchmarks import common  # noqa: E402
from jamp.models import vit  # noqa: E402
from jamp.step import cross_entropy  # noqa: E402


def make_steps(model: nn.Module, plain_tx: optax.GradientTransformation,
               scaled_tx: optax.GradientTransformation) -> dict[str, Any]:
    """Jitted plain and loss-scaled ``step(params, opt_state, x, y) -> (params, opt, loss)``."""

    def loss_fn(params, x, y):
        return cross_entropy(model.apply({"params": params}, x, train=True), y)

    def plain(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = plain_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def scaled(params, opt_state, x, y):
        scaled_loss = lambda p: jamp.scale_loss(loss_fn(p, x, y), opt_state)
        loss, grads = jax.value_and_grad(scaled_loss)(params)
        updates, opt_state = scaled_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return {name: jax.jit(fn, donate_argnums=(0, 1))
            for name, fn in (("plain", plain), ("scaled", scaled))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the measurement; prints and (unless ``--no-write``) writes the result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="s16")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=None, help="override (smoke tests)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    ap.add_argument("--out-dir", default=str(common.RESULTS))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    size, patch = common.parse_variant(args.variant)
    dims = common.vit_dims(args.variant, num_layers=args.num_layers)
    model = jamp.apply_policy(vit.create(size, num_classes=1000, patch_size=patch, **dims), "fp32")
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (args.batch, args.image_size, args.image_size, 3), jnp.float32)
    y = jax.random.randint(ky, (args.batch,), 0, 1000)
    init = jax.jit(lambda r: nn.unbox(model.init(r, x[:1]))["params"])
    adamw = optax.adamw(1e-4, weight_decay=0.05)
    txs = {"plain": adamw, "scaled": jamp.DynamicLossScale(adamw, init_scale=2.0**15)}
    steps = make_steps(model, txs["plain"], txs["scaled"])
    carry = {}
    for name, tx in txs.items():
        params = init(jax.random.key(0))
        carry[name] = (params, tx.init(params))
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(carry["plain"][0]))

    times: dict[str, list[float]] = {"plain": [], "scaled": []}
    load_before = common.machine()["load_avg_1m"]
    for i in range(args.warmup + args.steps):
        for name in ("plain", "scaled") if i % 2 == 0 else ("scaled", "plain"):
            t0 = time.perf_counter()
            params, opt_state, loss = steps[name](*carry[name], x, y)
            jax.block_until_ready((params, opt_state, loss))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            carry[name] = (params, opt_state)
    skipped = int(jamp.overflow_stats(carry["scaled"][1]).steps_skipped)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["scaled"] / med["plain"]
    result = dict(
        benchmark="loss_scale_vit", date=common.today(), platform=jax.default_backend(),
        device=jax.devices()[0].device_kind, jax=jax.__version__, machine=common.machine(),
        command=common.command("loss_scale_vit.py", argv),
        model=common.vit_label(args.variant), image_size=args.image_size, batch=args.batch,
        n_params=int(n_params), steps=args.steps, warmup=args.warmup,
        plain_ms=med["plain"] * 1e3, scaled_ms=med["scaled"] * 1e3, ratio=ratio,
        overhead_pct=(ratio - 1) * 100, steps_skipped=skipped, load_avg_before=load_before)
    print(f"{result['model']} {args.image_size}px batch {args.batch} ({n_params:,} params): "
          f"adamw {result['plain_ms']:.1f} ms, DynamicLossScale(adamw) {result['scaled_ms']:.1f} "
          f"ms (medians of {args.steps}) -> ratio {ratio:.4f} ({result['overhead_pct']:+.2f}%)",
          flush=True)
    if not args.no_write:
        stem = Path(args.out_dir) / f"loss_scale_vit-{result['platform']}-{result['date']}"
        common.write_json(stem.with_suffix(".json"), result)
        stem.with_suffix(".md").write_text(to_markdown(result))
        print(f"wrote {stem}.md/.json", flush=True)
    return result


def to_markdown(r: dict[str, Any]) -> str:
    """The results file."""
    return "\n".join([
        "# DynamicLossScale(adamw) vs adamw on a ViT train step", "",
        f"- command: `{r['command']}`",
        f"- date: {r['date']}; device: {r['device']} ({r['platform']}), host "
        f"{r['machine']['cpus']} CPUs; jax {r['jax']}; 1-min load before/after "
        f"{r['load_avg_before']} / {r['machine']['load_avg_1m']} (shared machine)",
        f"- model: {r['model']} in float32, {r['image_size']}px, batch {r['batch']}, "
        f"{r['n_params']:,} parameters; jit with donated params and optimizer state; "
        f"{r['warmup']} warm-up steps, then {r['steps']} per variant, alternating step by step; "
        "medians",
        "- for the MLP measurement at batch 128/512 see `loss_scale_overhead-cpu-2026-11-21.md`",
        "",
        "| model | batch | adamw ms/step | DynamicLossScale(adamw) ms/step | ratio | overhead "
        "| steps skipped |",
        "|---|---|---|---|---|---|---|",
        f"| {r['model']} | {r['batch']} | {r['plain_ms']:.1f} | {r['scaled_ms']:.1f} "
        f"| {r['ratio']:.4f} | {r['overhead_pct']:+.2f}% | {r['steps_skipped']} |",
    ]) + "\n"


if __name__ == "__main__":
    main()
