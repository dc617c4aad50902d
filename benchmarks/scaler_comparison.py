"""A loss-scaled float16 train step in jamp, Flax, optax, jmp and mpx: speed and exactness.

Each library trains the same float16-compute model (float32 params) with AdamW in its
documented pattern: ``jamp.DynamicLossScale(adamw)`` + ``jamp.scale_loss``; Flax
``DynamicScale`` + a ``jnp.where`` skip of params and opt_state (Flax's examples);
``optax.apply_if_finite`` (a skip, no loss scale); ``jmp.DynamicLossScale`` +
``jmp.select_tree``; mpx's ``filter_value_and_grad`` + ``optimizer_update``. Steps are jitted
(params and opt_state donated), warmed up, timed round-robin; ratio = median over the
unscaled float16 step's. Small deterministic scenarios (:func:`facts`) then measure what each
skip and scale does. ``--model mlp``: 256 -> 3 x 512 -> 10, GELU, batch 128 and 512;
``--model vit``: the fp16-policy ViT-S/16 of ``benchmarks.throughput``, 224px, batch 8.

Usage::

  python -m benchmarks.scaler_comparison                   # MLP, batch 128 and 512, writes results/
  python -m benchmarks.scaler_comparison --model vit       # ViT-S/16, 224px, batch 8
  python -m benchmarks.scaler_comparison --quick           # smoke run, writes nothing
  python -m benchmarks.scaler_comparison --libs jamp,flax  # a subset
"""

from __future__ import annotations

import importlib.metadata
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import jamp
from benchmarks import common, throughput
from jamp.models import sizes

F16, F32 = jnp.float16, jnp.float32
LIBS = ("jamp", "flax", "optax", "jmp", "mpx")
BAD, FACTS = ("inf", "-inf", "nan"), ("backoff_nan", "growth_grad_ratio", "max_scale",
                                      "scale_in_opt_state")
DIST_MPX = "mixed-precision-for-jax"  # import name mpx; not a jamp dependency
NAMES = {"f16": "float16, no loss scale", "jamp": "jamp.DynamicLossScale",
         "flax": "flax DynamicScale", "optax": "optax.apply_if_finite",
         "jmp": "jmp.DynamicLossScale", "mpx": "mpx.DynamicLossScaling"}
RUNS = {"mlp": dict(batch="128,512", steps=500, warmup=20), "vit": dict(batch="8", steps=20,
                                                                       warmup=2)}
"""Per model: the defaults of ``--batch``, ``--steps`` and ``--warmup``."""
QUICK = {"mlp": dict(batch="8", steps=2, warmup=2), "vit": dict(batch="2", steps=1, warmup=0)}
"""The same for ``--quick`` (a smoke run at a tiny size)."""


def _variant(lib: str, loss, tx, scale: float = 2.0**15, period: int = 2000):
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


def _version(dist: str) -> str:
    """The installed version of ``dist``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _mlp(width: int, depth: int, batch: int):
    """``(loss, params, x, y, label)``: the float16-compute MLP and one batch for it."""
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
    return (loss, params, x, jax.random.randint(ky, (batch,), 0, 10),
            f"MLP 256 -> {depth} x {width} -> 10 (GELU)")


def _vit(quick: bool, batch: int):
    """``(loss, params, x, y, label)``: ``benchmarks.throughput``'s fp16 ViT and a batch."""
    args = throughput.parse_args(["--variant", "ti4", "--image-size", "16", "--num-layers", "1"]
                                 if quick else ["--variant", "s16"])
    model, data = throughput.build_model("fp16", args), throughput.synthetic_batch(args, batch)
    params = jax.jit(lambda x: nn.unbox(model.init(jax.random.key(0), x))["params"])(
        data["image"][:1])
    return (throughput.loss_fn(model.apply), params, data["image"], data["label"],
            f"{sizes.vit_label(args.variant, args.patch_size)}, {args.image_size}px, "
            "jamp fp16 policy")


