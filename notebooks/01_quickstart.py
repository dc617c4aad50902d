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
# # jamp quickstart: mixed precision for a Flax model
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jamp-dev/jamp/blob/main/notebooks/01_quickstart.ipynb)
#
# This notebook takes a small Flax model written here, with no dtype arguments, and
#
# 1. builds precision policies from a named mode (`"fp16"`) and from a jmp-style string;
# 2. applies them with `jamp.apply_policy` and shows in the jaxpr that the matmuls run in
#    float16 / bfloat16 while the parameters stay float32;
# 3. trains it for a few hundred steps on the embedded digits dataset with
#    `jamp.DynamicLossScale` wrapped around a custom optax chain;
# 4. plots the loss and the loss scale;
# 5. injects an overflow and checks that the step is skipped exactly.
#
# It runs top to bottom on a Colab CPU, T4 GPU or TPU runtime, and on CPU in CI.

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
# ## Backend and sizes
#
# On a TPU, **bf16** is the natural choice (the MXU multiplies bfloat16; float16 brings
# nothing and needs loss scaling). On a GPU, **fp16** runs on the tensor cores of every
# generation (a T4 has no fast bfloat16); from compute capability 8.0 on (A100, L4, H100),
# **bf16** is as fast and needs no loss scaling. On a CPU neither is faster than
# float32: the notebook runs in a small size there, to show the mechanics.
#
# This notebook uses **fp16** whatever the backend, because fp16 is the mode that needs
# loss scaling. Set `JAMP_NOTEBOOK_SIZE=small` or `full` to override the size.

# %%
import jax

BACKEND = jax.default_backend()
DEVICE = jax.devices()[0]
if BACKEND == "tpu":
    RECOMMENDED = "bf16"
elif BACKEND == "gpu":
    capability = float(getattr(DEVICE, "compute_capability", "0") or 0)
    RECOMMENDED = "bf16" if capability >= 8.0 else "fp16"
else:
    RECOMMENDED = "fp32 (half precision is not faster on CPU; small sizes)"
SIZE = os.environ.get("JAMP_NOTEBOOK_SIZE") or ("small" if BACKEND == "cpu" else "full")
assert SIZE in ("small", "full"), f"JAMP_NOTEBOOK_SIZE={SIZE!r}: use 'small' or 'full'"
print(f"backend {BACKEND} ({DEVICE.device_kind}, {jax.device_count()} device(s)); "
      f"recommended mode: {RECOMMENDED}; notebook size: {SIZE}")

# %%
import flax.linen as nn
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import jamp
import jamp.data

NUM_STEPS = 300 if SIZE == "small" else 1000
BATCH_SIZE = 128
print("jamp", jamp.__version__, "| jax", jax.__version__)

# %% [markdown]
# ## A model with no dtype arguments
#
# A plain Flax MLP, written as anyone would: no `dtype=`, no `param_dtype=`.

# %%
class MLP(nn.Module):
    """Flattens an image and classifies it: Dense, LayerNorm, GELU, Dense, GELU, Dense."""

    hidden: int = 256
    num_classes: int = 10

    @nn.compact
    def __call__(self, images):
        x = images.reshape(images.shape[0], -1)
        x = nn.gelu(nn.LayerNorm()(nn.Dense(self.hidden)(x)))
        x = nn.gelu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


# %% [markdown]
# ## Policies: from a named mode and from a jmp-style string
#
# `jamp.mixed_precision(name)` is a whole recipe: a policy (param / compute / output
# dtypes), per-class overrides (norms in float32), and the loss-scaling settings.
# `jamp.get_policy` parses jmp's string grammar into just a policy.

# %%
mp = jamp.mixed_precision("fp16")
print("fp16 recipe:    policy", mp.policy, "| loss scale", mp.loss_scale.kind,
      f"init 2**{int(np.log2(mp.loss_scale.init_scale))}, "
      f"growth every {mp.loss_scale.growth_interval} steps")
print("  LayerNorm runs in", mp.policy_for(nn.LayerNorm))

bf16_policy = jamp.get_policy("p=f32,c=bf16,o=f32")
print("string policy: ", bf16_policy, "| the long form gives the same:",
      jamp.get_policy("params=float32,compute=bfloat16,output=float32") == bf16_policy)
print("aliases:        '16-mixed' ->", jamp.mixed_precision("16-mixed").name,
      "| 'O2' ->", jamp.mixed_precision("O2").name)

