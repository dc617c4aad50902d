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
- ``trajectory``: the final train loss of a 500-step run of the digits ViT per mode,
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
from typing import Any

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

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
    md = "\n".join(common.table(" | ".join(["state stored as"] + [f"step {s}" for s in at]
                                            + ["synthetic, 16 decades"]),
                                 table))
    print(md)
    return {"nu": {name: [{"step": s, "rel_err": e, "flushed": f} for s, e, f in vals]
                   for name, vals in rows.items()}, "nu_md": md}


# ------------------------------------------------------------------------------------ main


PARTS = {"nu": part_nu}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--part", default="all", choices=["all", *PARTS])
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    for name, fn in PARTS.items():
        if args.part in ("all", name):
            t0 = time.time()
            out.update(fn(args))
            print(f"[{name}: {time.time() - t0:.0f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
