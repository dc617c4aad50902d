"""Optimizer-state and master-weight precision (issue 33): nu storage, bytes, trajectory, time.

Parts (``--part``, default all):

- ``nu``: how to store AdamW's second moment. A float32 AdamW trains the digits ViT; at
  a few steps its ``nu`` is round-tripped through each candidate format (nu itself or
  its square root; float16 / fp8 E4M3; per-tensor or per-128 block scales) and the
  relative error of the Adam direction ``mu / (sqrt(nu) + eps)`` is measured, with the
  share of nonzero ``nu`` entries flushed to zero.
- ``bytes``: bytes per parameter of params + grads + optimizer state + master of a ViT
  + AdamW per device, per mode, at data=1 and ZeRO-3 data=8 (``jax.eval_shape`` of
  ``jamp.boost``'s state, counted by ``jamp.memory.per_device_bytes``).
- ``trajectory``: the final train loss of a 500-step run of a small MLP per mode,
  against the same run with float32 state; the remainders tier against a float32
  master bit for bit; plain bf16 parameters as the failing baseline.
- ``time``: the optimizer update alone (jitted ``tx.update`` + ``apply_updates`` on a
  ViT's parameters) per state format, against float32 state.

Run: ``python -m benchmarks.optimizer_state [--part nu] [--steps 500] [--no-write]``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jamp  # noqa: E402
from benchmarks import common  # noqa: E402
from jamp.models import vit  # noqa: E402
from jamp.optim_state import StateFormat, dequantize, quantize  # noqa: E402


def digits() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 1,797 8x8 digits, scaled to [0, 1], as (images [N, 8, 8, 1], labels)."""
    from sklearn.datasets import load_digits  # noqa: PLC0415

    d = load_digits()
    return (d.images[..., None] / 16.0).astype(np.float32), d.target.astype(np.int32)


def small_vit() -> Any:
    """The digits ViT of the trainer's recipe (4 blocks, width 64, patch 2)."""
    return vit.create("ti", num_classes=10, patch_size=2, num_layers=4, hidden_size=64,
                      num_heads=4, mlp_dim=128)


def loss_fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()


class MLP(nn.Module):
    """The trajectory's small model: 64 -> 256 -> LayerNorm -> 256 -> 10 (fast to compile)."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        x = nn.gelu(nn.Dense(256)(x))
        x = nn.LayerNorm()(x)
        x = nn.gelu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


def smoothed_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Cross-entropy with label smoothing 0.1 (the digits recipe's): a floor above 0, so
    relative differences of the final loss mean something."""
    targets = optax.smooth_labels(jax.nn.one_hot(labels, 10), 0.1)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), targets).mean()


def batches(steps: int, batch: int, seed: int):
    x, y = digits()
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        yield jnp.asarray(x[idx]), jnp.asarray(y[idx])


# ------------------------------------------------------------------------------------ nu


NU_FORMATS = {
    "fp16 nu": StateFormat("fp16"),
    "fp16 sqrt(nu)": StateFormat("fp16", sqrt=True),
    "fp8 nu": StateFormat("fp8"),
    "fp8 sqrt(nu)": StateFormat("fp8", sqrt=True),
    "fp8 nu, block 128": StateFormat("fp8", block_size=128),
    "fp8 sqrt(nu), block 128": StateFormat("fp8", block_size=128, sqrt=True),
    "bf16 nu": StateFormat("bf16"),
}

MU_FORMATS = {
    "fp8 mu": StateFormat("fp8"),
    "fp8 mu, block 128": StateFormat("fp8", block_size=128),
    "bf16 mu": StateFormat("bf16"),
}


def _direction_errors(mus, nus, eps, formats, which) -> dict[str, tuple[float, float]]:
    """Relative error of mu / (sqrt(nu) + eps) with ``which`` state round-tripped, and
    the share of nonzero entries of that state flushed to zero."""
    cat = lambda xs: jnp.concatenate([x.ravel() for x in xs])
    mu, nu = cat(mus), cat(nus)
    ref = mu / (jnp.sqrt(nu) + eps)
    out = {}
    for name, fmt in formats.items():
        src = nus if which == "nu" else mus
        back = cat([dequantize(quantize(x, fmt), fmt) for x in src])
        d = mu / (jnp.sqrt(back) + eps) if which == "nu" else back / (jnp.sqrt(nu) + eps)
        orig = nu if which == "nu" else mu
        out[name] = (float(jnp.linalg.norm(d - ref) / jnp.linalg.norm(ref)),
                     float(jnp.mean((back == 0) & (orig != 0))))
    return out