# %% [markdown]
# ## `jamp.apply_policy` and what the jaxpr says
#
# `apply_policy` wraps the module (same parameter tree) and intercepts every submodule
# call. The parameters are *stored* in float32; each `Dense` casts its kernel and input
# to the compute dtype, so the `dot_general` of the jaxpr takes half-precision operands.

# %%
def dot_generals(fn, *args):
    """Every dot_general equation in ``fn``'s jaxpr, nested jaxprs (jit, scan...) included."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn)
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    if hasattr(sub, "eqns"):  # a Jaxpr or ClosedJaxpr
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*args))
    return found


images = jnp.zeros((BATCH_SIZE, 8, 8, 1), jnp.float32)
dot_dtypes = {}
for label, policy in [("fp32", "fp32"), ("fp16", mp), ("p=f32,c=bf16,o=f32", bf16_policy)]:
    model = jamp.apply_policy(MLP(), policy)
    # Shapes and dtypes only (jax.eval_shape): nothing is computed.
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    output = jax.eval_shape(model.apply, variables, images)
    eqns = dot_generals(model.apply, variables, images)
    dot_dtypes[label] = [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in eqns]
    print(f"{label}: params {variables['params']['Dense_0']['kernel'].dtype}, "
          f"output {output.dtype}")
    for eqn in eqns:
        lhs, rhs = eqn.invars
        print(f"    dot_general  {lhs.aval.str_short():<16} x {rhs.aval.str_short():<16}"
              f" -> {eqn.outvars[0].aval.str_short()}")

# %%
# The same, as JAX prints the jaxpr of the fp16 model (first matmul):
model = jamp.apply_policy(MLP(), mp)
params = jax.jit(model.init)(jax.random.key(0), images)["params"]
jaxpr = jax.make_jaxpr(lambda p, x: model.apply({"params": p}, x))(params, images)
print(next(line.strip() for line in jaxpr.pretty_print(use_color=False).splitlines()
           if "dot_general" in line))

# %%
assert all(d == ("float16", "float16") for d in dot_dtypes["fp16"]), dot_dtypes["fp16"]
assert all(d == ("bfloat16", "bfloat16") for d in dot_dtypes["p=f32,c=bf16,o=f32"])
assert all(d == ("float32", "float32") for d in dot_dtypes["fp32"])
assert len(dot_dtypes["fp16"]) == 3  # the three Dense layers
assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))

# %% [markdown]
# ## Dynamic loss scaling around a custom optax chain
#
# `jamp.DynamicLossScale(inner)` wraps any optax optimizer: `update` receives the
# gradients of the *scaled* loss, unscales them, checks that all are finite and either
# runs `inner` (clipping sees true gradient norms) or skips the step: zero updates, the
# inner state left bit-identical, the scale halved. After `growth_interval` finite steps
# in a row the scale doubles. Here the scale starts too high on purpose (2**24, where the
# backward pass overflows float16) and grows every 50 steps, so the dynamics are visible.

# %%
schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=30, decay_steps=NUM_STEPS,
                                             end_value=1e-4)
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))
tx = jamp.DynamicLossScale(tx, init_scale=2.0**24, growth_interval=50, hysteresis=1)
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state, batch):
    def loss_fn(p):
        logits = model.apply({"params": p}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return jamp.scale_loss(loss, opt_state), loss  # differentiate loss * scale

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, new_opt_state = tx.update(grads, opt_state, params)  # unscale, check, skip
    stats = jamp.overflow_stats(new_opt_state)
    metrics = {"loss": loss, "scale": jamp.loss_scale(opt_state), "finite": stats.last_finite}
    return optax.apply_updates(params, updates), new_opt_state, metrics


@jax.jit
def accuracy_of(params, images, labels):
    logits = model.apply({"params": params}, images)
    return jnp.mean(jnp.argmax(logits, -1) == labels)


# %% [markdown]
# ## Training on the embedded digits
#
# `jamp.data` reads the UCI handwritten digits that ship with scikit-learn (8×8 grey
# images, 10 classes, 1437 train / 360 test), prepared once as a local TFDS dataset: no
# download. The trainer streams them with `jamp.data.train_loader` (grain, checkpointable);
# they are so small that this notebook reads each split once, as a single batch, and
# shuffles in memory.

# %%
info = jamp.data.get_dataset_info("digits")


def load_split(split, size):
    batch = next(jamp.data.eval_batches(info, split=split, image_size=8,
                                        global_batch_size=size))
    assert batch["mask"].all()
    return batch["image"], batch["label"]


train_images, train_labels = load_split("train", info.num_train)
test_images, test_labels = load_split("test", info.num_test)
print("train", train_images.shape, "test", test_images.shape, "classes", info.num_classes)


def batches(seed):
    """Endless shuffled batches of BATCH_SIZE training examples."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(train_labels))
        for i in range(0, len(order) - BATCH_SIZE + 1, BATCH_SIZE):
            idx = order[i:i + BATCH_SIZE]
            yield {"image": train_images[idx], "label": train_labels[idx]}


