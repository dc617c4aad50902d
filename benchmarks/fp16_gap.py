"""Is fp16's accuracy gap on the embedded digits noise, or precision lost in the fp16 step?

Two controlled experiments on the recipe of ``python -m benchmarks.accuracy``
(``jamp.config.vit_config(mode)``, linen, one seed):

1. **Trajectories.** fp32, fp16 and bf16 train from the same initial weights on the same
   batches in the same order (the trainer's own jitted step, :func:`jamp.train.jit_train_step`,
   and data loader), ``--steps`` steps (the recipe's 1,100 by default). Per step: the loss,
   the loss scale, whether the step was skipped; at the end the test loss and accuracy.
2. **Gradients.** At the fp32 run's parameters at ``--probes`` steps (and that step's batch),
   the gradient of the loss in each mode, as the step computes it (the mode's model, the loss
   scaled by the mode's loss scale, then unscaled), against fp32's: relative error
   ``|g - g32| / |g32|``, cosine, and the share of elements that are zero in the mode's
   gradient but not in fp32's (underflow). fp16 is probed at the scale its own run had at
   that step, and at 1 and 2**24 to see how the error moves with the scale.

Usage::

  python -m benchmarks.fp16_gap                       # ~4 min alone on 2 CPU cores
  python -m benchmarks.fp16_gap --steps 200 --probes 0,100 --no-write   # quicker
  python -m benchmarks.fp16_gap --modes fp32 --probes 550,1099   # probes only (+ head in f32)
  python -m benchmarks.fp16_gap --from-accuracy results/accuracy-cpu-<date>.json
                                                      # same-seed differences between modes
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jamp
from benchmarks import common
from jamp import data, experiment, parallel
from jamp.config import vit_config
from jamp.models import vit
from jamp.step import classification_loss, eval_step
from jamp.train import jit_train_step

MODES = ("fp32", "fp16", "bf16")


def _batch(exp: experiment.Experiment, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    sharding = parallel.batch_sharding(exp.mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def trajectory(mode: str, seed: int, steps: int | None, probes: list[int]) -> dict[str, Any]:
    """One run of the trainer's step and data: per-step loss, scale and skip; test metrics;
    the parameters and batch at each probe step (before that step's update)."""
    config = vit_config(mode)
    config.update_from_flattened_dict(dict(seed=seed, progress=False))
    exp = experiment.build_experiment(config)
    rng = jax.random.key(seed)
    with jax.set_mesh(exp.mesh):
        abstract, shardings = experiment.state_shardings(exp, rng)
        state = experiment.init_state(exp, rng, shardings)
        step_fn = jit_train_step(exp, shardings, abstract)
        p_eval = jax.jit(eval_step, in_shardings=(shardings, parallel.batch_sharding(exp.mesh)))
    loader = iter(data.train_loader(
        exp.info, data_dir=config.data_dir, image_size=config.image_size,
        global_batch_size=config.batch_size, seed=seed, augment=config.augment,
        process_index=0, process_count=1, worker_count=0))
    total = exp.total_steps if steps is None else min(steps, exp.total_steps)
    out: dict[str, Any] = dict(mode=mode, loss=[], loss_scale=[], finite=[], probes={})
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        for i in range(total):
            batch = _batch(exp, next(loader))
            if i in probes:
                out["probes"][i] = (jax.device_get(state.params), jax.device_get(batch))
            state, m = step_fn(state, batch, jax.random.fold_in(rng, i))
            m = jax.device_get(m)
            out["loss"].append(float(m["loss"]))
            out["loss_scale"].append(float(m["loss_scale"]))
            out["finite"].append(bool(m["grad_finite"]))
        loss, accuracy = test_metrics(exp, state, p_eval)
    out.update(test_loss=loss, test_accuracy=accuracy, apply_fn=state.apply_fn,
               label_smoothing=config.label_smoothing, exp=exp,
               params=jax.device_get(state.params))
    return out


def test_metrics(exp: experiment.Experiment, state: Any, p_eval: Any) -> tuple[float, float]:
    """Test loss and accuracy of ``state`` (the trainer's evaluation: every image once)."""
    c, totals = exp.config, np.zeros(3)
    for b in data.eval_batches(exp.info, data_dir=c.data_dir, image_size=c.image_size,
                               global_batch_size=c.batch_size, process_index=0,
                               process_count=1):
        m = p_eval(state, _batch(exp, b))
        totals += np.array([m["loss_sum"], m["correct"], m["count"]])
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def cross_evaluate(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run's final weights evaluated by each mode's model: does a mode's test loss come
    from its training or from its half-precision forward pass at evaluation?"""
    rows = []
    for trained, r in runs.items():
        for model, e in runs.items():
            state = train_state.TrainState.create(apply_fn=e["apply_fn"], params=r["params"],
                                                  tx=optax.identity())
            with jax.set_mesh(e["exp"].mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
                loss, accuracy = test_metrics(e["exp"], state, jax.jit(eval_step))
            rows.append(dict(trained=trained, evaluated=model, test_loss=loss,
                             test_accuracy=accuracy))
            print(f"weights trained in {trained}, evaluated in {model}: test loss {loss:.4f}, "
                  f"accuracy {100 * accuracy:.2f}%", flush=True)
    return rows


def head_f32_apply_fn(seed: int) -> Any:
    """The recipe's fp16 ViT with its classifier head (``head``) in float32: a policy
    override, ``jamp.mixed_precision("fp16", overrides={"head": "f32"})``."""
    config = vit_config("fp16")
    config.seed = seed
    exp = experiment.build_experiment(config)
    module = vit.create(config.model, num_classes=exp.info.num_classes,
                        patch_size=config.patch_size, dropout_rate=config.dropout_rate,
                        remat=config.remat, scan_layers=config.scan_layers,
                        **experiment.model_dims(config))
    return jamp.apply_policy(module, jamp.mixed_precision("fp16", overrides={"head": "f32"})).apply


def gradient_fn(apply_fn: Any, label_smoothing: float) -> Any:
    """``grads(params, batch, scale)``, jitted once: the step's gradient of one mode, the
    loss x ``scale`` differentiated, then / ``scale`` in float32 (as the loss scale unscales
    it)."""
    loss_fn = classification_loss(label_smoothing)
    holder = type("S", (), {"apply_fn": staticmethod(apply_fn)})()

    @jax.jit
    def grads(p, b, scale):
        g = jax.grad(lambda q: loss_fn(holder, {"params": q}, b, jax.random.key(0))[0]
                     * scale)(p)
        return jax.tree.map(lambda x: x.astype(jnp.float32) / scale, g)

    return lambda p, b, scale: jax.device_get(grads(p, b, jnp.float32(scale)))


def compare(g: Any, g32: Any, scale: float = 1.0) -> dict[str, float]:
    """Relative error, cosine and underflow share of ``g`` against ``g32``; with the loss
    ``scale``, the shares of fp32's nonzero elements that a float16 gradient at that scale
    would hold as a subnormal (below 2**-14) or flush to zero (below 2**-25).

    Example:
      >>> c = compare({"a": np.array([1.0, 0.0, 2.0])}, {"a": np.array([1.0, 1e-9, 2.0])})
      >>> c["underflow_share"], c["rel_err"] < 1e-8, c["f16_flush_share"]
      (0.3333333333333333, True, 0.3333333333333333)
    """
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64)
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g32)]).astype(np.float64)
    nb = np.linalg.norm(b)
    return dict(rel_err=float(np.linalg.norm(a - b) / nb),
                cosine=float(a @ b / (np.linalg.norm(a) * nb)),
                underflow_share=float(np.mean((a == 0) & (b != 0))),
                zeros=float(np.mean(a == 0)), zeros_fp32=float(np.mean(b == 0)),
                f16_subnormal_share=float(np.mean((b != 0) & (np.abs(b * scale) < 2.0**-14))),
                f16_flush_share=float(np.mean((b != 0) & (np.abs(b * scale) < 2.0**-25))),
                finite=bool(np.isfinite(a).all()))


def worst_leaves(g: Any, g32: Any, n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` parameters holding the largest shares of the squared gradient error."""
    errs = [("/".join(str(getattr(k, "key", k)) for k in path),
             float(np.sum((np.asarray(x, np.float64) - y) ** 2)))
            for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(g)[0],
                                    jax.tree.leaves(g32), strict=True)]
    total = sum(e for _, e in errs) or 1.0
    return sorted(((k, e / total) for k, e in errs), key=lambda e: -e[1])[:n]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs both experiments; prints them and writes ``results/fp16_gap-<platform>-<date>``."""
    ap = common.parser(__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", type=common.split, default=list(MODES),
                    help="whose trajectories to run (fp32 always; without fp16 its probes "
                         "use --scale)")
    ap.add_argument("--from-accuracy", metavar="RESULTS_JSON", default=None,
                    help="only print the same-seed differences of an accuracy results file")
    ap.add_argument("--name", default="fp16_gap", help="the results file's name")
    ap.add_argument("--scale", type=float, default=32768.0,
                    help="fp16 probes' loss scale when the fp16 run is not made")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: all)")
    ap.add_argument("--probes", type=lambda t: [int(s) for s in common.split(t)],
                    default=[0, 275, 550, 1099])
    args = ap.parse_args(argv)
    if args.from_accuracy:
        diffs = seed_differences(args.from_accuracy)
        print("\n".join(differences_markdown(diffs)))
        return diffs
    head = common.header("fp16_gap", argv)
    modes = ["fp32", *(m for m in MODES if m in args.modes and m != "fp32")]
    runs = {m: trajectory(m, args.seed, args.steps, args.probes) for m in modes}
    n = len(runs["fp32"]["loss"])
    result: dict[str, Any] = dict(**head, seed=args.seed, steps=n, runs={}, probes=[])
    for m, r in runs.items():
        loss = np.array(r["loss"])
        d = np.abs(loss - np.array(runs["fp32"]["loss"]))
        skipped = [i for i, f in enumerate(r["finite"]) if not f]
        result["runs"][m] = dict(
            test_loss=r["test_loss"], test_accuracy=r["test_accuracy"], skipped_steps=skipped,
            scales=sorted(set(r["loss_scale"])),
            first_step_loss_differs=next((i for i in range(n) if d[i] != 0), None),
            mean_abs_loss_diff={f"{a}-{b}": float(d[a:b].mean()) for a, b in
                                ((0, 10), (10, 100), (100, 500), (500, n)) if a < b <= n},
            mean_train_loss_last_100=float(loss[-100:].mean()))
        print(f"{m}: test loss {r['test_loss']:.4f}, accuracy {100 * r['test_accuracy']:.2f}%, "
              f"skipped steps {skipped}, scales {sorted(set(r['loss_scale']))}, "
              f"|loss - fp32 loss| by steps {result['runs'][m]['mean_abs_loss_diff']}",
              flush=True)
    smoothing = runs["fp32"]["label_smoothing"]
    result["cross_evaluation"] = cross_evaluate(runs)
    fns = {m: gradient_fn(r["apply_fn"], smoothing) for m, r in runs.items()}
    for m in ("bf16", "fp16"):
        if m not in fns:  # the mode's model without its run
            exp = experiment.build_experiment(vit_config(m))
            fns[m] = gradient_fn(exp.apply_fn, smoothing)
    fns["fp16 head f32"] = gradient_fn(head_f32_apply_fn(args.seed), smoothing)
    for p in args.probes:
        if p not in runs["fp32"]["probes"]:
            continue
        params, batch = runs["fp32"]["probes"][p]
        grads = {m: fns[m](params, batch, 1.0) for m in ("fp32", "bf16")}
        run_scale = runs["fp16"]["loss_scale"][p] if "fp16" in runs else args.scale
        scales = {"fp16 (its run's scale)": run_scale, "fp16 scale 1": 1.0,
                  "fp16, head in f32 (its run's scale)": run_scale}
        for label, s in scales.items():
            grads[label] = fns["fp16 head f32" if "head" in label else "fp16"](params, batch, s)
        for label, g in grads.items():
            if label == "fp32":
                continue
            scale = scales.get(label, 1.0)
            c = dict(step=p, gradient=label, **compare(g, grads["fp32"], scale), scale=scale,
                     worst=worst_leaves(g, grads["fp32"]))
            result["probes"].append(c)
            print(f"step {p:4d} {label:<24} scale {c['scale']:>10g}: rel err {c['rel_err']:.2e}"
                  f"  cos {c['cosine']:.6f}  underflow {100 * c['underflow_share']:.3f}%  "
                  f"(f16 subnormal at this scale {100 * c['f16_subnormal_share']:.3f}%, "
                  f"flushed {100 * c['f16_flush_share']:.3f}%)  "
                  f"largest error share {c['worst'][0][0]} {100 * c['worst'][0][1]:.0f}%",
                  flush=True)
    if not args.no_write:
        stem = common.results_stem(args.out_dir, args.name, head["platform"])
        common.write_results(stem, result, _to_markdown(result))
    return result


def _to_markdown(result: dict[str, Any]) -> str:
    """The measurements as tables (the note interpreting them is written beside)."""
    lines = [f"# fp16 vs fp32 vs bf16: same weights, same batches (seed {result['seed']})", "",
             f"- command: `{result['command']}`",
             f"- date: {result['date']}; device: {result['device']}; jax {result['jax']}", "",
             *common.table(
                 "mode | test loss | test accuracy | skipped steps | loss scales | mean "
                 "abs(loss − fp32 loss), steps 0-10 / 10-100 / 100-500 / 500-end", (
                     [m, f"{r['test_loss']:.4f}", f"{100 * r['test_accuracy']:.2f}%",
                      r["skipped_steps"] or "none",
                      ", ".join(f"{s:g}" for s in r["scales"]),
                      " / ".join(f"{v:.2e}" for v in r["mean_abs_loss_diff"].values())]
                     for m, r in result["runs"].items())), "",
             *common.table(
                 "step | gradient | loss scale | relative error vs fp32 | cosine | zero here, "
                 "not in fp32 | fp32 grad x scale < 2^-14 (f16 subnormal) | < 2^-25 (f16 "
                 "zero) | parameter with the largest share of the error", (
                     [p["step"], p["gradient"], f"{p['scale']:g}", f"{p['rel_err']:.2e}",
                      f"{p['cosine']:.6f}", f"{100 * p['underflow_share']:.4f}%",
                      *((f"{100 * p['f16_subnormal_share']:.4f}%",
                         f"{100 * p['f16_flush_share']:.4f}%") if "fp16" in p["gradient"]
                        else ("—", "—")),
                      f"{p['worst'][0][0]} ({100 * p['worst'][0][1]:.0f}%)"]
                     for p in result["probes"]))]
    if result.get("cross_evaluation"):
        lines += ["", "Each run's final weights evaluated by each mode's model:", "",
                  *common.table("weights trained in | evaluated in | test loss | test accuracy",
                                ([x["trained"], x["evaluated"], f"{x['test_loss']:.4f}",
                                  f"{100 * x['test_accuracy']:.2f}%"]
                                 for x in result["cross_evaluation"]))]
    return "\n".join(lines) + "\n"



def seed_differences(accuracy_json: str | Path) -> dict[str, Any]:
    """From an accuracy results file (``python -m benchmarks.accuracy --seeds ...``): the
    differences of test loss and accuracy between modes trained from the same seed and
    framework (same initial weights, same batch order), and between the frameworks of the
    same mode and seed (a last-bit perturbation: the control for what chaos alone does).

    Example: ``seed_differences("benchmarks/results/accuracy-cpu-2026-11-26.json")``.
    """
    rows = [r for r in json.loads(Path(accuracy_json).read_text())["results"]
            if r["status"] == "ok"]
    by = {(r["mode"], r["framework"], r["seed"]): r for r in rows}
    out: dict[str, Any] = {}

    def pairs(label: str, keys: list[tuple[tuple, tuple]]) -> None:
        d_loss = [by[a]["test_loss"] - by[b]["test_loss"] for a, b in keys]
        d_acc = [100 * (by[a]["test_accuracy"] - by[b]["test_accuracy"]) for a, b in keys]
        if d_loss:
            out[label] = dict(
                n=len(keys), loss=d_loss, accuracy_pt=d_acc,
                loss_mean=statistics.fmean(d_loss), accuracy_mean=statistics.fmean(d_acc),
                loss_std=statistics.stdev(d_loss) if len(d_loss) > 1 else None,
                accuracy_std=statistics.stdev(d_acc) if len(d_acc) > 1 else None,
                loss_positive=sum(x > 0 for x in d_loss))

    for mode in ("fp16", "bf16"):
        pairs(f"{mode} − fp32 (same seed, same framework)",
              [((mode, f, s), ("fp32", f, s)) for (m, f, s) in by if m == mode
               and ("fp32", f, s) in by])
    pairs("fp16 − bf16 (same seed, same framework)",
          [(("fp16", f, s), ("bf16", f, s)) for (m, f, s) in by if m == "fp16"
           and ("bf16", f, s) in by])
    for mode in ("fp32", "fp16", "bf16"):
        pairs(f"{mode}: NNX − linen (same seed)",
              [((mode, "nnx", s), (mode, "linen", s)) for (m, f, s) in by
               if m == mode and f == "nnx" and (mode, "linen", s) in by])
    return out


def differences_markdown(diffs: dict[str, Any]) -> list[str]:
    """The table of :func:`seed_differences`."""
    cell = lambda v, spec: "n/a" if v is None else f"{v:{spec}}"
    return common.table(
        "pair | runs | test loss difference per run | mean ± std | runs with a higher loss "
        "| accuracy difference per run (pt) | mean ± std (pt)", (
            [k, d["n"], " / ".join(f"{x:+.4f}" for x in d["loss"]),
             f"{d['loss_mean']:+.4f} ± {cell(d['loss_std'], '.4f')}",
             f"{d['loss_positive']} of {d['n']}",
             " / ".join(f"{x:+.2f}" for x in d["accuracy_pt"]),
             f"{d['accuracy_mean']:+.2f} ± {cell(d['accuracy_std'], '.2f')}"]
            for k, d in diffs.items()))


if __name__ == "__main__":
    main()
