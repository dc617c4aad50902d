"""JAX-level memory of a ViT training step per precision mode (no device memory used).

For each model and mode, ``jamp.memory_report`` counts the bytes of parameters,
gradients, optimizer state (AdamW as wrapped by ``jamp.make_optimizer``: loss
scale, fp32 master weights) and the residuals the forward pass saves for the
backward pass, from shapes and dtypes only (``jax.eval_shape``): the figures are
the same on CPU, GPU and TPU, and ViT-B at batch 128 needs no memory to count.
Writes ``benchmarks/results/memory-<platform>-<date>.md`` and ``.json`` with
ratios against fp32.

Usage::

  python benchmarks/memory.py                       # ViT-S/16 and ViT-B/16, 224px, batch 128
  python benchmarks/memory.py --models ti16 --batch 2 --image-size 32 --out-dir /tmp/m

Example:
  >>> # result = main(["--models", "ti4", "--image-size", "8", "--batch", "2", "--no-write"])
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jamp  # noqa: E402
from benchmarks import common, throughput  # noqa: E402

_FIELDS = ("params_bytes", "grads_bytes", "opt_state_bytes", "residual_bytes",
           "activation_bytes", "total_bytes")


def measure(variant: str, mode: str, args: argparse.Namespace, remat: bool) -> dict[str, Any]:
    """The memory report of one model/mode as a row (bytes)."""
    targs = throughput.parse_args(
        ["--variant", variant, "--image-size", str(args.image_size), "--batch", str(args.batch),
         "--num-classes", str(args.num_classes)] + (["--remat"] if remat else [])
        + (["--num-layers", str(args.num_layers)] if args.num_layers else []))
    model, state = throughput.abstract_state(mode, targs)
    label = common.vit_label(variant) + (" + remat" if remat else "")
    return dict(model=label, variant=variant, remat=remat, mode=mode,
                **throughput.jax_memory(model, state, targs).as_dict())


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``residual_ratio`` and ``total_ratio`` against the same model's fp32 row."""
    base = {r["model"]: r for r in rows if r["mode"] == "fp32"}
    for r in rows:
        b = base.get(r["model"])
        r["residual_ratio"] = r["residual_bytes"] / b["residual_bytes"] if b else None
        r["total_ratio"] = r["total_bytes"] / b["total_bytes"] if b else None
    return rows


def to_markdown(result: dict[str, Any]) -> str:
    """The results file: how it was counted, then one row per model and mode."""
    mib = lambda b: common.fmt(None if b is None else b / 2**20, ",.1f")
    lines = [
        "# JAX-level memory of a ViT training step per precision mode", "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}; counted on {result['platform']} with jax {result['jax']} "
        "(shapes and dtypes only, so the same on any device; device peaks are in the "
        "throughput results)",
        f"- step: {result['image_size']}x{result['image_size']} images, batch {result['batch']}, "
        f"{result['num_classes']} classes, AdamW via `jamp.make_optimizer`; residuals = what "
        "the forward pass saves for the backward pass (activations + half-precision copies of "
        "parameters + inputs)",
        "- MiB = 2^20 bytes; ratios against fp32 of the same model",
        "",
        "| model | mode | params | grads | optimizer state | residuals | of which activations "
        "| total | residuals vs fp32 | total vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['model']} | {r['mode']} | {mib(r['params_bytes'])} | {mib(r['grads_bytes'])} "
            f"| {mib(r['opt_state_bytes'])} | {mib(r['residual_bytes'])} "
            f"| {mib(r['activation_bytes'])} | {mib(r['total_bytes'])} "
            f"| {common.fmt(r['residual_ratio'], '.3f')} | {common.fmt(r['total_ratio'], '.3f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Counts every model/mode; prints and writes the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="s16,b16", help="comma-separated ViT variants")
    ap.add_argument("--modes", default=",".join(jamp.MODES))
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--num-layers", type=int, default=None, help="override (smoke tests)")
    ap.add_argument("--remat", default="b16",
                    help="models also counted with remat (comma-separated; '' for none)")
    ap.add_argument("--out-dir", default=str(common.RESULTS))
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    remat = [m.strip() for m in args.remat.split(",") if m.strip()]
    modes = [jamp.mixed_precision(m).name for m in args.modes.split(",") if m.strip()]
    rows = []
    for variant, with_remat in [(m, False) for m in models] + [(m, True) for m in remat]:
        for mode in modes:
            rows.append(measure(variant, mode, args, with_remat))
            r = rows[-1]
            print(f"{r['model']:<18} {mode:<11} total {common.gib(r['total_bytes'])}  "
                  f"residuals {common.gib(r['residual_bytes'])}", flush=True)
    result = dict(
        benchmark="memory", date=common.today(), platform=jax.default_backend(),
        jax=jax.__version__, command=common.command("memory.py", argv),
        image_size=args.image_size, batch=args.batch, num_classes=args.num_classes,
        results=with_ratios(rows))
    if not args.no_write:
        stem = Path(args.out_dir) / f"memory-{jax.default_backend()}-{common.today()}"
        common.write_json(stem.with_suffix(".json"), result)
        stem.with_suffix(".md").write_text(to_markdown(result))
        print(f"wrote {stem}.md/.json", flush=True)
    return result


if __name__ == "__main__":
    main()
