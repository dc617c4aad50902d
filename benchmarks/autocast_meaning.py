"""The four cases of issue 23 where ``jamp.autocast`` changed a function's meaning, measured.

1. masked attention (``finfo.min`` / ``-1e30`` fills, a fully masked padding row): is the loss
   and every gradient finite?
2. BatchNorm running mean after 100 EMA steps (momentum 0.99, batch mean drifting 3.0 -> 3.4);
3. an Equinox-style LayerNorm that upcasts itself: the dtype its ops run in, and the step time
   of a 4-block Equinox-style ViT under autocast fp16 vs the same model written in fp16;
4. residual bytes of a 784-512-512-10 ReLU MLP (batch 256) under autocast vs written in half.

Run: ``python -m benchmarks.autocast_meaning`` (prints one line per figure).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jamp

HALF = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


# ----------------------------------------------------------------------------- models


def layer_norm(x, weight, bias, eps=1e-5):
    """Equinox's LayerNorm: upcasts a half input to float32 itself, returns its dtype."""
    dtype = x.dtype
    x = x.astype(jnp.promote_types(dtype, jnp.float32))
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.var(x, -1, keepdims=True)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    return (weight * out + bias).astype(dtype)


def attention(params, x, mask, fill):
    """Single-head self-attention with masked logits, as Equinox's MultiheadAttention."""
    q, k, v = x @ params["q"], x @ params["k"], x @ params["v"]
    logits = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    fill = jnp.finfo(logits.dtype).min if fill == "finfo" else fill
    logits = jnp.where(mask, logits, fill)
    return jax.nn.softmax(logits, axis=-1) @ v


def attention_loss(params, x, mask, valid, fill="finfo"):
    out = attention(params, x, mask, fill) @ params["o"]
    return jnp.sum(jnp.where(valid[..., None], out, 0.0) ** 2) / jnp.sum(valid)


def attention_case(seed=0, length=6, dim=8):
    ks = jax.random.split(jax.random.key(seed), 5)
    params = {n: jax.random.normal(k, (dim, dim)) / np.sqrt(dim)
              for n, k in zip("qkvo", ks[:4], strict=True)}
    x = jax.random.normal(ks[4], (2, length, dim))
    valid = jnp.arange(length)[None, :] < jnp.array([[length], [3]])  # example 2 is padded
    mask = valid[:, :, None] & valid[:, None, :]  # padding queries see no key at all
    return params, x, mask, valid


def batch_norm_step(state, x, momentum=0.99, eps=1e-5):
    """A BatchNorm training step with state: normalised x and the new running mean/var."""
    mean = jnp.mean(x, 0)
    var = jnp.var(x, 0)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    new = {"mean": momentum * state["mean"] + (1 - momentum) * mean,
           "var": momentum * state["var"] + (1 - momentum) * var}
    return out, new


def running_mean(mode: str | None, steps: int = 100) -> float:
    """The running mean after ``steps`` batches whose mean drifts 3.0 -> 3.4."""
    fn = batch_norm_step if mode is None else jamp.autocast(batch_norm_step, mode)
    fn = jax.jit(fn)
    state = {"mean": jnp.full((4,), 3.0), "var": jnp.ones((4,))}
    noise = jax.random.normal(jax.random.key(0), (steps, 32, 4)) * 0.1
    for i in range(steps):
        _, state = fn(state, noise[i] - noise[i].mean(0) + 3.0 + 0.4 * i / (steps - 1))
    return float(state["mean"][0])


def relu_mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def mlp_params(sizes=(784, 512, 512, 10), seed=0):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [(jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros(n))
            for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def mlp_loss(params, x, labels):
    logits = relu_mlp(params, x).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1))


def residual_bytes(loss, *args) -> int:
    return jamp.memory_report(loss, *args).residual_bytes


# ----------------------------------------------------------------------------- ViT


def vit_params(seed=0, blocks=4, dim=192, patch=4, channels=3, classes=10):
    def dense(k, m, n):
        return {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}

    def ln():
        return {"weight": jnp.ones(dim), "bias": jnp.zeros(dim)}

    keys = iter(jax.random.split(jax.random.key(seed), 4 * blocks + 2))
    return {"embed": dense(next(keys), patch * patch * channels, dim),
            "blocks": [{"ln1": ln(), "qkv": dense(next(keys), dim, 3 * dim),
                        "out": dense(next(keys), dim, dim), "ln2": ln(),
                        "up": dense(next(keys), dim, 4 * dim),
                        "down": dense(next(keys), 4 * dim, dim)} for _ in range(blocks)],
            "ln": ln(), "head": dense(next(keys), dim, classes)}


