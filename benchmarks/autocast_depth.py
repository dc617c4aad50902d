"""jamp.autocast vs mpx vs a hand-written float16 Equinox model, by depth (issue 31).

Each variant trains the same Equinox model with AdamW in its documented pattern: float32
(plain); jamp (``jamp.autocast(loss, "fp16")`` + ``jamp.scale_loss`` +
``jamp.make_optimizer``, docs/examples/migrate_equinox.py); mpx
(``mpx.filter_value_and_grad`` with ``DynamicLossScaling`` + ``mpx.optimizer_update``);
hand-written float16 (model and batch cast to float16 inside the loss, no loss scale);
and a diagnostic, jamp with its sums of float16 values accumulated in float16 as mpx and
the hand-written model do (``f16_sums_loss``: what jamp's float32 sums cost). Per
depth: the train step's time and the gradient's alone (jitted, warmed up, timed
round-robin, median), and the optimised HLO's instruction and ``convert`` counts of the
gradient. Models: a ViT (patch 4 on 28x28x1, width 128, 4 heads, MLP 256, 10 classes;
``eqx.nn.LayerNorm`` -> ``eqx.nn.MultiheadAttention`` -> residual -> LayerNorm -> Linear ->
GELU -> Linear -> residual, per token by ``jax.vmap``) and an MLP (784 -> depth x 512 ->
10, ``eqx.nn.MLP``), batch 128.

Usage::

  python -m benchmarks.autocast_depth                      # depths 1,2,4,8,16, writes results/
  python -m benchmarks.autocast_depth --quick              # smoke run, writes nothing
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jamp
from benchmarks import common
from jamp.autocast import Rules, rewrite

F16 = jnp.float16
VARIANTS = ("fp32", "jamp", "mpx", "hand", "jamp_f16_sums")


def _eqx():
    import equinox as eqx

    return eqx


def vit(depth: int, key: jax.Array, width: int = 128, heads: int = 4, mlp: int = 256) -> Any:
    """The Equinox ViT of issue 31 with ``depth`` blocks (input ``[49, 16]`` patches).

    Example:
      >>> model = vit(1, jax.random.key(0), width=8, heads=2, mlp=16)
      >>> model(jnp.ones((49, 16))).shape
      (10,)
    """
    eqx = _eqx()

    class Block(eqx.Module):
        ln1: Any
        attn: Any
        ln2: Any
        fc1: Any
        fc2: Any

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
            self.attn = eqx.nn.MultiheadAttention(heads, width, key=k[0])
            self.fc1 = eqx.nn.Linear(width, mlp, key=k[1])
            self.fc2 = eqx.nn.Linear(mlp, width, key=k[2])

        def __call__(self, x):
            y = jax.vmap(self.ln1)(x)
            x = x + self.attn(y, y, y)
            y = jax.vmap(self.ln2)(x)
            return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(y)))

    class ViT(eqx.Module):
        embed: Any
        blocks: list
        norm: Any
        head: Any

        def __init__(self, key):
            k = jax.random.split(key, depth + 2)
            self.embed = eqx.nn.Linear(16, width, key=k[0])
            self.blocks = [Block(kb) for kb in k[2:]]
            self.norm = eqx.nn.LayerNorm(width)
            self.head = eqx.nn.Linear(width, 10, key=k[1])

        def __call__(self, patches):
            x = jax.vmap(self.embed)(patches)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x.mean(0)))

    return ViT(key)


def mlp(depth: int, key: jax.Array) -> Any:
    """784 -> ``depth`` x 512 -> 10, GELU: ``mlp(2, jax.random.key(0))``."""
    return _eqx().nn.MLP(784, 10, 512, depth=depth, activation=jax.nn.gelu, key=key)


def batch(model: str, size: int) -> tuple[jax.Array, jax.Array]:
    """Random inputs (ViT: 49 patches of 16 pixels; MLP: 784 pixels) and labels."""
    kx, ky = jax.random.split(jax.random.key(1))
    shape = (size, 49, 16) if model == "vit" else (size, 784)
    return jax.random.normal(kx, shape), jax.random.randint(ky, (size,), 0, 10)


def cross_entropy(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``jax.vmap(model)`` (float32 logits)."""
    logits = jax.vmap(model)(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _half(tree: Any) -> Any:
    eqx = _eqx()
    return jax.tree.map(lambda a: a.astype(F16) if eqx.is_inexact_array(a) else a, tree)


def hand_loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """The hand-written float16 model: model and batch cast to float16 inside the loss."""
    return cross_entropy(_half(model), x.astype(F16), y)


def f16_sums_loss(mp: Any) -> Callable:
    """A diagnostic: :func:`cross_entropy` under autocast's rules for ``mp`` but with the
    sums of half-precision values (bias and norm gradients included) accumulated in
    float16, as mpx and the hand-written model do: what jamp's float32 sums cost.

    Example:
      >>> loss = f16_sums_loss(jamp.mixed_precision("fp16"))
    """
    rules = dataclasses.replace(Rules.for_recipe(mp), cast_inputs=True, float32_sums=False)
    return rewrite(cross_entropy, rules)


def variants(model: Any) -> dict[str, tuple[Callable, Callable, Any]]:
    """Per variant: ``(step(params, opt_state, x, y), grad(params, x, y), opt_state)``,
    both jitted; ``params`` are the model's float32 arrays."""
    eqx = _eqx()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tx = optax.adamw(1e-3)
    mp = jamp.mixed_precision("fp16")
    tx16 = jamp.make_optimizer(mp, tx)
    half_loss = jamp.autocast(cross_entropy, mp)
    combine = lambda p: eqx.combine(p, static)

    def plain(loss_fn):
        def grad(p, x, y):
            return jax.grad(lambda p: loss_fn(combine(p), x, y))(p)

        def step(p, s, x, y):
            u, s = tx.update(grad(p, x, y), s, p)
            return optax.apply_updates(p, u), s

        return step, grad, tx.init(params)

    def jamp_variant(loss):
        def grad(p, s, x, y):
            return jax.grad(lambda p: jamp.scale_loss(loss(combine(p), x, y), s))(p)

        def step(p, s, x, y):
            u, s = tx16.update(grad(p, s, x, y), s, p)
            return optax.apply_updates(p, u), s

        s16 = tx16.init(params)
        return step, lambda p, x, y: grad(p, s16, x, y), s16

    out = {"fp32": plain(cross_entropy), "hand": plain(hand_loss),
           "jamp": jamp_variant(half_loss), "jamp_f16_sums": jamp_variant(f16_sums_loss(mp))}
    try:
        import mpx
    except ImportError:
        return out

    def mpx_grad(p, ls, x, y):
        return mpx.filter_value_and_grad(lambda p, x, y: cross_entropy(combine(p), x, y),
                                         scaling=ls)(p, x, y)

    def mpx_step(p, s, x, y):
        opt, ls = s
        _, ls, finite, g = mpx_grad(p, ls, x, y)
        p, opt = mpx.optimizer_update(p, tx, opt, g, finite)
        return p, (opt, ls)

    ls0 = mpx.DynamicLossScaling(jnp.asarray(2.0**15, jnp.float32), jnp.asarray(1.0, jnp.float32),
                                 period=2000)
    out["mpx"] = (mpx_step, lambda p, x, y: mpx_grad(p, ls0, x, y)[3], (tx.init(params), ls0))
    return out


def hlo_counts(fn: Callable, *args: Any) -> tuple[int, int]:
    """Instructions and ``convert``s in the optimised HLO of ``jax.jit(fn)(*args)``.

    Example:
      >>> hlo_counts(lambda x: (x * 2).astype(jnp.float16), jnp.ones(3))[1]
      1
    """
    text = jax.jit(fn).lower(*args).compile().as_text()
    lines = [line for line in text.splitlines() if re.match(r"\s+(ROOT )?%?\S+ = ", line)]
    return len(lines), sum(" convert(" in line for line in lines)


def measure(model_name: str, depth: int, size: int, steps: int, warmup: int,
            dims: dict[str, int] | None = None, parts: tuple[str, ...] = ("step", "grad"),
            hlo: bool = True) -> dict:
    """One depth: per variant the median step and gradient times (ms) and HLO counts.

    ``dims`` are :func:`vit`'s ``width``/``heads``/``mlp``; ``parts`` what is timed;
    ``hlo=False`` skips the HLO counts (one compile less per variant, for a GPU's time).
    """
    eqx = _eqx()
    key = jax.random.key(0)
    model = vit(depth, key, **(dims or {})) if model_name == "vit" else mlp(depth, key)
    x, y = batch(model_name, size)
    params = eqx.filter(model, eqx.is_inexact_array)
    runs, rows = {}, {}
    for name, (step, grad, state) in variants(model).items():
        step, grad = jax.jit(step), jax.jit(grad)
        carry = {"p": params, "s": state}

        def run_step(step=step, carry=carry):
            carry["p"], carry["s"] = step(carry["p"], carry["s"], x, y)
            jax.block_until_ready(carry["p"])

        if "step" in parts:
            runs[f"{name}/step"] = run_step
        if "grad" in parts:
            runs[f"{name}/grad"] = lambda grad=grad: jax.block_until_ready(grad(params, x, y))
        ins, conv = hlo_counts(grad, params, x, y) if hlo else (None, None)
        rows[name] = dict(grad_hlo_instructions=ins, grad_hlo_converts=conv)
    times = common.time_steps(runs, warmup=warmup, steps=steps, rotate=True)
    for key, ts in times.items():
        name, what = key.split("/")
        rows[name][f"{what}_ms"] = common.summarize_times(ts, size)["step_ms"]
    return rows


def _ratio(rows: dict, a: str, b: str, key: str) -> float | None:
    if a in rows and b in rows and rows[a].get(key) and rows[b].get(key):
        return rows[a][key] / rows[b][key]
    return None


def to_markdown(result: dict[str, Any]) -> str:
    """The results file: what ran, then one table per model."""
    lines = [f"# jamp.autocast vs mpx vs hand-written float16, by depth ({result['date']})", "",
             f"- command: `{result['command']}`",
             f"- machine: {result['machine']['cpus']} CPUs ({result['platform']}), 1-min load "
             f"{result['machine']['load_avg_1m']}; jax {result['jax']}, equinox "
             f"{result['equinox']}, mpx {result['mpx']}",
             f"- ViT {result.get('dims') or 'width 128, 4 heads, MLP 256'}; "
             f"batch {result['batch']}, AdamW; median of {result['steps']} timed rounds "
             f"after {result['warmup']}, variants interleaved; HLO: the gradient's optimised "
             "module (instructions / converts)."
             + (" XLA:CPU computes float16 by upcasting: the ratios compare costs of the "
                "same graph shapes, not GPU speed." if result["platform"] == "cpu" else ""),
             "- jamp f16-sums: a diagnostic, jamp's rules but its sums of float16 values "
             "(bias and norm gradients included) accumulated in float16, as mpx and the "
             "hand-written model do: the difference to jamp is what the float32 sums cost "
             "(XLA:CPU reduces a float32 sum of a float16 tensor from a materialised "
             "float32 copy).", ""]
    for model, by_depth in result["models"].items():
        lines += [f"## {model}", "", *common.table(
            "blocks | fp32 step ms | jamp step ms | mpx step ms | hand fp16 step ms "
            "| jamp f16-sums step ms | jamp / mpx | jamp / hand | jamp f16-sums / mpx "
            "| jamp grad ms | mpx grad ms | jamp HLO | mpx HLO | hand HLO", (
                [depth, *(common.fmt(r.get(v, {}).get("step_ms")) for v in VARIANTS),
                 common.fmt(_ratio(r, "jamp", "mpx", "step_ms"), ".2f", "x"),
                 common.fmt(_ratio(r, "jamp", "hand", "step_ms"), ".2f", "x"),
                 common.fmt(_ratio(r, "jamp_f16_sums", "mpx", "step_ms"), ".2f", "x"),
                 common.fmt(r["jamp"].get("grad_ms")),
                 common.fmt(r.get("mpx", {}).get("grad_ms")),
                 *(f"{r[v]['grad_hlo_instructions']} / {r[v]['grad_hlo_converts']}"
                   if r.get(v, {}).get("grad_hlo_instructions") is not None else "n/a"
                   for v in ("jamp", "mpx", "hand"))]
                for depth, r in by_depth.items())), ""]
    return "\n".join(lines)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs every depth of each model; writes ``results/autocast_depth-cpu-<date>``."""
    ap = common.parser(__doc__, timing=(5, 2))
    ap.add_argument("--depths", type=common.split, default=["1", "2", "4", "8", "16"])
    ap.add_argument("--models", type=common.split, default=["vit", "mlp"])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--width", type=int, default=128, help="the ViT's width")
    ap.add_argument("--heads", type=int, default=4, help="the ViT's attention heads")
    ap.add_argument("--mlp", type=int, default=256, help="the ViT's MLP width")
    ap.add_argument("--parts", type=common.split, default=["step", "grad"],
                    help="what to time: step, grad")
    ap.add_argument("--no-hlo", action="store_true", help="skip the HLO counts")
    ap.add_argument("--quick", action="store_true", help="depths 1,2, batch 4, one round")
    args = ap.parse_args(argv)
    dims = dict(width=args.width, heads=args.heads, mlp=args.mlp)
    if args.quick:
        args.depths, args.batch, args.steps, args.warmup, args.no_write = ["1", "2"], 4, 1, 1, True
    result = dict(**common.header("autocast_depth", argv), equinox=_version("equinox"),
                  mpx=_version("mixed-precision-for-jax"), batch=args.batch, steps=args.steps,
                  warmup=args.warmup, dims=", ".join(f"{k} {v}" for k, v in dims.items()),
                  models={})
    for model in args.models:
        result["models"][model] = {}
        for depth in map(int, args.depths):
            rows = measure(model, depth, args.batch, args.steps, args.warmup, dims,
                           tuple(args.parts), not args.no_hlo)
            result["models"][model][depth] = rows
            print(model, depth, {v: (round(r.get("step_ms") or r.get("grad_ms"), 3),
                                     r["grad_hlo_instructions"])
                                 for v, r in rows.items()}, flush=True)
    if not args.no_write:
        stem = common.results_stem(args.out_dir, "autocast_depth", result["platform"])
        common.write_results(stem, result, to_markdown(result))
    return result


if __name__ == "__main__":
    main()