def _time_all(libs, model, warmup, steps) -> dict[str, Any]:
    """Median ms per step of each library's step (and ``f16``), and jamp's skipped steps."""
    loss, params, x, y, _ = model
    carry, fns = {}, {}
    for lib in ("f16", *libs):
        init, step, _, _ = _variant(lib, loss, optax.adamw(1e-4, weight_decay=0.05))
        p = jax.tree.map(jnp.copy, params)
        carry[lib], fns[lib] = (p, *init(p)), jax.jit(step, donate_argnums=(0, 1))

    def run(lib):
        def one():
            *state, _ = jax.block_until_ready(fns[lib](*carry[lib], x, y))
            carry[lib] = tuple(state)
        return one

    times = common.time_steps({lib: run(lib) for lib in carry}, warmup=warmup, steps=steps,
                              rotate=True)
    skipped = int(jamp.overflow_stats(carry["jamp"][1]).steps_skipped) if "jamp" in libs else None
    return {lib: statistics.median(t) * 1e3 for lib, t in times.items()} | {"skipped": skipped}


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
    init, step, inner, scale = _variant(lib, f16_loss, optax.adamw(1e-3), 2.0**10, 1000)
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
    init, step, inner, scale = _variant(lib, f16_loss, record, 2.0**10, 2)
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
    init, step, inner, scale = _variant(lib, f32_loss, optax.sgd(0.0), 2.0**15, 1)
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
    show = lambda v: "—" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)

    def cells(lib, row):
        if "error" in row:
            return [NAMES[lib], f"not installed ({row['error']})"]
        f, ms = row.get("facts") or dict.fromkeys(FACTS), row["ms"]
        return [NAMES[lib], *(c for b in map(str, bs) for c in (
            f"{ms[b]:.3f}", f"{ms[b] / rows['f16']['ms'][b]:.3f}")),
            "/".join(show(f.get(f"skip_exact_{k}")) for k in BAD), *(show(f[k]) for k in FACTS)]

    return "\n".join([
        "# Loss-scaled float16 train step: jamp vs Flax, optax, jmp, mpx", "",
        f"- command: `{r['command']}`",
        f"- date: {r['date']}; device: {r['device']} ({r['platform']}); host {m['processor']}, "
        f"{m['cpus']} CPUs ({m['platform']}), 1-min load {r['load_before']} before, "
        f"{m['load_avg_1m']} after; " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        f"- model: {r['model']}, float32 params, float16 compute, AdamW; jit, params and "
        "opt_state donated",
        f"- timing: {r['warmup']} warm-up + {r['steps']} steps per library, round-robin; "
        "medians; ratio = over the float16 step without loss scaling",
        "- facts: from the scenarios of `facts()` (exact = params and the optimizer's state "
        "bit-identical; growth grad = gradient given to the optimizer on a growth step / true "
        "gradient; max scale = reached in 200 finite steps, growth after each, default bounds)",
        "", *common.table("library | " + " | ".join(f"ms b{b} | ratio b{b}" for b in bs)
                          + " | skip exact inf/-inf/NaN | backs off on NaN | growth grad "
                          "| max scale | scale in opt_state",
                          (cells(lib, row) for lib, row in rows.items()))]) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the scenarios, times every library at every batch, writes the results file."""
    ap = common.parser(__doc__, timing=(None, None))
    ap.add_argument("--model", choices=tuple(RUNS), default="mlp")
    ap.add_argument("--batch", help="comma-separated batch sizes (mlp: 128,512; vit: 8)")
    ap.add_argument("--libs", default=",".join(LIBS), help="comma-separated, of " + str(LIBS))
    ap.add_argument("--quick", action="store_true", help="tiny run; writes only to --out-dir")
    ap.set_defaults(out_dir=None)
    args = ap.parse_args(argv)
    out_dir = args.out_dir or (None if args.quick else common.RESULTS)
    for key, value in (QUICK if args.quick else RUNS)[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    batches, load_before = [int(b) for b in common.split(args.batch)], common.machine()[
        "load_avg_1m"]
    width, depth = (16, 1) if args.quick else (512, 3)
    build = lambda b: _mlp(width, depth, b) if args.model == "mlp" else _vit(args.quick, b)
    rows: dict[str, dict[str, Any]] = {"f16": {"ms": {}}}
    for lib in [lib for lib in LIBS if lib in common.split(args.libs)]:
        try:
            rows[lib] = {"ms": {}, "facts": facts(lib)}
        except ImportError as e:
            rows[lib] = {"error": str(e)}
    libs = [lib for lib in rows if "error" not in rows[lib]][1:]
    for b in batches:
        model = build(b)
        times = _time_all(libs, model, args.warmup, args.steps)
        for lib in ["f16", *libs]:
            rows[lib]["ms"][str(b)] = times[lib]
        if "jamp" in libs:  # the loss-scaled timing run skips no step
            rows["jamp"].setdefault("steps_skipped", {})[str(b)] = times["skipped"]
        print(f"batch {b}: " + ", ".join(f"{k} {rows[k]['ms'][str(b)]:.3f} ms" for k in rows
                                         if "ms" in rows[k]), flush=True)
    kind = "scaler_comparison" + ("_vit" if args.model == "vit" else "")
    result = dict(**common.header("scaler_comparison", argv, kind), load_before=load_before,
                  versions={d: _version(d) for d in ("jax", "optax", "flax", "jmp", DIST_MPX)},
                  batches=batches, model=model[-1], n_params=sum(
                      p.size for p in jax.tree.leaves(model[1])), steps=args.steps,
                  warmup=args.warmup, rows=rows)
    if args.model == "mlp":
        result.update(width=width, depth=depth)
    print(markdown := to_markdown(result))
    if out_dir and not args.no_write:
        common.write_results(common.results_stem(out_dir, kind, result["platform"]),
                             result, markdown)
    return result


if __name__ == "__main__":
    main()
