"""Step-time overhead of ``jamp.loss_scale.DynamicLossScale`` over a plain optimizer.

Trains a small MLP with ``optax.adamw`` twice in the same process: once plain,
once wrapped as ``DynamicLossScale(adamw)`` with the loss scaled by
``scale_loss``. Both steps are jitted with donated params and optimizer state,
warmed up, then timed step by step (``block_until_ready`` after each step) in
interleaved rounds so that drift in machine load hits both alike. Reports the
median step times and their ratio and writes a markdown table to
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

from jamp.loss_scale import DynamicLossScale, scale_loss  # noqa: E402


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


def time_steps(step, params, opt_state, x, y, n):
    """Runs ``n`` steps, returning per-step wall times and the final carry."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x, y)
        jax.block_until_ready((params, opt_state, loss))
        times.append(time.perf_counter() - t0)
    return times, params, opt_state


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns the measured figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=50, help="untimed steps per variant")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3, help="hidden layers")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; writes no file")
    ap.add_argument("--out", type=str, default=None, help="markdown output path")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.width, args.batch = 1, 1, 32, 8

    sizes = [256] + [args.width] * args.depth + [10]
    key = jax.random.PRNGKey(0)
    kx, ky, kp = jax.random.split(key, 3)
    x = jax.random.normal(kx, (args.batch, sizes[0]), jnp.float32)
    y = jax.random.randint(ky, (args.batch,), 0, sizes[-1])

    adamw = optax.adamw(1e-4)
    tx_scaled = DynamicLossScale(adamw, init_scale=2.0**15, growth_interval=2000)
    plain, scaled = make_steps(adamw, tx_scaled)

    carry = {}
    for name, tx in (("plain", adamw), ("scaled", tx_scaled)):
        params = init_mlp(kp, sizes)
        carry[name] = (params, tx.init(params))
    steps = {"plain": plain, "scaled": scaled}

    for name in ("plain", "scaled"):
        _, *c = time_steps(steps[name], *carry[name], x, y, args.warmup)
        carry[name] = tuple(c)

    times = {"plain": [], "scaled": []}
    for r in range(args.rounds):
        order = ("plain", "scaled") if r % 2 == 0 else ("scaled", "plain")
        for name in order:
            t, *c = time_steps(steps[name], *carry[name], x, y, args.steps)
            carry[name] = tuple(c)
            times[name].extend(t)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["scaled"] / med["plain"]
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(carry["plain"][0]))
    result = {
        "plain_ms": med["plain"] * 1e3,
        "scaled_ms": med["scaled"] * 1e3,
        "ratio": ratio,
        "overhead_pct": (ratio - 1.0) * 100.0,
        "timed_steps": len(times["plain"]),
        "n_params": n_params,
    }
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    backend = jax.default_backend()
    print(
        f"backend={backend} machine=({machine}) jax={jax.__version__} "
        f"mlp={sizes} batch={args.batch} params={n_params}\n"
        f"plain adamw:            {result['plain_ms']:.3f} ms/step (median)\n"
        f"DynamicLossScale(adamw): {result['scaled_ms']:.3f} ms/step (median)\n"
        f"ratio {ratio:.4f} -> overhead {result['overhead_pct']:+.2f}% "
        f"over {result['timed_steps']} steps each"
    )

    out = args.out
    if out is None and not args.quick:
        date = datetime.date.today().isoformat()
        out = Path(__file__).parent / "results" / f"loss_scale_overhead-{backend}-{date}.md"
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(
            "# DynamicLossScale overhead\n\n"
            f"`python benchmarks/loss_scale_overhead.py {' '.join(argv or sys.argv[1:])}`\n\n"
            "| item | value |\n|---|---|\n"
            f"| date | {datetime.date.today().isoformat()} |\n"
            f"| backend | {backend} |\n"
            f"| machine | {machine} ({platform.platform()}) |\n"
            f"| jax / optax | {jax.__version__} / {optax.__version__} |\n"
            f"| model | MLP {sizes}, batch {args.batch}, {n_params} f32 params |\n"
            f"| timed steps | {result['timed_steps']} per variant, "
            f"{args.rounds} interleaved rounds, {args.warmup} warm-up |\n"
            f"| plain adamw (median) | {result['plain_ms']:.3f} ms/step |\n"
            f"| DynamicLossScale(adamw) (median) | {result['scaled_ms']:.3f} ms/step |\n"
            f"| ratio | {ratio:.4f} ({result['overhead_pct']:+.2f}%) |\n"
            f"| target | <= 3% overhead |\n"
        )
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
