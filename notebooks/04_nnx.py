# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # jamp with Flax NNX: policies, `nnx.Optimizer` and loss scaling, the NNX ViT
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jamp-dev/jamp/blob/main/notebooks/04_nnx.ipynb)
#
# Flax NNX layers have per-layer `dtype`/`param_dtype` knobs but no precision policy and
# no loss scaling. This notebook
#
# 1. puts an NNX model written without dtype arguments under a policy with
#    `jamp.apply_policy` (the same call as for linen) and reads the dtypes off the jaxpr;
# 2. trains it on the embedded digits with `nnx.Optimizer` around
#    `jamp.DynamicLossScale`;
# 3. injects an overflow and checks that the step is skipped exactly and the scale backs off;
# 4. builds the NNX ViT of `jamp.models.vit_nnx` from a linen ViT's weights and trains it.
#
# It runs top to bottom on a Colab CPU, GPU or TPU runtime, and on CPU in CI.

# %%
# ruff: noqa: E402
# Colab only: install jamp (an uploaded wheel or checkout, or the repository), with the JAX
# build for this runtime's accelerator. Elsewhere (a local Jupyter, CI) jamp is expected to
# be installed already: pip install -e . in a checkout.
import glob
import os
import subprocess
import sys

JAMP_REPO = "https://github.com/jamp-dev/jamp"  # the project's repository; a fork works too

if "google.colab" in sys.modules:
    tpu = bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
               or "COLAB_TPU_ADDR" in os.environ)
    if os.path.exists("/dev/nvidia0"):
        jax_pkg = "jax[cuda12]"
    elif tpu:
        jax_pkg = "jax[tpu]"
    else:
        jax_pkg = "jax"
    # jamp's distribution is jamp-jax (`pip install jamp` gets an unrelated project).
    # A wheel or checkout uploaded to /content wins; else JAMP_REPO if it can be reached.
    local = sorted(glob.glob("/content/jamp_jax-*.whl")) + [
        d for d in ("/content/jamp",) if os.path.exists(f"{d}/pyproject.toml")]
    reachable = not local and subprocess.run(
        ["git", "ls-remote", "--exit-code", JAMP_REPO, "HEAD"], capture_output=True,
        timeout=60, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"}).returncode == 0
    if not (local or reachable):
        raise RuntimeError(
            f"{JAMP_REPO} cannot be reached and /content holds no jamp_jax-*.whl wheel or "
            "jamp/ checkout: upload one (`pip wheel --no-deps -w dist .` in a checkout builds "
            "the wheel) or set JAMP_REPO to a reachable fork, then run this cell again.")
    source = local[0] if local else f"jamp-jax @ git+{JAMP_REPO}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", source,
                    f"{jax_pkg}>=0.7,<0.12"], check=True)
    # If pip replaced a package this session had already imported, use
    # Runtime > Restart session once and run the notebook again.

# %% [markdown]
# ## Backend and size
#
# On CPU the notebook runs in a small size (fewer steps) to show the mechanics; set
# `JAMP_NOTEBOOK_SIZE=small` or `full` to choose.

# %%
import jax

BACKEND = jax.default_backend()
SIZE = os.environ.get("JAMP_NOTEBOOK_SIZE") or ("small" if BACKEND == "cpu" else "full")
assert SIZE in ("small", "full"), f"JAMP_NOTEBOOK_SIZE={SIZE!r}: use 'small' or 'full'"
NUM_STEPS = 150 if SIZE == "small" else 600
BATCH_SIZE = 64
print(f"backend {BACKEND}, {jax.device_count()} device(s); notebook size: {SIZE}")

# %%
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jamp
import jamp.data
from jamp.models import vit, vit_nnx

print("jamp", jamp.__version__, "| jax", jax.__version__)

# %% [markdown]
# ## An NNX model with no dtype arguments
#
# Rows of an 8x8 digit are 8 tokens: a `Linear` embeds them, a `LayerNorm` normalises, a
# hand-written attention (`jax.nn.softmax` of `q @ k.T`) mixes them, and a custom
# parameter `x @ self.w` classifies. Nothing says which dtype anything runs in.

# %%
class RowAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 32, num_classes: int = 10):
        self.embed = nnx.Linear(8, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.qk = nnx.Linear(width, 2 * width, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (width, num_classes)) / width**0.5)

    def __call__(self, images):
        x = self.norm(nnx.gelu(self.embed(images[..., 0])))      # [batch, 8 rows, width]
        q, k = jnp.split(self.qk(x), 2, axis=-1)
        weights = jax.nn.softmax(q @ k.swapaxes(-1, -2) / q.shape[-1] ** 0.5)
        return (weights @ x).mean(axis=1) @ self.w                # a custom layer


