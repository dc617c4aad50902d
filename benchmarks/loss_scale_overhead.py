"""Step-time overhead of ``jamp.loss_scale.DynamicLossScale`` over a plain optimizer.

Trains a small MLP with ``optax.adamw`` twice in the same process: once plain,
once wrapped as ``DynamicLossScale(adamw)`` with the loss scaled by
``scale_loss``. Both steps are jitted with donated params and optimizer state,
warmed up, then timed step by step (``block_until_ready`` after each step),
alternating the two variants so that drift in machine load hits both alike.
Reports the median step times and their ratio per batch size (the loss scale's
cost is per parameter, the model's per example, so the ratio falls as the batch
grows) and writes a markdown table to
``benchmarks/results/loss_scale_overhead-<platform>-<date>.md``.

Usage::

  python benchmarks/loss_scale_overhead.py              # full run, writes results/
  python benchmarks/loss_scale_overhead.py --steps 3 --quick   # smoke run, no file
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jamp.loss_scale import DynamicLossScale, overflow_stats, scale_loss  # noqa: E402


def init_mlp(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    """Initialises an MLP as a list of ``{"w", "b"}`` layers."""
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (fan_in, fan_out), jnp.float32) / jnp.sqrt(fan_in)
        params.append({"w": w, "b": jnp.zeros((fan_out,), jnp.float32)})
    return params


def loss_fn(params, x, y):
    """Softmax cross-entropy of the MLP on ``(x, y)``."""
    h = x
    for layer in params[:-1]:
        h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_steps(tx_plain, tx_scaled):
    """Returns the jitted plain and loss-scaled train steps (params/state donated)."""

    def plain(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx_plain.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def scaled(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: scale_loss(loss_fn(p, x, y), opt_state))(params)
        updates, opt_state = tx_scaled.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(plain, donate_argnums=(0, 1)), jax.jit(scaled, donate_argnums=(0, 1))


def measure(batch, args, key):
    """Times plain vs loss-scaled steps at one batch size; returns the medians (s)."""
    sizes = [256] + [args.width] * args.depth + [10]
    kx, ky, kp = jax.random.split(key, 3)
    x = jax.random.normal(kx, (batch, sizes[0]), jnp.float32)
    y = jax.random.randint(ky, (batch,), 0, sizes[-1])

    adamw = optax.adamw(1e-4)
    tx_scaled = DynamicLossScale(adamw, init_scale=2.0**15, growth_interval=2000)
    steps = dict(zip(("plain", "scaled"), make_steps(adamw, tx_scaled), strict=True))
    carry = {}
    for name, tx in (("plain", adamw), ("scaled", tx_scaled)):
        params = init_mlp(kp, sizes)
        carry[name] = (params, tx.init(params))

    # Steps alternate plain/scaled one by one, so drifts in machine load (other
    # processes on a shared box) hit both variants alike; the medians drop outliers.
    times = {"plain": [], "scaled": []}
    for i in range(args.warmup + args.steps):
        for name in ("plain", "scaled") if i % 2 == 0 else ("scaled", "plain"):
            t0 = time.perf_counter()
            params, opt_state, loss = steps[name](*carry[name], x, y)
            jax.block_until_ready((params, opt_state, loss))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            carry[name] = (params, opt_state)
    assert int(overflow_stats(carry["scaled"][1]).steps_skipped) == 0
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(carry["plain"][0]))
    return {k: statistics.median(v) for k, v in times.items()}, sizes, n_params


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs the benchmark; returns one row of figures per batch size."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=50, help="untimed steps per variant")
    ap.add_argument("--batches", type=str, default="128,512", help="comma-separated sizes")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3, help="hidden layers")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; writes no file")
    ap.add_argument("--out", type=str, default=None, help="markdown output path")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.width, args.batches = 1, 32, "8"

    backend = jax.default_backend()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    print(f"backend={backend} machine=({machine}) jax={jax.__version__} optax={optax.__version__}")
    load_before = os.getloadavg()[0]
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        med, sizes, n_params = measure(batch, args, jax.random.PRNGKey(0))
        ratio = med["scaled"] / med["plain"]
        rows.append(
            dict(
                batch=batch,
                sizes=sizes,
                n_params=n_params,
                plain_ms=med["plain"] * 1e3,
                scaled_ms=med["scaled"] * 1e3,
                ratio=ratio,
                overhead_pct=(ratio - 1.0) * 100.0,
            )
        )
        print(
            f"MLP {sizes} batch {batch} ({n_params} params): plain adamw "
            f"{med['plain'] * 1e3:.3f} ms, DynamicLossScale(adamw) {med['scaled'] * 1e3:.3f} ms "
            f"(medians of {args.steps}) -> ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)"
        )

    out = args.out
    if out is None and not args.quick:
        date = datetime.date.today().isoformat()
        out = Path(__file__).parent / "results" / f"loss_scale_overhead-{backend}-{date}.md"
    if out is not None:
        cmd = " ".join(argv if argv is not None else sys.argv[1:])
        table = "\n".join(
            f"| {r['batch']} | {r['n_params']} | {r['plain_ms']:.3f} | {r['scaled_ms']:.3f} "
            f"| {r['ratio']:.4f} | {r['overhead_pct']:+.2f}% |"
            for r in rows
        )
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(
            "# DynamicLossScale(adamw) vs adamw: step-time overhead\n\n"
            f"- command: `python benchmarks/loss_scale_overhead.py {cmd}`\n"
            f"- date: {datetime.date.today().isoformat()}\n"
            f"- backend: {backend}; machine: {machine} ({platform.platform()})\n"
            f"- jax {jax.__version__}, optax {optax.__version__}\n"
            f"- model: MLP {rows[0]['sizes']} (GELU, f32), softmax cross-entropy; jit with "
            "donated params and optimizer state\n"
            f"- timing: {args.warmup} warm-up steps, then {args.steps} steps per variant, "
            "alternating plain/scaled step by step, block_until_ready after each; medians\n"
            f"- 1-min load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
            "(a shared machine: other jobs add noise to both variants alike)\n"
            "- target: <= 3% overhead\n\n"
            "| batch | params | adamw ms/step | DynamicLossScale(adamw) ms/step | ratio "
            "| overhead |\n|---|---|---|---|---|---|\n" + table + "\n"
        )
        print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
