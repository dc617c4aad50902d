"""Step-time overhead of ``jamp.DynamicLossScale(adamw)`` over ``adamw``, on an MLP or a ViT.

Trains one float32 model twice in the same process: with plain ``optax.adamw``
and with ``DynamicLossScale(adamw)`` plus ``jamp.scale_loss``. Both steps are
jitted with donated params and optimizer state, warmed up, then timed step by
step (``block_until_ready`` after each), alternating the two variants so that
drift in machine load hits both alike; the ratio of median step times is the
overhead.

- ``--model mlp`` (default): an MLP (256 -> 3 x 512 -> 10, GELU) at batch 128 and
  512, a step that is cheap per parameter. The loss scale's cost is per
  parameter, the model's per example, so the ratio falls as the batch grows.
  Writes ``results/loss_scale_overhead-<platform>-<date>.md`` and ``.json``.
- ``--model vit``: a ViT (ViT-S/16, 22M parameters, 224px, batch 8). Writes
  ``results/loss_scale_vit-<platform>-<date>.md`` and ``.json``.

Usage::

  python -m benchmarks.loss_scale_overhead                     # MLP, batch 128 and 512
  python -m benchmarks.loss_scale_overhead --model vit         # ViT-S/16, 224px, batch 8
  python -m benchmarks.loss_scale_overhead --model vit --quick # smoke run, writes nothing
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jamp
from benchmarks import common, throughput
from jamp.models import sizes
from jamp.step import cross_entropy

Model = tuple[Callable[..., jax.Array], Callable[[], Any], jax.Array, jax.Array, str]
"""``(loss(params, x, y), init() -> params, x, y, label)``: what a measurement trains."""

MODELS = {
    "mlp": ("loss_scale_overhead",
            dict(steps=3000, warmup=50, batch=[128, 512], width=512, depth=3),
            dict(steps=3, warmup=1, batch=[8], width=32)),
    "vit": ("loss_scale_vit", dict(steps=20, warmup=2, batch=[8], variant="s16", image_size=224),
            dict(steps=1, warmup=0, batch=[2], variant="ti4", image_size=16, num_layers=1)),
}
"""Per model: the results file kind, the values of the flags not given, and those of
``--quick`` (a smoke run; they come first)."""


def mlp(args: argparse.Namespace, batch: int) -> Model:
    """An MLP of ``args.depth`` hidden layers of ``args.width`` (GELU), and a batch for it.

    Example:
      >>> loss, init, x, y, label = mlp(argparse.Namespace(width=8, depth=1), 2)
      >>> label, x.shape, loss(init(), x, y).shape
      ('MLP [256, 8, 10] (GELU)', (2, 256), ())
    """
    widths = [256] + [args.width] * args.depth + [10]
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (batch, widths[0]), jnp.float32)
    y = jax.random.randint(ky, (batch,), 0, widths[-1])

    def init() -> list[dict[str, jax.Array]]:
        keys = jax.random.split(kp, len(widths) - 1)
        return [{"w": jax.random.normal(k, (n, m), jnp.float32) / jnp.sqrt(n),
                 "b": jnp.zeros((m,), jnp.float32)}
                for k, n, m in zip(keys, widths[:-1], widths[1:], strict=True)]

    def loss(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
        for layer in params[:-1]:
            x = jax.nn.gelu(x @ layer["w"] + layer["b"])
        return cross_entropy(x @ params[-1]["w"] + params[-1]["b"], y)

    return loss, init, x, y, f"MLP {widths} (GELU)"


def vit(args: argparse.Namespace, batch: int) -> Model:
    """The float32 ViT of ``args`` (``benchmarks.throughput.build_model``) and a batch for it."""
    model = throughput.build_model("fp32", args)
    data = throughput.synthetic_batch(args, batch)
    x, y = data["image"], data["label"]
    init = jax.jit(lambda: nn.unbox(model.init(jax.random.key(0), x[:1]))["params"])
    return throughput.loss_fn(model), init, x, y, sizes.vit_label(args.variant, args.patch_size)


def measure(model: Model, *, warmup: int, steps: int) -> dict[str, Any]:
    """Times plain vs loss-scaled steps, alternating; returns one row of the table (ms).

    Each step is jitted with params and optimizer state donated; the scaled one
    multiplies the loss by the state's loss scale (``jamp.scale_loss``).
    """
    loss, init, x, y, _ = model
    adamw = optax.adamw(1e-4, weight_decay=0.05)
    txs = {"plain": adamw, "scaled": jamp.DynamicLossScale(adamw, init_scale=2.0**15)}
    carry = {name: (p := init(), tx.init(p)) for name, tx in txs.items()}

    def run(name: str) -> Callable[[], None]:
        tx, scaled = txs[name], name == "scaled"

        def step(params, opt_state, x, y):
            scale = (lambda v: jamp.scale_loss(v, opt_state)) if scaled else (lambda v: v)
            value, grads = jax.value_and_grad(lambda p: scale(loss(p, x, y)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        step = jax.jit(step, donate_argnums=(0, 1))

        def one():
            params, opt_state, value = step(*carry[name], x, y)
            jax.block_until_ready((params, opt_state, value))
            carry[name] = (params, opt_state)

        return one

    n_params = sum(p.size for p in jax.tree_util.tree_leaves(carry["plain"][0]))
    times = common.time_steps({name: run(name) for name in txs}, warmup=warmup, steps=steps,
                              alternate=True)
    plain, scaled = (statistics.median(times[name]) * 1e3 for name in ("plain", "scaled"))
    return dict(batch=int(x.shape[0]), n_params=int(n_params), plain_ms=plain, scaled_ms=scaled,
                ratio=scaled / plain, overhead_pct=(scaled / plain - 1) * 100,
                steps_skipped=int(jamp.overflow_stats(carry["scaled"][1]).steps_skipped))


def to_markdown(r: dict[str, Any]) -> str:
    """The results file: how it was measured, then the table (MLP and ViT columns differ)."""
    vit_run, m = r["benchmark"] == "loss_scale_vit", r["machine"]
    digits = 1 if vit_run else 3
    figures = lambda x: [f"{x['plain_ms']:.{digits}f}", f"{x['scaled_ms']:.{digits}f}",
                         f"{x['ratio']:.4f}", f"{x['overhead_pct']:+.2f}%"]
    columns = "adamw ms/step | DynamicLossScale(adamw) ms/step | ratio | overhead"
    return "\n".join([
        "# DynamicLossScale(adamw) vs adamw" + (" on a ViT train step" if vit_run
                                                 else ": step-time overhead"), "",
        f"- command: `{r['command']}`",
        f"- date: {r['date']}; device: {r['device']} ({r['platform']}); host {m['processor']}, "
        f"{m['cpus']} CPUs ({m['platform']}); jax {r['jax']}, optax {r['optax']}",
        f"- model: {r['model']}" + (f", {r['image_size']}px" if vit_run else "") + " in float32,"
        " softmax cross-entropy, AdamW; jit with donated params and optimizer state",
        f"- timing: {r['warmup']} warm-up steps, then {r['steps']} per variant, alternating "
        "plain/scaled step by step, block_until_ready after each; medians",
        f"- 1-min load average before/after: {r['load_avg_before']} / {m['load_avg_1m']} "
        "(a shared machine: other jobs add noise to both variants alike)",
        "- target: <= 3% overhead", "",
        *(common.table(f"model | batch | {columns} | steps skipped",
                       ([r["model"], x["batch"], *figures(x), x["steps_skipped"]]
                        for x in r["rows"])) if vit_run else
          common.table(f"batch | params | {columns}",
                       ([x["batch"], x["n_params"], *figures(x)] for x in r["rows"])))]) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; those not given take the model's ``--quick`` or default values.

    Example:
      >>> args = parse_args(["--model", "vit", "--steps", "5"])
      >>> args.steps, args.warmup, args.batch, args.variant
      (5, 2, [8], 's16')
    """
    ap = common.parser(__doc__, timing=(None, None))
    ap.add_argument("--model", choices=tuple(MODELS), default="mlp")
    ap.add_argument("--batch", type=lambda text: [int(b) for b in common.split(text)],
                    help="comma-separated batch sizes (mlp: 128,512; vit: 8)")
    ap.add_argument("--width", type=int, help="mlp: hidden width (512)")
    ap.add_argument("--depth", type=int, help="mlp: hidden layers (3)")
    ap.add_argument("--variant", help="vit: size and patch (s16)")
    ap.add_argument("--image-size", type=int, help="vit: image side (224)")
    ap.add_argument("--num-layers", type=int, help="vit: override (smoke tests)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; writes no file")
    ap.add_argument("--out", help="write the results to this .md (and .json)")
    ap.set_defaults(patch_size=None, num_classes=1000, remat=False)
    args = ap.parse_args(argv)
    _, defaults, quick = MODELS[args.model]
    for key, value in [*(quick.items() if args.quick else ()), *defaults.items()]:
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measures every batch size; prints one line each and writes the results file.

    The file is written unless ``--no-write`` or ``--quick`` (``--out`` writes anyway).
    """
    args = parse_args(argv)
    build = mlp if args.model == "mlp" else vit
    load_before = common.machine()["load_avg_1m"]
    rows = []
    for batch in args.batch:
        model = build(args, batch)
        rows.append(r := measure(model, warmup=args.warmup, steps=args.steps))
        print(f"{model[-1]} batch {batch} ({r['n_params']:,} params): adamw {r['plain_ms']:.3f} "
              f"ms, DynamicLossScale(adamw) {r['scaled_ms']:.3f} ms (medians of {args.steps}) "
              f"-> ratio {r['ratio']:.4f} ({r['overhead_pct']:+.2f}%), "
              f"{r['steps_skipped']} steps skipped", flush=True)
    result = dict(**common.header("loss_scale_overhead", argv, MODELS[args.model][0]),
                  optax=optax.__version__, model=model[-1],
                  image_size=args.image_size if args.model == "vit" else None,
                  steps=args.steps, warmup=args.warmup, load_avg_before=load_before, rows=rows)
    if args.out or not (args.no_write or args.quick):
        stem = (Path(args.out).with_suffix("") if args.out else
                common.results_stem(args.out_dir, result["benchmark"], result["platform"]))
        common.write_results(stem, result, to_markdown(result))
    return result


if __name__ == "__main__":
    main()
