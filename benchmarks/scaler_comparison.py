"""A loss-scaled float16 train step in jamp, Flax, optax, jmp and mpx: speed and exactness.

Each library trains the same MLP (256 -> 3 x 512 -> 10, GELU; float32 params and
inputs cast to float16 inside the loss) with AdamW in its documented pattern:
``jamp.DynamicLossScale(adamw)`` + ``jamp.scale_loss``; Flax ``DynamicScale`` + a
``jnp.where`` skip of params and opt_state (Flax's examples); ``optax.apply_if_finite``
(a skip, no loss scale); ``jmp.DynamicLossScale`` + ``jmp.select_tree``; mpx's
``filter_value_and_grad`` + ``optimizer_update``. Steps are jitted (params and opt_state
donated), warmed up, timed round-robin; ratio = median over the unscaled float16 step's.
Small deterministic scenarios (:func:`facts`) then measure what each skip and scale does.

Usage::

  python -m benchmarks.scaler_comparison                   # batch 128 and 512, writes results/
  python -m benchmarks.scaler_comparison --quick           # smoke run, writes nothing
  python -m benchmarks.scaler_comparison --libs jamp,flax  # a subset
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp
from benchmarks import common

F16, F32 = jnp.float16, jnp.float32
LIBS = ("jamp", "flax", "optax", "jmp", "mpx")
BAD, FACTS = ("inf", "-inf", "nan"), ("backoff_nan", "growth_grad_ratio", "max_scale",
                                      "scale_in_opt_state")
DIST_MPX = "mixed-precision-for-jax"  # import name mpx; not a jamp dependency
NAMES = {"f16": "float16, no loss scale", "jamp": "jamp.DynamicLossScale",
         "flax": "flax DynamicScale", "optax": "optax.apply_if_finite",
         "jmp": "jmp.DynamicLossScale", "mpx": "mpx.DynamicLossScaling"}


def variant(lib: str, loss, tx, scale: float = 2.0**15, period: int = 2000):
    """``(init(p) -> (opt_state, scaler), step(p, s, scaler, x, y), inner(s), scale(s, scaler))``.

    ``step`` returns ``(p, s, scaler, loss)``; ``inner`` gives the wrapped optimizer's
    own state, ``scale`` the loss scale (``None`` without one); ``scaler`` is ``None``
    where the scale lives in ``opt_state``. Raises ``ImportError`` without the library.
    """
    def apply(g, s, p, keep=None, select=optax.tree_utils.tree_where):  # keep: skip if False
        u, new_s = tx.update(g, s, p)
        new_p = optax.apply_updates(p, u)
        return (new_p, new_s) if keep is None else (select(keep, new_p, p), select(keep, new_s, s))

    def plain(p, s, c, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        return *apply(g, s, p), c, value

    if lib == "f16":
        return lambda p: (tx.init(p), None), plain, lambda s: s, lambda s, c: None
    if lib == "optax":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=10)
        return lambda p: (tx.init(p), None), plain, lambda s: s.inner_state, lambda s, c: None
    if lib == "jamp":
        tx = jamp.DynamicLossScale(tx, init_scale=scale, growth_interval=period)

        def step(p, s, c, x, y):
            value, g = jax.value_and_grad(lambda q: jamp.scale_loss(loss(q, x, y), s))(p)
            return *apply(g, s, p), c, value
        return (lambda p: (tx.init(p), None), step, lambda s: s.inner_state,
                lambda s, c: jamp.loss_scale(s))
    if lib == "flax":
        from flax.training.dynamic_scale import DynamicScale

        def step(p, s, ds, x, y):  # Flax's examples: jnp.where over params and opt_state
            ds, fin, value, g = ds.value_and_grad(loss)(p, x, y)
            return *apply(g, s, p, fin), ds, value
        return (lambda p: (tx.init(p), DynamicScale(  # grows on the (interval + 1)-th step
            growth_interval=period - 1, fin_steps=jnp.zeros((), jnp.int32),
            scale=jnp.asarray(scale, F32))), step, lambda s: s, lambda s, ds: ds.scale)
    if lib == "jmp":
        import jmp

        def step(p, s, ls, x, y):
            value, g = jax.value_and_grad(lambda q: ls.scale(loss(q, x, y)))(p)
            g = ls.unscale(g)
            fin = jmp.all_finite(g)
            return *apply(g, s, p, fin, jmp.select_tree), ls.adjust(fin), value
        return (lambda p: (tx.init(p), jmp.DynamicLossScale(
            jnp.asarray(scale, F32), period=period)), step, lambda s: s,
            lambda s, ls: ls.loss_scale)
    import mpx

    def step(p, s, ls, x, y):  # mpx casts the arguments to float16 itself
        value, ls, fin, g = mpx.filter_value_and_grad(loss, scaling=ls)(p, x, y)
        return *mpx.optimizer_update(p, tx, s, g, fin), ls, value
    return (lambda p: (tx.init(p), mpx.DynamicLossScaling(
        jnp.asarray(scale, F32), jnp.asarray(1.0, F32), period=period)),
        step, lambda s: s, lambda s, ls: ls.loss_scaling)


def version(dist: str) -> str:
    """The installed version of ``dist``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def mlp(width: int, depth: int, batch: int):
    """``(loss, params, x, y)``: the float16-compute MLP and one batch for it."""
    widths = [256] + [width] * depth + [10]
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    params = [{"w": jax.random.normal(k, (n, m), F32) / n**0.5, "b": jnp.zeros((m,), F32)}
              for k, n, m in zip(jax.random.split(kp, len(widths) - 1), widths[:-1],
                                 widths[1:], strict=True)]

    def loss(params, x, y):
        h = x.astype(F16)
        for i, layer in enumerate(params):
            h = h @ layer["w"].astype(F16) + layer["b"].astype(F16)
            h = jax.nn.gelu(h) if i < len(params) - 1 else h
        return optax.softmax_cross_entropy_with_integer_labels(h.astype(F32), y).mean()

    x = jax.random.normal(kx, (batch, 256), F32)
    return loss, params, x, jax.random.randint(ky, (batch,), 0, 10)


