"""JAX-level memory of a ViT training step per precision mode (no device memory used).

For each model and mode, ``jamp.memory_report`` counts the bytes of parameters, gradients,
optimizer state (AdamW wrapped by ``jamp.make_optimizer``) and the residuals the forward pass
saves for the backward pass, from shapes and dtypes only: the same on any device. Writes
``results/memory-<platform>-<date>.md`` and ``.json`` with ratios against fp32.

Usage::

  python -m benchmarks.memory                       # ViT-S/16 and ViT-B/16, 224px, batch 128
  python -m benchmarks.memory --models ti16 --batch 2 --image-size 32 --out-dir /tmp/m
"""

from __future__ import annotations

import argparse
from typing import Any

import jamp
from benchmarks import common, throughput
from jamp.models import sizes


def _measure(variant: str, mode: str, args: argparse.Namespace, remat: bool) -> dict[str, Any]:
    """The memory report of one model/mode as a row (bytes)."""
    targs = throughput.parse_args(["--variant", variant])
    shape = ("patch_size", "image_size", "batch", "num_classes", "num_layers")
    vars(targs).update(remat=remat, **{k: getattr(args, k) for k in shape})
    state = throughput.init_state(mode, targs, abstract=True)
    label = sizes.vit_label(variant, targs.patch_size) + (" + remat" if remat else "")
    return dict(model=label, variant=variant, remat=remat, mode=mode,
                **throughput.jax_memory(state, targs).as_dict())


def _to_markdown(result: dict[str, Any]) -> str:
    """The results file: how it was counted, then one row per model and mode."""
    mib = lambda b: common.fmt(None if b is None else b / 2**20, ",.1f")
    keys = ("params", "grads", "opt_state", "residual", "activation", "total")
    return "\n".join([
        "# JAX-level memory of a ViT training step per precision mode", "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}; counted on {result['platform']} with jax {result['jax']} "
        "(shapes and dtypes only, so the same on any device; device peaks are in the "
        "throughput results)",
        f"- step: {result['image_size']}x{result['image_size']} images, batch {result['batch']}, "
        f"{result['num_classes']} classes, AdamW via `jamp.make_optimizer`; residuals = what "
        "the forward pass saves for the backward pass (activations + half-precision copies of "
        "parameters + inputs)",
        "- MiB = 2^20 bytes; ratios against fp32 of the same model", "",
        *common.table("model | mode | params | grads | optimizer state | residuals | of which "
                      "activations | total | residuals vs fp32 | total vs fp32",
                      ([r["model"], r["mode"], *(mib(r[f"{k}_bytes"]) for k in keys),
                        common.fmt(r["residual_ratio"], ".3f"), common.fmt(r["total_ratio"], ".3f")]
                       for r in result["results"]))]) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Counts every model/mode; prints and (unless ``--no-write``) writes the table."""
    ap = common.parser(__doc__)
    common.add_vit(ap, variant=None)
    ap.add_argument("--models", type=common.split, default=["s16", "b16"],
                    help="comma-separated ViT variants")
    ap.add_argument("--modes", type=common.modes,
                    default=list(jamp.MODES) + list(jamp.FP8_MODES))
    ap.add_argument("--remat", type=common.split, default=["b16"],
                    help="models also counted with remat (comma-separated; '' for none)")
    args = ap.parse_args(argv)
    rows = []
    for variant, remat in [(m, False) for m in args.models] + [(m, True) for m in args.remat]:
        for mode in args.modes:
            rows.append(r := _measure(variant, mode, args, remat))
            print(f"{r['model']:<18} {mode:<11} total {common.gib(r['total_bytes'])}  "
                  f"residuals {common.gib(r['residual_bytes'])}", flush=True)
    base = {r["model"]: r for r in rows if r["mode"] == "fp32"}  # ratios against fp32
    for r in rows:
        for key in ("residual", "total"):
            b = base.get(r["model"])
            r[f"{key}_ratio"] = r[f"{key}_bytes"] / b[f"{key}_bytes"] if b else None
    result = dict(**common.header("memory", argv), image_size=args.image_size,
                  batch=args.batch, num_classes=args.num_classes, results=rows)
    if not args.no_write:
        common.write_results(common.results_stem(args.out_dir, "memory", result["platform"]),
                             result, _to_markdown(result))
    return result


if __name__ == "__main__":
    main()