def synthetic_state(seed: int = 0) -> tuple[list[jax.Array], list[jax.Array]]:
    """A state with the spread of a large model's: per-element gradient magnitudes
    log-uniform over 10**-7 .. 10**1 (rare tokens' embeddings next to hot ones), so
    ``nu`` spans 16 decades."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    g = jnp.exp(jax.random.uniform(k1, (1024, 1024), minval=-7, maxval=1) * jnp.log(10.0))
    mu = g * jax.random.normal(k2, g.shape) * 0.3
    nu = (g * (1 + 0.1 * jax.random.normal(k3, g.shape))) ** 2
    return [mu], [nu]


def part_nu(args) -> dict[str, Any]:
    lr, eps = 3e-3, 1e-8
    boosted = jamp.boost(small_vit(), optax.adamw(lr, weight_decay=0.1), loss_fn, "fp32")
    data = batches(args.steps, 64, 0)
    x, y = next(data)
    state = boosted.init(jax.random.key(0), (x, y))
    at = sorted({1, 10, 100, args.steps})
    rows = {name: [] for name in {**NU_FORMATS, **MU_FORMATS}}
    for step in range(1, args.steps + 1):
        state, _ = boosted.step(state, next(data) if step > 1 else (x, y))
        if step not in at:
            continue
        adam = [s for s in jax.tree_util.tree_leaves(
            state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
        for which, formats in (("nu", NU_FORMATS), ("mu", MU_FORMATS)):
            errs = _direction_errors(jax.tree_util.tree_leaves(adam.mu),
                                     jax.tree_util.tree_leaves(adam.nu), eps, formats, which)
            for name, (err, flushed) in errs.items():
                rows[name].append((step, err, flushed))
    mus, nus = synthetic_state()
    for which, formats in (("nu", NU_FORMATS), ("mu", MU_FORMATS)):
        for name, (err, flushed) in _direction_errors(mus, nus, eps, formats, which).items():
            rows[name].append(("synthetic", err, flushed))
    table = [[name] + [f"{e:.2e} ({100 * f:.2f}%)" for _, e, f in vals]
             for name, vals in rows.items()]
    legend = ("Relative error of the Adam direction mu / (sqrt(nu) + eps) with one state "
              "round-tripped through the format (in brackets: nonzero entries flushed to 0), "
              "digits ViT with float32 AdamW (lr 3e-3, wd 0.1, batch 64) at each step, and a "
              "synthetic state whose gradients span 1e-7..1e1.\n\n")
    md = legend + "\n".join(common.table(" | ".join(["state stored as"] + [f"step {s}" for s in at]
                                            + ["synthetic, 16 decades"]),
                                 table))
    print(md)
    return {"nu": {name: [{"step": s, "rel_err": e, "flushed": f} for s, e, f in vals]
                   for name, vals in rows.items()}, "nu_md": md}


# --------------------------------------------------------------------------------- bytes


BYTES_ROWS = [  # label, mode, optimizer_state, master_weights (None: the mode's)
    ("bf16 (f32 params and AdamW state)", "bf16", None, None),
    ("fp16_naive (f16 params, f32 master)", "fp16_naive", None, None),
    ("bf16_pure (bf16 params and state, no master: lossy)", "bf16_pure", None, None),
    ("fp8 state + float32 master", "bf16_lowmem_exact", None, "float32"),
    ("bf16_lowmem_exact (fp8 state, remainders)", "bf16_lowmem_exact", None, None),
    ("fp8 state + kahan", "bf16_lowmem_exact", None, "kahan"),
    ("bf16 state + stochastic rounding", "bf16_lowmem", "bf16", None),
    ("bf16_lowmem (fp8 state, stochastic rounding)", "bf16_lowmem", None, None),
]


BYTES_LEGEND = (
    "Per device, bytes per parameter. ViT-B/16 (224px, 1000 classes) + AdamW: params + grads "
    "+ optimizer state + master, counted from the trainer's state with jax.eval_shape "
    "(jamp.memory.per_device_bytes; grads in the params' dtype, split over 'data' at ZeRO-3). "
    "Small ViT (ViT-Ti widths, 2 layers, 32px, patch 4): the compiled train step's argument "
    "bytes less the batch, against the same JAX-level count without the grads (grads are not "
    "arguments).\n\n")


def _experiment(mode, optimizer_state, master_weights, data, stage, model, layers, image,
                patch):
    from jamp import experiment  # noqa: PLC0415
    from jamp.apply import apply_policy  # noqa: PLC0415
    from jamp.config import vit_config  # noqa: PLC0415
    from jamp.parallel import zero  # noqa: PLC0415

    config = vit_config(mode)
    for key, value in dict(model=model, hidden_size=None, mlp_dim=None, num_layers=layers,
                           num_heads=None, patch_size=patch, image_size=image, batch_size=8,
                           zero_stage=stage, dropout_rate=0.0, progress=False,
                           optimizer_state=optimizer_state,
                           master_weights=master_weights).items():
        config[key] = value
    config.mesh.data, config.mesh.model, config.mesh.pipe = data, 1, 1
    with warnings.catch_warnings():  # data=1 of 8 devices: on purpose
        warnings.simplefilter("ignore")
        exp = experiment.build_experiment(config)
    module = vit.create(model, num_classes=1000, patch_size=patch, dropout_rate=0.0,
                        **({} if layers is None else {"num_layers": layers}),
                        scan_layers=config.scan_layers,
                        layer_runner=zero.GatherPerLayer() if stage == 3 else None)
    net = apply_policy(module, exp.precision)
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(exp, model=net, apply_fn=net.apply, info=dataclasses.replace(
        exp.info, num_classes=1000, image_shape=(image, image, 3)))


def _per_device(exp, abstract, stage):
    from jax.sharding import NamedSharding  # noqa: PLC0415

    from jamp.parallel import zero  # noqa: PLC0415

    mesh = exp.mesh

    def grad(a):  # a gradient per parameter in its dtype, split over 'data' from stage 2
        spec = zero.without_data(a.sharding.spec)
        dim = zero.split_dim(a.shape, spec, mesh.shape["data"]) if stage >= 2 else None
        return NamedSharding(mesh, zero.with_data(spec, dim, len(a.shape)))
    return jamp.memory.per_device_bytes(abstract.params, abstract.opt_state,
                                        jax.tree_util.tree_map(grad, abstract.params))


def part_bytes(args) -> dict[str, Any]:
    from jamp import experiment, parallel, train  # noqa: PLC0415

    rows = []
    for label, mode, state, master in BYTES_ROWS[:args.rows]:
        row = {"label": label}
        for data, stage in ((1, 0), (8, 3)):
            exp = _experiment(mode, state, master, data, stage, "b", None, 224, 16)
            with jax.set_mesh(exp.mesh):
                abstract, _ = experiment.state_shardings(exp, jax.random.key(0))
            n = sum(x.size for x in jax.tree_util.tree_leaves(abstract.params))
            pd = _per_device(exp, abstract, stage)
            row[f"data{data}"] = {**pd.as_dict(), "params_count": n,
                                  "bytes_per_param": pd.total / n}
            if args.compile:  # the compiled step's argument bytes, on a small ViT
                small = _experiment(mode, state, master, data, stage, "ti", 2, 32, 4)
                with jax.set_mesh(small.mesh):
                    sabs, shardings = experiment.state_shardings(small, jax.random.key(0))
                sharding = parallel.batch_sharding(small.mesh)
                batch = {"image": jax.ShapeDtypeStruct((8, 32, 32, 3), jnp.float32,
                                                       sharding=sharding),
                         "label": jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sharding)}
                import flax.linen as nn  # noqa: PLC0415

                with jax.set_mesh(small.mesh), nn.logical_axis_rules(
                        parallel.LOGICAL_AXIS_RULES):
                    step = train.jit_train_step(small, shardings, sabs).lower(
                        sabs, batch, jax.random.key(0)).compile()
                arg = step.memory_analysis().argument_size_in_bytes - \
                    jamp.memory.bytes_per_device(batch)
                spd = _per_device(small, sabs, stage)
                sn = sum(x.size for x in jax.tree_util.tree_leaves(sabs.params))
                row[f"data{data}"].update(
                    small_params=sn, small_jax_state_per_param=(spd.total - spd.grads) / sn,
                    small_compiled_args_per_param=arg / sn)
            print(label, data, f"{row[f'data{data}']['bytes_per_param']:.2f} B/param",
                  file=sys.stderr, flush=True)
        rows.append(row)
    cells = lambda r, d: f"{r[d]['bytes_per_param']:.2f}"
    comp = lambda r, d: (f"{r[d]['small_compiled_args_per_param']:.2f} / "
                         f"{r[d]['small_jax_state_per_param']:.2f}"
                         if "small_compiled_args_per_param" in r[d] else "n/a")
    md = BYTES_LEGEND + "\n".join(common.table(
        "state precision | ViT-B/16 B/param, data=1 | ViT-B/16 B/param, ZeRO-3 data=8 | "
        "small ViT compiled args / JAX state, data=1 | same, ZeRO-3 data=8",
        [(r["label"], cells(r, "data1"), cells(r, "data8"), comp(r, "data1"), comp(r, "data8"))
         for r in rows]))
    print(md)
    return {"bytes": rows, "bytes_md": md}


# ---------------------------------------------------------------------------- trajectory


def _f32_ref(tx):
    return jamp.optim_state.bf16_master(tx, "float32")


def _fp8_f32_master(tx):
    return jamp.optim_state.bf16_master(jamp.low_precision_state(
        tx, jamp.optim_state.PRESETS["fp8"], strict=False), "float32")


TRAJECTORY_ROWS = [  # label, mode, overrides, optimizer wrapper, reference label
    ("R: f32 state, f32 master (ties away)", "bf16_lowmem",
     dict(optimizer_state="float32", master_weights=False), _f32_ref, None),
    ("f32 state, remainders", "bf16_lowmem",
     dict(optimizer_state="float32", master_weights="remainders"), None, "R"),
    ("F: fp8 state, f32 master (ties away)", "bf16_lowmem",
     dict(optimizer_state="float32", master_weights=False), _fp8_f32_master, "R"),
    ("bf16_lowmem_exact (fp8 state, remainders)", "bf16_lowmem_exact", {}, None, "F"),
    ("bf16_lowmem (fp8 state, stochastic)", "bf16_lowmem", {}, None, "R"),
    ("fp8 state, kahan", "bf16_lowmem_exact", dict(master_weights="kahan"), None, "R"),
    ("bf16 state, remainders", "bf16_lowmem_exact", dict(optimizer_state="bf16"), None, "R"),
    ("f32 state, jamp.master_weights (ties to even)", "bf16_lowmem",
     dict(optimizer_state="float32", master_weights="float32"), None, "R"),
    ("baseline: bf16 params, no master (none)", "bf16_lowmem",
     dict(optimizer_state="float32", master_weights="none"), None, "R"),
    ("baseline: bf16_pure (optax on bf16 params)", "bf16_pure", {}, None, "R"),
    ("fp32 mode (f32 params, for scale)", "fp32", {}, None, "R"),
]


LOW_LR_ROWS = ("R:", "bf16_lowmem", "baseline")
"""The rows run again at the later (small) learning rates, where updates fall below half
an ulp of bf16 parameters."""


def _run(mode, overrides, wrapper, steps, lr, seed):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 50, steps)
    tx = optax.adamw(schedule, weight_decay=0.1)
    if wrapper is not None:
        tx = wrapper(tx)
    mp = jamp.mixed_precision(mode, **overrides)
    boosted = jamp.boost(MLP(), tx, smoothed_loss, mp, seed=seed)
    data = batches(steps, 64, seed)
    first = next(data)
    state = boosted.init(jax.random.key(seed), first)
    state, _ = boosted.step(state, first)
    for b in data:
        state, _ = boosted.step(state, b)
    x, y = digits()
    loss = float(boosted.eval_step(state, (jnp.asarray(x), jnp.asarray(y)))["loss"])
    return loss, jax.device_get(state.params)


def _same(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb,
                                                                                 strict=True))


def part_trajectory(args) -> dict[str, Any]:
    out = {}
    for lr in args.lrs:
        rows, ref = [], {}
        for label, mode, overrides, wrapper, against in TRAJECTORY_ROWS:
            if lr != args.lrs[0] and not any(k in label for k in LOW_LR_ROWS):
                continue
            t0 = time.time()
            loss, params = _run(mode, overrides, wrapper, args.steps, lr, 0)
            if label.startswith("R:"):  # the seed-to-seed spread, for scale
                other, _ = _run(mode, overrides, wrapper, args.steps, lr, 1)
                rows.append(dict(label="R with seed 1 (data order, init, rounding)",
                                 loss=other, vs_R=(other - loss) / loss))
            tag = label.split(":")[0]
            if against is None or len(tag) == 1:
                ref[tag] = (loss, params)
            base = ref["R"][0]
            row = dict(label=label, loss=loss, vs_R=(loss - base) / base)
            if against in ref:
                row["bit_identical_to"] = against if _same(params, ref[against][1]) else None
            rows.append(row)
            print(f"lr {lr} {label}: loss {loss:.5f} ({100 * row['vs_R']:+.2f}% vs R) "
                  f"bits={row.get('bit_identical_to')} [{time.time() - t0:.0f} s]",
                  file=sys.stderr, flush=True)
        out[str(lr)] = rows
    md = []
    for lr, rows in out.items():
        md.append(f"\npeak lr {lr} ({args.steps} steps of a 64-256-LN-256-10 MLP on the "
                  "digits, AdamW wd 0.1, warm-up 50 + cosine, batch 64, seed 0; loss with "
                  "label smoothing 0.1 on all 1,797 digits)\n")
        md += common.table("run | final loss | vs R | params bit-identical to", [
            (r["label"], f"{r['loss']:.5f}", f"{100 * r['vs_R']:+.2f}%",
             r.get("bit_identical_to") or ("no" if "bit_identical_to" in r else "-"))
            for r in rows])
    md = "\n".join(md)
    print(md)
    return {"trajectory": out, "trajectory_md": md}


# --------------------------------------------------------------------------------- time


def part_time(args) -> dict[str, Any]:
    import flax.linen as nn  # noqa: PLC0415

    module = vit.create("ti", num_classes=1000, patch_size=16)
    params32 = nn.unbox(jax.eval_shape(module.init, jax.random.key(0),
                                       jnp.ones((1, 224, 224, 3)))["params"])
    n = sum(x.size for x in jax.tree_util.tree_leaves(params32))
    cases = {
        "f32 params, f32 AdamW state": ("bf16", jnp.float32),
        "f16 params + f32 master (fp16_naive)": ("fp16_naive", jnp.float16),
        "fp8 state + remainders (bf16_lowmem_exact)": ("bf16_lowmem_exact", jnp.bfloat16),
        "fp8 state + stochastic (bf16_lowmem)": ("bf16_lowmem", jnp.bfloat16),
        "bf16 state + remainders": (("bf16_lowmem_exact", "bf16"), jnp.bfloat16),
        "fp8 state + kahan": (("bf16_lowmem_exact", "fp8", "kahan"), jnp.bfloat16),
    }
    runs, results = {}, {}
    for name, (mode, dtype) in cases.items():
        if isinstance(mode, tuple):
            mp = jamp.mixed_precision(mode[0], optimizer_state=mode[1],
                                      **({"master_weights": mode[2]} if len(mode) > 2 else {}))
        else:
            mp = jamp.mixed_precision(mode)
        tx = jamp.make_optimizer(mp, optax.adamw(1e-4, weight_decay=0.1))
        params = jax.tree_util.tree_map(
            lambda a, dtype=dtype: jnp.full(a.shape, 0.01, dtype), params32)
        grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 1e-3), params)
        state = tx.init(params)

        @jax.jit
        def update(params, state, grads, tx=tx):
            u, state = tx.update(grads, state, params)
            return optax.apply_updates(params, u), state

        box = {"p": params, "s": state}

        def run(box=box, update=update, grads=grads):
            box["p"], box["s"] = jax.block_until_ready(update(box["p"], box["s"], grads))
        runs[name] = run
    times = common.time_steps(runs, warmup=2, steps=args.time_steps, rotate=True)
    base = float(np.median(times["f32 params, f32 AdamW state"]))
    for name, t in times.items():
        results[name] = {"ms": 1e3 * float(np.median(t)), "ratio": float(np.median(t)) / base}
    md = "\n".join(common.table(
        f"optimizer update (ViT-Ti/16, {n / 1e6:.1f}M params, CPU, median of "
        f"{args.time_steps}) | ms | vs f32 state",
        [(k, f"{v['ms']:.1f}", f"{v['ratio']:.2f}x") for k, v in results.items()]))
    print(md)
    return {"time": results, "time_md": md}


# ------------------------------------------------------------------------------------ main


PARTS = {"nu": part_nu, "bytes": part_bytes, "trajectory": part_trajectory, "time": part_time}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--part", default="all", choices=["all", *PARTS])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-4],
                   help="trajectory: peak learning rates (the first runs every row)")
    p.add_argument("--compile", action="store_true",
                   help="bytes: also compile a small ViT's step for its argument bytes")
    p.add_argument("--time-steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=None, help="bytes: the first this many rows")
    args = p.parse_args(argv)
    out: dict[str, Any] = common.header("optimizer_state", argv)
    for name, fn in PARTS.items():
        if args.part in ("all", name):
            t0 = time.time()
            out.update(fn(args))
            out[f"{name}_s"] = round(time.time() - t0, 1)
            print(f"[{name}: {time.time() - t0:.0f} s]", file=sys.stderr)
    if not args.no_write:
        stem = common.results_stem(args.out_dir, f"optimizer_state_{args.part}", "cpu")
        md = "\n\n".join([f"# {out['command']}", f"{out['date']}, {out['device']}, jax "
                           f"{out['jax']}, load {out['machine']['load_avg_1m']}"]
                          + [out[k] for k in out if k.endswith("_md")]) + "\n"
        common.write_results(stem, out, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