def vit(params, images, heads=3, patch=4):
    b, h, w, c = images.shape
    x = images.reshape(b, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, -1, patch * patch * c)
    lin = lambda p, x: x @ p["w"] + p["b"]
    x = lin(params["embed"], x)
    for blk in params["blocks"]:
        y = layer_norm(x, **blk["ln1"])
        q, k, v = jnp.split(lin(blk["qkv"], y), 3, -1)
        split = lambda t: t.reshape(b, -1, heads, t.shape[-1] // heads).swapaxes(1, 2)
        q, k, v = split(q), split(k), split(v)
        a = jax.nn.softmax((q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])).astype(
            jnp.float32), -1).astype(x.dtype)
        x = x + lin(blk["out"], (a @ v).swapaxes(1, 2).reshape(x.shape))
        x = x + lin(blk["down"], jax.nn.gelu(lin(blk["up"], layer_norm(x, **blk["ln2"]))))
    return lin(params["head"], layer_norm(x, **params["ln"]).mean(1))


def vit_loss(params, images, labels):
    logits = vit(params, images).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1))


def _time(fn, *args, repeats=5) -> float:
    jax.block_until_ready(fn(*args))
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best.append(time.perf_counter() - t)
    return 1e3 * float(np.median(best))


def vit_step_times(batch=32) -> dict[str, float]:
    """ms per gradient step: autocast fp16 of the float32 model vs the model written in fp16
    (params and images cast to float16 by hand; the LayerNorm upcasts itself)."""
    params = vit_params()
    images = jax.random.normal(jax.random.key(1), (batch, 32, 32, 3))
    labels = jnp.arange(batch) % 10
    auto = jax.jit(jax.grad(jamp.autocast(vit_loss, "fp16")))
    by_hand = jax.jit(jax.grad(lambda p, x, y: vit_loss(
        jax.tree.map(lambda a: a.astype(jnp.float16), p), x.astype(jnp.float16), y)))
    return {"autocast_fp16": _time(auto, params, images, labels),
            "hand_fp16": _time(by_hand, params, images, labels),
            "fp32": _time(jax.jit(jax.grad(vit_loss)), params, images, labels)}


# ----------------------------------------------------------------------------- report


def main() -> None:
    params, x, mask, valid = attention_case()
    for mode, fill in (("bf16", "finfo"), ("fp16", "finfo"), ("fp16", -1e30), ("bf16", -1e30)):
        loss = lambda p, fill=fill: attention_loss(p, x, mask, valid, fill)
        value, grads = jax.value_and_grad(jamp.autocast(loss, mode))(params)
        finite = bool(jnp.isfinite(value)) and all(
            bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
        print(f"attention {mode} fill={fill}: loss {float(value):.4f} finite={finite} "
              f"(float32 loss {float(loss(params)):.4f})")
    print("batchnorm running mean after 100 steps:",
          {m or "fp32": round(running_mean(m), 4) for m in (None, "fp16", "bf16")})
    half = lambda p, x: jax.tree.map(lambda a: a.astype(jnp.float16), (p, x))
    h = jnp.ones((4, 16))
    ln_jaxpr = jax.make_jaxpr(jamp.autocast(layer_norm, "fp16"))(h, jnp.ones(16), jnp.zeros(16))
    print("layernorm op dtypes under autocast fp16:",
          sorted({f"{e.primitive.name}:{e.outvars[0].aval.dtype}" for e in ln_jaxpr.eqns
                  if e.primitive.name in ("sub", "square", "integer_pow", "rsqrt", "add")}))
    mlp = mlp_params()
    xs, labels = jax.random.normal(jax.random.key(1), (256, 784)), jnp.arange(256) % 10
    f32 = residual_bytes(mlp_loss, mlp, xs, labels)
    auto = residual_bytes(jamp.autocast(mlp_loss, "fp16"), mlp, xs, labels)
    hand = residual_bytes(lambda p, x, y: mlp_loss(*half(p, x), y), mlp, xs, labels)
    print(f"relu mlp residual bytes: fp32 {f32}, autocast fp16 {auto} ({auto / f32:.2f}x), "
          f"hand-written fp16 {hand} ({hand / f32:.2f}x)")
    print("vit 4-block grad step (ms):", {k: round(v, 1) for k, v in vit_step_times().items()})


if __name__ == "__main__":
    main()