# %%
data = batches(seed=0)
history = []
for _ in range(NUM_STEPS):
    params, opt_state, metrics = train_step(params, opt_state, next(data))
    history.append(metrics)
history = jax.device_get(history)
losses = np.array([m["loss"] for m in history])
scales = np.array([m["scale"] for m in history])
finite = np.array([m["finite"] for m in history])
accuracy = float(accuracy_of(params, test_images, test_labels))
print(f"{NUM_STEPS} steps: final loss {losses[-10:].mean():.3f}, test accuracy {accuracy:.1%}, "
      f"loss scale {float(jamp.loss_scale(opt_state)):g}, "
      f"steps skipped {int(jamp.overflow_stats(opt_state).steps_skipped)}")

# %%
fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 3.5))
ax_loss.plot(losses)
ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss (fp16 compute)")
ax_scale.step(np.arange(NUM_STEPS), np.log2(scales), where="post")
skipped = np.flatnonzero(~finite)
ax_scale.plot(skipped, np.log2(scales[skipped]), "rx", label="overflow: step skipped")
ax_scale.set(xlabel="step", ylabel="log2(loss scale)", title="dynamic loss scale")
if len(skipped):
    ax_scale.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## An injected overflow
#
# float16 tops out at 65504. One pixel set to 1e5 becomes `inf` when the input is cast
# to float16, so the loss and every gradient are non-finite. The loss scale must skip
# this step: parameters and Adam's moments stay exactly as they were, the scale is
# halved, and `steps_skipped` counts it. (In bfloat16, whose range is float32's, the
# same batch would be finite.)

# %%
batch = next(data)
bad_batch = dict(batch, image=batch["image"].copy())
bad_batch["image"][0, 3, 3, 0] = 1e5
new_params, new_opt_state, bad_metrics = train_step(params, opt_state, bad_batch)
skipped_before = int(jamp.overflow_stats(opt_state).steps_skipped)
skipped_after = int(jamp.overflow_stats(new_opt_state).steps_skipped)
print(f"loss on the bad batch: {float(bad_metrics['loss'])}, "
      f"gradients finite: {bool(bad_metrics['finite'])}")
print(f"loss scale {float(jamp.loss_scale(opt_state)):g} -> "
      f"{float(jamp.loss_scale(new_opt_state)):g}, "
      f"steps skipped {skipped_before} -> {skipped_after}")

# %%
def tree_equal(a, b):
    """Same structure and bit-identical leaves."""
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                               strict=True))


print("parameters unchanged:", tree_equal(new_params, params))
print("optimizer state (Adam moments, step count) unchanged:",
      tree_equal(new_opt_state.inner_state, opt_state.inner_state))

# The next clean batch trains normally again, at the halved scale.
after_params, after_opt_state, after_metrics = train_step(new_params, new_opt_state, batch)
print("next step: gradients finite", bool(after_metrics["finite"]),
      "| loss", round(float(after_metrics["loss"]), 4),
      "| parameters moved", not tree_equal(after_params, new_params))

# %% [markdown]
# ## Checks
#
# The notebook fails here if anything above silently went wrong.

# %%
# Training worked: the digits test set is classified far above chance (10%).
assert accuracy >= 0.90, f"test accuracy {accuracy:.1%} < 90%"
assert losses[-10:].mean() < 0.5 * losses[:10].mean(), (losses[:10], losses[-10:])

# The injected overflow: non-finite gradients, the step skipped exactly, the scale halved.
assert not bool(bad_metrics["finite"]) and not np.isfinite(float(bad_metrics["loss"]))
assert skipped_after == skipped_before + 1
assert tree_equal(new_params, params), "a skipped step must not move the parameters"
assert tree_equal(new_opt_state.inner_state, opt_state.inner_state)
assert float(jamp.loss_scale(new_opt_state)) == float(jamp.loss_scale(opt_state)) / 2
# ... and training goes on.
assert bool(after_metrics["finite"]) and not tree_equal(after_params, new_params)
print("all checks passed")