# %% [markdown]
# ## `jamp.apply_policy` on an NNX model, and what the jaxpr says
#
# `jamp.apply_policy(model, mode)` works in place on an `nnx.Module`: parameters are
# rounded to the param dtype (drawn in float32 first, so every mode starts from the same
# weights), every layer computes in the compute dtype (the custom `x @ self.w` too, since
# every `nnx.Param` is read in it), the norms keep float32 parameters and statistics, the
# softmax of half-precision logits runs in float32 where the mode says so, and the output
# comes back in the output dtype. The jaxpr of each mode:

# %%
def dtypes(jaxpr, primitive):
    """The operand dtypes of every ``primitive`` in a jaxpr, nested jaxprs included."""
    found = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.add("x".join(str(v.aval.dtype) for v in eqn.invars))
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    if hasattr(sub, "eqns"):
                        visit(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        visit(sub.jaxpr)

    visit(jaxpr.jaxpr)
    return ", ".join(sorted(found))


images = jnp.zeros((4, 8, 8, 1))
table = {}
for mode in ("fp32", "fp16", "bf16", "fp16_naive", "bf16_pure"):
    model = jamp.apply_policy(RowAttention(nnx.Rngs(0)), mode)
    jaxpr, out = jax.make_jaxpr(lambda m: m(images), return_shape=True)(model)
    table[mode] = dict(w=str(model.w.dtype), norm_scale=str(model.norm.scale.dtype),
                       dots=dtypes(jaxpr, "dot_general"), softmax_exp=dtypes(jaxpr, "exp"),
                       norm_rsqrt=dtypes(jaxpr, "rsqrt"), output=str(out.dtype))
print(f"{'mode':<11}" + "".join(f"{k:<22}" for k in table["fp32"]))
for mode, row in table.items():
    print(f"{mode:<11}" + "".join(f"{v:<22}" for v in row.values()))

# %%
assert table["fp16"]["dots"] == "float16xfloat16" and table["fp16"]["w"] == "float32"
assert table["fp16"]["softmax_exp"] == "float32" and table["bf16_pure"]["softmax_exp"] == "bfloat16"
assert table["fp16_naive"]["w"] == "float16" and table["fp16_naive"]["norm_scale"] == "float32"
assert all(row["norm_rsqrt"] == "float32" for row in table.values())
assert table["bf16"]["output"] == "float32" and table["bf16_pure"]["output"] == "bfloat16"

# %% [markdown]
# ## `nnx.Optimizer` with `jamp.DynamicLossScale`
#
# The loss scale is an optax transformation, so it goes where NNX expects one:
# `nnx.Optimizer(model, jamp.DynamicLossScale(tx), wrt=nnx.Param)`.
# `jamp.scale_loss(loss, optimizer)` multiplies the loss by the current scale;
# `optimizer.update(model, grads)` unscales, checks that every gradient is finite and
# either applies the inner optimizer or skips the step (and halves the scale).
# `jamp.make_optimizer("fp16", tx)` builds the same from a mode's settings. The scale
# starts too high on purpose (2**24: the float16 backward pass overflows) and grows every
# 25 finite steps, so its dynamics are visible.

# %%
info = jamp.data.get_dataset_info("digits")


def load_split(split, size):
    batch = next(jamp.data.eval_batches(info, split=split, image_size=8, global_batch_size=size))
    return batch["image"], batch["label"]


train_images, train_labels = load_split("train", info.num_train)
test_images, test_labels = load_split("test", info.num_test)


def batches(seed):
    """Endless shuffled batches of BATCH_SIZE training examples."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(train_labels))
        for i in range(0, len(order) - BATCH_SIZE + 1, BATCH_SIZE):
            idx = order[i:i + BATCH_SIZE]
            yield {"image": train_images[idx], "label": train_labels[idx]}


model = jamp.apply_policy(RowAttention(nnx.Rngs(0)), "fp16")
tx = jamp.DynamicLossScale(optax.adamw(1e-2), init_scale=2.0**24, growth_interval=25)
optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch, poison=0.0):
    def loss_fn(m):
        logits = m(batch["image"]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return jamp.scale_loss(loss, optimizer), loss   # differentiate loss * scale

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    grads = jax.tree.map(lambda g: g + jnp.asarray(poison, g.dtype), grads)  # for later
    optimizer.update(model, grads)                      # unscale, check, skip or apply
    return loss


@nnx.jit
def accuracy(model, images, labels):
    return jnp.mean(jnp.argmax(model(images), -1) == labels)


data, history = batches(seed=0), []
for _ in range(NUM_STEPS):
    scale = jamp.loss_scale(optimizer)
    history.append((float(train_step(model, optimizer, next(data))), float(scale)))
stats = jamp.overflow_stats(optimizer)
test_accuracy = float(accuracy(model, test_images, test_labels))
print("loss scale, first 8 steps:", [f"2**{int(np.log2(s))}" for _, s in history[:8]])
print(f"loss {history[0][0]:.3f} -> {history[-1][0]:.3f}; steps skipped "
      f"{int(stats.steps_skipped)} of {NUM_STEPS}; final scale "
      f"2**{int(np.log2(float(jamp.loss_scale(optimizer))))}; test accuracy {test_accuracy:.1%}")

# %%
assert history[1][1] == history[0][1] / 2          # the first step overflowed: backed off
assert int(stats.steps_skipped) >= 1 and history[-1][0] < history[0][0]
assert test_accuracy > 0.6  # chance: 10%

# %% [markdown]
# ## An injected overflow: the step is skipped exactly
#
# Adding `inf` to the gradients (as a float16 overflow would) must leave every parameter
# and every leaf of AdamW's state bit-identical, halve the scale and count one skipped
# step.

# %%
def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


before = bits(nnx.state(model)), bits(optimizer.opt_state.inner_state)
scale = float(jamp.loss_scale(optimizer))
skipped = int(jamp.overflow_stats(optimizer).steps_skipped)
train_step(model, optimizer, next(data), poison=jnp.inf)
after = bits(nnx.state(model)), bits(optimizer.opt_state.inner_state)
print("params and AdamW state bit-identical:", after == before, "| scale",
      scale, "->", float(jamp.loss_scale(optimizer)), "| steps skipped", skipped, "->",
      int(jamp.overflow_stats(optimizer).steps_skipped))

# %%
assert after == before
assert float(jamp.loss_scale(optimizer)) == scale / 2
assert int(jamp.overflow_stats(optimizer).steps_skipped) == skipped + 1

# %% [markdown]
# ## The ViT in NNX, with the linen ViT's weights
#
# `jamp.models.vit_nnx` is the linen ViT of `jamp.models.vit` written in NNX: the same
# layers, initialisers and logical axis names (NNX sharding metadata, for the same data /
# tensor parallel rules). `vit_nnx.from_linen` builds it from a linen ViT's parameters,
# bit for bit; under the same mode the two give the same numbers (the test suite trains
# both for 20 steps in fp32, fp16, bf16 and fp16_naive and compares the losses and loss
# scales bit for bit). `nnx_functional.functional(model)` gives the `(apply_fn, params)` pair the
# linen trainer's `TrainState` takes.

# %%
module = vit.create("ti", num_classes=10, patch_size=2, num_layers=2, hidden_size=32,
                    num_heads=2, mlp_dim=64)
linen_params = jax.jit(jamp.apply_policy(module, "fp32").init)(
    jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
vit_model = vit_nnx.from_linen(module, linen_params)
print("stacked MLP kernel:", vit_model.encoder.layers.mlp.fc1.kernel.shape, "logical axes",
      vit_model.encoder.layers.mlp.fc1.kernel.get_metadata()["out_sharding"])

vit_model = jamp.apply_policy(vit_model, "fp16")
linen_model = jamp.apply_policy(module, "fp16")
probe = test_images[:16]
same = np.array_equal(nnx.jit(lambda m, x: m(x))(vit_model, probe),
                      jax.jit(linen_model.apply)({"params": nn.unbox(linen_params)}, probe))
print("NNX and linen logits identical under fp16:", same)

# %%
vit_optimizer = nnx.Optimizer(vit_model, jamp.make_optimizer("fp16", optax.adamw(3e-3)),
                              wrt=nnx.Param)
data, losses = batches(seed=1), []
for _ in range(NUM_STEPS // 2):
    losses.append(float(train_step(vit_model, vit_optimizer, next(data))))
vit_accuracy = float(accuracy(vit_model, test_images, test_labels))
print(f"NNX ViT, fp16: loss {losses[0]:.3f} -> {losses[-1]:.3f}, scale "
      f"2**{int(np.log2(float(jamp.loss_scale(vit_optimizer))))}, "
      f"test accuracy {vit_accuracy:.1%}")

# %%
assert same and losses[-1] < losses[0] and vit_accuracy > 0.5
