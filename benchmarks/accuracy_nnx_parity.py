"""Where the trainer's linen and NNX runs part: the step-by-step losses of both, with and
without gradient clipping, and the global norm of the same tree in both leaf orders.

The NNX ViT starts from the linen ViT's weights (``vit_nnx.from_linen``) and one jitted
gradient of it equals linen's bit for bit, yet ``python -m benchmarks.accuracy`` shows the
two frameworks a point or two apart. This trains both with the trainer
(``jamp.train.train_and_evaluate``, the recipe's ``vit_config``, ``log_every_steps=1``) for
``--steps`` steps, once with the recipe's ``grad_clip_norm`` and once with ``0`` (no
clipping), and prints the first step whose loss differs; then it evaluates
``optax.global_norm`` of the initial parameters in linen's leaf order and in NNX's.

Usage::

  python -m benchmarks.accuracy_nnx_parity --steps 30 --mode fp32
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jamp import experiment
from jamp.config import vit_config
from jamp.metrics import read_metrics
from jamp.train import train_and_evaluate


def _losses(mode: str, framework: str, steps: int, clip: float
            ) -> tuple[list[float], list[float]]:
    """The per-step train losses and gradient norms of one short trainer run."""
    config = vit_config(mode)
    config.update_from_flattened_dict(dict(framework=framework, max_steps=steps,
                                           log_every_steps=1, grad_clip_norm=clip,
                                           progress=False))
    with tempfile.TemporaryDirectory(prefix="jamp-nnx-parity-") as tmp:
        train_and_evaluate(config, tmp)
        records = [r for r in read_metrics(tmp) if "train/loss" in r]
        return [r["train/loss"] for r in records], [r["train/grad_norm"] for r in records]


def first_difference(a: list[float], b: list[float]) -> int | None:
    """The first 1-based step whose losses differ (None: bit-identical).

    Example:
      >>> first_difference([1.0, 2.0, 3.0], [1.0, 2.5, 3.0]), first_difference([1.0], [1.0])
      (2, None)
    """
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def norm_orders(mode: str) -> dict[str, Any]:
    """``optax.global_norm`` of the initial parameters in linen's and NNX's leaf order."""
    states = {}
    for framework in ("linen", "nnx"):
        config = vit_config(mode)
        config.framework = framework
        exp = experiment.build_experiment(config)
        shardings = experiment.state_shardings(exp, jax.random.key(0))[1]
        states[framework] = experiment.init_state(exp, jax.random.key(0), shardings).params
    paths = {fw: ["/".join(str(getattr(k, "key", k)) for k in p)
                  for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
             for fw, t in states.items()}
    norm = jax.jit(optax.global_norm)
    linen, nnx = (np.asarray(norm(states[fw])) for fw in ("linen", "nnx"))
    # The same values: NNX's leaves put in linen's order (matched by value) give linen's
    # norm back.
    pool = list(jax.tree.leaves(states["nnx"]))
    as_linen = []
    for leaf in jax.tree.leaves(states["linen"]):
        i = next(i for i, x in enumerate(pool) if x.shape == leaf.shape
                 and bool(jnp.array_equal(x, leaf)))
        as_linen.append(pool.pop(i))
    return dict(paths=paths, linen=float(linen), nnx=float(nnx),
                nnx_in_linen_order=float(np.asarray(norm(as_linen))),
                same_bits=bool(linen.view(np.uint32) == nnx.view(np.uint32)),
                values_equal=not pool)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Prints and returns the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mode", default="fp32")
    ap.add_argument("--clips", type=lambda t: [float(c) for c in t.split(",")],
                    default=[vit_config("fp32").grad_clip_norm, 0.0],
                    help="grad_clip_norm values to compare (default: the recipe's, then 0)")
    args = ap.parse_args(argv)
    out: dict[str, Any] = dict(mode=args.mode, steps=args.steps)
    for c in args.clips:
        runs = {fw: _losses(args.mode, fw, args.steps, c) for fw in ("linen", "nnx")}
        (loss_l, norm_l), (loss_n, norm_n) = runs["linen"], runs["nnx"]
        first = first_difference(loss_l, loss_n)
        clipped = [i + 1 for i, n in enumerate(norm_l) if c and n > c]
        out[f"clip={c:g}"] = dict(first_difference=first, linen=loss_l, nnx=loss_n,
                                  grad_norm_linen=norm_l, grad_norm_nnx=norm_n,
                                  first_norm_difference=first_difference(norm_l, norm_n),
                                  clipped_steps=clipped)
        print(f"grad_clip_norm={c:g}: first step whose loss differs: {first}; whose gradient "
              f"norm differs: {first_difference(norm_l, norm_n)}; steps clipped (linen "
              f"norm > {c:g}): {clipped[:8]}{' ...' if len(clipped) > 8 else ''}; step "
              f"{args.steps} loss linen {loss_l[-1]!r} nnx {loss_n[-1]!r}", flush=True)
        for i in range(min(first or 0, args.steps)):
            print(f"  step {i + 1:2d}: loss linen {loss_l[i]!r} nnx {loss_n[i]!r}; "
                  f"norm linen {norm_l[i]!r} nnx {norm_n[i]!r}")
    norms = norm_orders(args.mode)
    out["global_norm"] = norms
    print(f"global_norm of the initial params: linen order {norms['linen']!r}, NNX order "
          f"{norms['nnx']!r}, NNX leaves in linen order {norms['nnx_in_linen_order']!r}; "
          f"same bits: {norms['same_bits']}; the same multiset of values: "
          f"{norms['values_equal']}", flush=True)
    for i, (a, b) in enumerate(zip(norms["paths"]["linen"], norms["paths"]["nnx"],
                                   strict=True)):
        print(f"  leaf {i:2d}: linen {a:<45} nnx {b}")
    return out


if __name__ == "__main__":
    main()
