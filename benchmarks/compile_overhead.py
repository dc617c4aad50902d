"""What a precision policy adds to tracing and compiling a ViT's gradient (issue 30, item 8).

Per variant, the jitted ``value_and_grad`` of the cross-entropy of a ViT (``--variant``,
scanned and unscanned layers) is traced, lowered and compiled from a cleared cache, and
each stage timed (median of ``--repeats``): plain float32 (``vit.create``), hand-written
float16 (the same model applied to float16 params and images, every op in float16, as mpx
does), hand-written mixed precision (float32 master params cast to float16 inside the
loss, as jmp's ``cast_to_compute`` does: what a policy's float32 params cost by themselves),
``jamp.apply_policy(model, "fp16")`` and ``jamp.autocast(model.apply, "fp16")``. Ratios are
to the hand-written float16 model. The optimized HLO's instruction, ``convert`` and fusion
counts say what the compiler is given. XLA:CPU upcasts float16, which changes what it
compiles: CPU ratios are indicative, GPU ratios need a GPU run.

Usage::

  python -m benchmarks.compile_overhead                     # ViT-B/16, batch 8, 224px
  python -m benchmarks.compile_overhead --variant ti16 --image-size 32 --repeats 1 --no-write
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

import jamp
from benchmarks import common
from jamp.models import sizes, vit
from jamp.step import cross_entropy

VARIANTS = ("fp32", "hand_fp16", "hand_mixed", "apply_policy", "autocast")
STAGES = ("trace", "lower", "compile")


def _loss(variant: str, model: nn.Module, image_size: int) -> Any:
    """``loss(params, images, labels)`` of one variant, and the params it takes (shapes)."""
    x = jnp.zeros((1, image_size, image_size, 3))
    if variant == "apply_policy":
        policy_model = jamp.apply_policy(model, "fp16")
        params = nn.unbox(jax.eval_shape(policy_model.init, jax.random.key(0), x))["params"]
        apply = policy_model.apply
    else:
        params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), x))["params"]
        apply = jamp.autocast(model.apply, "fp16") if variant == "autocast" else model.apply
    if variant == "hand_fp16":
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float16), params)

        def loss(p, images, labels):
            logits = apply({"params": p}, images.astype(jnp.float16), train=True)
            return cross_entropy(logits.astype(jnp.float32), labels)
    elif variant == "hand_mixed":
        def loss(p, images, labels):
            half = jax.tree.map(lambda a: a.astype(jnp.float16), p)
            logits = apply({"params": half}, images.astype(jnp.float16), train=True)
            return cross_entropy(logits.astype(jnp.float32), labels)
    else:
        def loss(p, images, labels):
            logits = apply({"params": p}, images, train=True)
            return cross_entropy(logits.astype(jnp.float32), labels)
    return loss, params


def time_stages(loss: Any, params: Any, images: Any, labels: Any) -> dict[str, float]:
    """Seconds to trace, lower and compile ``jax.jit(jax.value_and_grad(loss))``, from a
    cleared cache.

    Example:
      >>> import jax.numpy as jnp
      >>> t = time_stages(lambda p, x, y: (p * x).sum(), jnp.ones(2), jnp.ones(2), None)
      >>> sorted(t)
      ['compile', 'lower', 'trace']
    """
    jax.clear_caches()
    fn = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    traced = fn.trace(params, images, labels)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    hlo = lowered.compile().as_text()
    t3 = time.perf_counter()
    return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2, **hlo_counts(hlo)}


def hlo_counts(hlo: str) -> dict[str, int]:
    """Instructions, ``convert``s and fusions of an optimized HLO module's text.

    Example:
      >>> hlo_counts("ENTRY m {\n  a = f16[2] convert(b)\n  c = f16[2] fusion(a)\n}")
      {'instructions': 2, 'converts': 1, 'fusions': 1}
    """
    return {"instructions": len(re.findall(r"^\s+\S+ = ", hlo, re.M)),
            "converts": len(re.findall(r" convert\(", hlo)),
            "fusions": len(re.findall(r" fusion\(", hlo))}


def measure(args: Any, scan: bool) -> dict[str, dict[str, float]]:
    """Median seconds per stage of each variant, layers scanned or not."""
    layers = {"num_layers": args.num_layers} if args.num_layers else {}
    model = vit.create(args.variant, num_classes=1000, scan_layers=scan, **layers)
    images = jax.ShapeDtypeStruct((args.batch, args.image_size, args.image_size, 3),
                                  jnp.float32)
    labels = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
    out: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        loss, params = _loss(variant, model, args.image_size)
        runs = [time_stages(loss, params, images, labels) for _ in range(args.repeats)]
        out[variant] = {s: statistics.median(r[s] for r in runs) for s in STAGES}
        out[variant]["total"] = sum(out[variant][s] for s in STAGES)
        out[variant].update({k: runs[0][k] for k in ("instructions", "converts", "fusions")})
        print(f"  {'scanned' if scan else 'unscanned':<9} {variant:<13} " + "  ".join(
            f"{s} {out[variant][s]:6.2f} s" for s in (*STAGES, "total")), flush=True)
    return out


def to_markdown(result: dict[str, Any]) -> str:
    """The results file: the command, then one row per (layers, variant)."""
    c = result["config"]
    lines = [f"# Trace and compile time of a ViT gradient under a precision policy "
             f"({result['date']})", "",
             f"- command: `{result['command']}`",
             f"- {sizes.vit_label(c['variant'])}, {c['image_size']}px, batch {c['batch']}; "
             f"median of {c['repeats']}; {result['machine']['cpus']} CPUs "
             f"({result['platform']}), 1-min load {result['machine']['load_avg_1m']}; jax "
             f"{result['jax']}", "", *common.table(
                 "layers | variant | trace s | lower s | compile s | total s | total / hand fp16"
                 " | HLO instructions | converts | fusions",
                 ([layers, variant, *(common.fmt(t[s], ".2f") for s in (*STAGES, "total")),
                   common.fmt(t["total"] / rows["hand_fp16"]["total"], ".2f", "x"),
                   *(str(t.get(k, "n/a")) for k in ("instructions", "converts", "fusions"))]
                  for layers, rows in result["results"].items()
                  for variant, t in rows.items()))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measures both layer forms; writes ``results/compile_overhead-cpu-<date>``."""
    ap = common.parser(__doc__)
    common.add_vit(ap, batch=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=common.split, default=["scanned", "unscanned"])
    args = ap.parse_args(argv)
    result = dict(**common.header("compile_overhead", argv),
                  config={k: getattr(args, k) for k in ("variant", "image_size", "batch",
                                                        "repeats", "num_layers")},
                  results={})
    for layers in args.layers:
        result["results"][layers] = measure(args, scan=layers == "scanned")
    if not args.no_write:
        common.write_results(common.results_stem(args.out_dir, "compile_overhead",
                                                 jax.default_backend()),
                             result, to_markdown(result))
    return result


if __name__ == "__main__":
    main()