def time_all(libs, width, depth, batch, warmup, steps) -> dict[str, float]:
    """Median ms per step of each library's step (and ``f16``), timed round-robin."""
    loss, params, x, y = mlp(width, depth, batch)
    carry, fns = {}, {}
    for lib in ("f16", *libs):
        init, step, _, _ = variant(lib, loss, optax.adamw(1e-4, weight_decay=0.05))
        p = jax.tree.map(jnp.copy, params)
        carry[lib], fns[lib] = (p, *init(p)), jax.jit(step, donate_argnums=(0, 1))
    times: dict[str, list[float]] = {lib: [] for lib in carry}
    order = list(carry)
    for i in range(warmup + steps):
        for lib in order[i % len(order):] + order[:i % len(order)]:
            t0 = time.perf_counter()
            *state, value = jax.block_until_ready(fns[lib](*carry[lib], x, y))
            if i >= warmup:
                times[lib].append(time.perf_counter() - t0)
            carry[lib] = tuple(state)
    return {lib: statistics.median(t) * 1e3 for lib, t in times.items()}


def same(a, b) -> bool:
    """Bit-identical trees (dtypes, shapes and bytes)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(u).dtype == np.asarray(v).dtype
        and np.asarray(u).tobytes() == np.asarray(v).tobytes() for u, v in zip(la, lb, strict=True))


def facts(lib: str) -> dict[str, Any]:
    """Runs the scenarios (``params = {"w": 4 floats}``, gradient ``x``) for one library."""
    f16_loss = lambda p, x, y: jnp.sum(p["w"].astype(F16) * x.astype(F16)).astype(F32)
    p0, good = {"w": jnp.array([0.5, -1.25, 2.0, 3.0], F32)}, jnp.array([1, .5, .25, 2], F32)
    out: dict[str, Any] = {}
    # 1. exact skip: a good step, then a bad one (inf, -inf or NaN in the gradient), each
    init, step, inner, scale = variant(lib, f16_loss, optax.adamw(1e-3), 2.0**10, 1000)
    step = jax.jit(step)
    state = (p0, *init(p0))
    for name, bad in (("inf", jnp.inf), ("-inf", -jnp.inf), ("nan", jnp.nan)):
        *state, _ = step(*state, good, None)
        *after, _ = step(*state, good.at[1].set(bad), None)
        out[f"skip_exact_{name}"] = same(state[0], after[0]) and same(inner(state[1]),
                                                                       inner(after[1]))
        before_s, after_s = scale(*state[1:]), scale(*after[1:])
        out[f"backoff_{name}"] = None if before_s is None else bool(after_s < before_s)
        state = after
    # 2. the gradient the optimizer gets, on the steps where the scale grows (every 2nd)
    record = optax.GradientTransformation(lambda p: {"g": jnp.zeros_like(p["w"])},
                                          lambda g, s, p=None: (g, {"g": g["w"]}))
    init, step, inner, scale = variant(lib, f16_loss, record, 2.0**10, 2)
    step, state, ratios = jax.jit(step), (p0, *init(p0)), []
    for _ in range(6):
        *after, _ = step(*state, good, None)
        if scale(*state[1:]) is not None and scale(*after[1:]) > scale(*state[1:]):
            ratios.append(np.asarray(inner(after[1])["g"]) / np.asarray(good))
        state = after
    out["growth_steps"] = len(ratios)
    out["growth_grad_exact"] = all(np.all(r == 1) for r in ratios) if ratios else None
    out["growth_grad_ratio"] = float(ratios[0][0]) if ratios else None
    # 3. the largest scale reached: 200 finite steps, growth after each, default bounds
    f32_loss = lambda p, x, y: jnp.sum(p["w"] * x)
    init, step, inner, scale = variant(lib, f32_loss, optax.sgd(0.0), 2.0**15, 1)
    step, state, top = jax.jit(step), (p0, *init(p0)), None
    for _ in range(200 if scale(*state[1:]) is not None else 0):
        *state, _ = step(*state, jnp.full(4, 2.0**-10, F32), None)
        top = max(top or 0.0, float(scale(*state[1:])))
    out["max_scale"] = top
    out["scale_in_opt_state"] = None if top is None else state[2] is None
    return out


def to_markdown(r: dict[str, Any]) -> str:
    """The results file: how it was measured, then one row per library."""
    m, rows, bs = r["machine"], r["rows"], r["batches"]
    lines = [
        "# Loss-scaled float16 train step: jamp vs Flax, optax, jmp, mpx", "",
        f"- command: `{r['command']}`",
        f"- date: {r['date']}; device: {r['device']} ({r['platform']}); host {m['processor']}, "
        f"{m['cpus']} CPUs ({m['platform']}), 1-min load {r['load_before']} before, "
        f"{m['load_avg_1m']} after; " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        f"- model: MLP 256 -> {r['depth']} x {r['width']} -> 10 (GELU), float32 params, float16 "
        "compute, AdamW; jit, params and opt_state donated",
        f"- timing: {r['warmup']} warm-up + {r['steps']} steps per library, round-robin; "
        "medians; ratio = over the float16 step without loss scaling",
        "- facts: from the scenarios of `facts()` (exact = params and the optimizer's state "
        "bit-identical; growth grad = gradient given to the optimizer on a growth step / true "
        "gradient; max scale = reached in 200 finite steps, growth after each, default bounds)",
        "", "| library | " + " | ".join(f"ms b{b} | ratio b{b}" for b in bs) + " | skip exact "
        "inf/-inf/NaN | backs off on NaN | growth grad | max scale | scale in opt_state |",
        "|---" * (6 + 2 * len(bs)) + "|"]
    show = lambda v: "—" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)
    for lib, row in rows.items():
        if "error" in row:
            lines.append(f"| {NAMES[lib]} | not installed ({row['error']}) |")
            continue
        f = row.get("facts") or dict.fromkeys(FACTS)
        cells = [f"{row['ms'][str(b)]:.3f} | {row['ms'][str(b)] / rows['f16']['ms'][str(b)]:.3f}"
                 for b in bs] + ["/".join(show(f.get(f"skip_exact_{k}")) for k in BAD)]
        lines.append(f"| {NAMES[lib]} | " + " | ".join(cells + [show(f[k]) for k in FACTS]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the scenarios, times every library at every batch, writes the results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="128,512", help="comma-separated batch sizes")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--libs", default=",".join(LIBS), help="comma-separated, of " + str(LIBS))
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; writes nothing")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out-dir", default=str(common.RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.width, args.depth, args.steps, args.warmup = "8", 16, 1, 2, 2
    batches, load_before = [int(b) for b in args.batch.split(",")], common.machine()["load_avg_1m"]
    rows: dict[str, dict[str, Any]] = {"f16": {"ms": {}}}
    for lib in [lib for lib in LIBS if lib in args.libs.split(",")]:
        try:
            rows[lib] = {"ms": {}, "facts": facts(lib)}
        except ImportError as e:
            rows[lib] = {"error": str(e)}
    libs = [lib for lib in rows if "error" not in rows[lib]][1:]
    for b in batches:
        for lib, ms in time_all(libs, args.width, args.depth, b, args.warmup, args.steps).items():
            rows[lib]["ms"][str(b)] = ms
        print(f"batch {b}: " + ", ".join(f"{k} {rows[k]['ms'][str(b)]:.3f} ms" for k in rows
                                         if "ms" in rows[k]), flush=True)
    result = dict(**common.header("scaler_comparison", argv), load_before=load_before,
                  versions={d: version(d) for d in ("jax", "optax", "flax", "jmp", DIST_MPX)},
                  batches=batches, width=args.width, depth=args.depth, steps=args.steps,
                  warmup=args.warmup, rows=rows)
    print(markdown := to_markdown(result))
    if not (args.no_write or args.quick):
        common.write_results(common.results_stem(args.out_dir, "scaler_comparison",
                                                 result["platform"]), result, markdown)
    return result


if __name__ == "__main__":
    main()
