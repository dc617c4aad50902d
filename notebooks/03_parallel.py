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
# # Mixed precision on a device mesh: data, tensor and pipeline parallelism
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jamp-dev/jamp/blob/main/notebooks/03_parallel.ipynb)
#
# jamp lays the devices out as a `('data', 'model', 'pipe')` mesh: the batch is split over
# `data`, the ViT's attention heads and MLP units over `model` (Megatron-style tensor
# parallelism, through Flax's logical axis rules), and its encoder layers over `pipe`
# (a GPipe schedule). This notebook
#
# 1. builds a 2 × 2 × 2 mesh and shows where each parameter lives;
# 2. trains a ViT on it with `jamp.train` (`config.mesh.model = 2`, `config.mesh.pipe = 2`);
# 3. checks that one step on the mesh gives the same parameters as on one device;
# 4. injects an overflow into one example and shows that *every* device skips the step
#    and keeps the same loss scale;
# 5. does the same inside `jax.shard_map`, where each device only sees its own block,
#    with `jamp.DynamicLossScale(..., axis_names=...)`.
#
# On a Colab TPU with 8 cores the mesh uses them. On a CPU, or a runtime with too few
# accelerators for the mesh (one T4 GPU, a single-chip TPU), it uses 8 CPU devices that
# XLA fakes on the host: same programs, same collectives, no speed-up.

# %%
# ruff: noqa: E402
# Runs before JAX is imported: the host (CPU) platform is split into 8 devices. The flag
# only affects the CPU backend, so it is harmless on a GPU or TPU.
import glob
import os
import subprocess
import sys

JAMP_REPO = "https://github.com/jamp-dev/jamp"  # the project's repository; a fork works too

if "jax" in sys.modules:
    print("JAX was imported before this cell: restart the kernel (Colab: Runtime > Restart "
          "session) so that the device settings below take effect.")
xla_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count=8".strip()

# Colab only: install jamp (an uploaded wheel or checkout, or the repository), with the JAX
# build for this runtime's accelerator.
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

# The mesh needs a multiple of 4 devices (model 2 x pipe 2). Ask a separate process how
# many accelerators there are, so that this kernel can still choose the CPU platform.
if os.environ.get("JAX_PLATFORMS", "") != "cpu":
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend(), jax.device_count())"],
        capture_output=True, text=True)
    found = probe.stdout.split()[-2:] if probe.returncode == 0 else []
    if len(found) == 2 and found[0] != "cpu" and int(found[1]) % 4:
        print(f"{found[1]} {found[0]} device(s) cannot form a data x 2 x 2 mesh: "
              "using 8 CPU devices instead.")
        os.environ["JAX_PLATFORMS"] = "cpu"

# %%
import jax

BACKEND = jax.default_backend()
DEVICE = jax.devices()[0]
SIZE = os.environ.get("JAMP_NOTEBOOK_SIZE") or ("small" if BACKEND == "cpu" else "full")
assert SIZE in ("small", "full"), f"JAMP_NOTEBOOK_SIZE={SIZE!r}: use 'small' or 'full'"
print(f"backend {BACKEND} ({DEVICE.device_kind}), {jax.device_count()} devices; "
      f"notebook size: {SIZE}")
assert jax.device_count() % 4 == 0, "the mesh below needs a multiple of 4 devices"

# %% [markdown]
# fp16 is used throughout because it is the mode whose loss scale checks for overflow; on
# a TPU you would train in bf16 (no loss scale needed), on a T4-class GPU in fp16.

# %%
import shutil

import flax.linen as nn
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import jamp
import jamp.data
from jamp import parallel
from jamp.config import vit_config
from jamp.metrics import read_metrics
from jamp.models import vit
from jamp.train import train_and_evaluate

RULES = parallel.LOGICAL_AXIS_RULES
print("jamp", jamp.__version__, "| jax", jax.__version__)

# %% [markdown]
# ## The mesh and the logical axis rules
#
# `data = -1` takes the devices that are left: 2 on 8 devices.

# %%
mesh = parallel.make_mesh({"data": -1, "model": 2, "pipe": 2})
print("mesh", dict(mesh.shape))
print("device ids, indexed [data, model, pipe]:")
print(np.vectorize(lambda d: d.id)(mesh.devices))
print("\nlogical axis -> mesh axis:", dict(RULES))

# %% [markdown]
# The ViT names every parameter axis (`embed`, `heads`, `mlp`, `layers`, ...); the rules
# turn those names into a `PartitionSpec` on the mesh. Attention heads and MLP units are
# split over `model`, the stacked encoder layers over `pipe`; the rest is replicated.
# The model pipelines only when it is told to: its `layer_runner` here is a GPipe schedule
# of `pipe` stages over 4 microbatches (without one it runs the plain `nn.scan`; the
# parameters are the same either way).

# %%
mp = jamp.mixed_precision("fp16", init_scale=2.0**12)


def vit_model(layer_runner=None):
    return jamp.apply_policy(
        vit.create("ti", num_classes=10, patch_size=2, num_layers=2, hidden_size=64,
                   num_heads=4, mlp_dim=128, layer_runner=layer_runner), mp)


model = vit_model(parallel.pipeline.GPipe(stages=mesh.shape["pipe"], microbatches=4))
tx = jamp.make_optimizer(mp, optax.sgd(0.05))  # DynamicLossScale(sgd)
sample = jnp.zeros((1, 8, 8, 1))


def create_state(key):
    params = model.init(key, sample)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


abstract_state = jax.eval_shape(create_state, jax.random.key(0))  # shapes + axis names
shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_state), mesh, RULES)
param_specs = jax.tree_util.tree_map(lambda s: s.spec, shardings.params)
leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(abstract_state.params))
specs = jax.tree_util.tree_leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
for (path, leaf), spec in zip(leaves, specs, strict=True):
    name = "/".join(k.key for k in path)
    if "encoder/layers" in name or name.startswith("head"):
        print(f"{name:<52}{str(leaf.shape):<16}{spec}")

# %% [markdown]
# ## Training on the mesh with `jamp.train`
#
# Three config fields select the layout; `pipeline_microbatches` sets the GPipe schedule
# (its idle "bubble" is (S-1)/(M+S-1) for S stages and M microbatches). The global batch
# must split over `data` × microbatches. This is `configs/vit_fp16_3d.py`; from a shell:
# `jamp.train --config configs/vit_fp16_3d.py` (`vit_fp16_tp.py`, `vit_fp16_pp.py`: tensor
# or pipeline parallelism alone).

# %%
config = vit_config("fp16")
config.mesh.data, config.mesh.model, config.mesh.pipe = -1, 2, 2
config.pipeline_microbatches = 4
if SIZE == "small":
    config.num_layers = 2
    config.num_epochs = 6
    config.learning_rate = 3e-3
    config.label_smoothing = 0.0
config.checkpoint_every_steps = 10_000
config.progress = SIZE == "full"
config.plot = False
workdir = os.path.abspath("runs/03_parallel")
shutil.rmtree(workdir, ignore_errors=True)  # the trainer would resume from it otherwise
summary = train_and_evaluate(config, workdir)

# %%
records = read_metrics(workdir)
steps = [r["step"] for r in records if "train/loss_scale" in r]
fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 3.5))
ax_loss.plot(steps, [r["train/loss"] for r in records if "train/loss" in r])
layout = " x ".join(f"{n} {a}" for a, n in summary["mesh"].items())
ax_loss.set(title=f"training loss, mesh {layout}", xlabel="step", yscale="log")
ax_scale.step(steps, [r["train/loss_scale"] for r in records if "train/loss_scale" in r],
              where="post", label="loss scale")
ax_scale.set_yscale("log", base=2)
ax_scale.set(title=f"fp16 loss scale ({summary['steps_skipped']} steps skipped)", xlabel="step")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## One step on the mesh equals one step on one device
#
# The same initial state, once on a single device with `jamp.train_step`, once placed on
# the mesh by the logical axis rules and stepped with `jamp.train_step` given the mesh's
# gradient function, `jamp.parallel.step.value_and_grad` (the trainer's step: gradients
# all-reduced over `data` in float32, heads and MLP split over `model`, the encoder run as
# a 2-stage pipeline over `pipe`).

# %%
state = jax.jit(lambda key: nn.unbox(create_state(key)))(jax.random.key(0))
first = next(jamp.data.eval_batches(jamp.data.get_dataset_info("digits"), split="train",
                                    image_size=8, global_batch_size=64))
batch = {"image": first["image"], "label": first["label"]}
rng = jax.random.key(1)

single_state, single_metrics = jax.jit(jamp.train_step)(
    state.replace(apply_fn=vit_model().apply), batch, rng)  # one device: no pipeline

batch_sharding = parallel.batch_sharding(mesh)
with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    mesh_value_and_grad = parallel.step.value_and_grad(param_specs, pipelined=True)
    mesh_step = jax.jit(
        lambda s, b, r: jamp.train_step(s, b, r, value_and_grad=mesh_value_and_grad),
        in_shardings=(shardings, batch_sharding, None), out_shardings=(shardings, None))
    mesh_state, mesh_metrics = mesh_step(jax.device_put(state, shardings),
                                         jax.device_put(batch, batch_sharding), rng)


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                               strict=True))


moved = max_abs_diff(single_state.params, state.params)
mismatch = max_abs_diff(single_state.params, mesh_state.params)
kernel = mesh_state.params["encoder"]["layers"]["MlpBlock_0"]["Dense_0"]["kernel"]
print(f"loss: one device {float(single_metrics['loss']):.6f}, "
      f"mesh {float(mesh_metrics['loss']):.6f}")
print(f"the step moved the parameters by up to {moved:.2e}; "
      f"mesh vs one device differ by up to {mismatch:.2e}")
print(f"an MLP kernel {kernel.shape} on the mesh: spec {kernel.sharding.spec}, "
      f"{len(kernel.addressable_shards)} shards of {kernel.addressable_shards[0].data.shape}")

# %% [markdown]
# ## An overflow in one example: every device skips
#
# One pixel of example 40 (it lands on the second `data` shard) is set to 1e5, which
# becomes `inf` in float16. The optimizer runs under plain `jax.jit` on global arrays, so
# its all-finite check is one reduction over every shard of every gradient: all 8 devices
# take the same decision, leave their parameters untouched and halve the same scale.

# %%
bad = dict(batch, image=batch["image"].copy())
bad["image"][40, 3, 3, 0] = 1e5
with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    skipped_state, skipped_metrics = mesh_step(mesh_state, jax.device_put(bad, batch_sharding),
                                               rng)

scale_before = float(jamp.loss_scale(mesh_state.opt_state))
per_device_scale = {s.device.id: float(s.data)
                    for s in skipped_state.opt_state.scale.addressable_shards}
unchanged = {}  # device id -> all of its parameter shards bit-identical
for new, old in zip(jax.tree_util.tree_leaves(skipped_state.params),
                    jax.tree_util.tree_leaves(mesh_state.params), strict=True):
    old_shards = {s.device.id: np.asarray(s.data) for s in old.addressable_shards}
    for s in new.addressable_shards:
        same = np.array_equal(np.asarray(s.data), old_shards[s.device.id])
        unchanged[s.device.id] = unchanged.get(s.device.id, True) and same
print(f"gradients finite: {bool(skipped_metrics['grad_finite'])}, "
      f"steps skipped: {int(skipped_metrics['steps_skipped'])}")
print(f"{'device':>6}{'loss scale':>12}{'params unchanged':>18}")
for device_id in sorted(per_device_scale):
    print(f"{device_id:>6}{per_device_scale[device_id]:>12g}{str(unchanged[device_id]):>18}")
print(f"(scale before the step: {scale_before:g})")

# %% [markdown]
# ## Inside `jax.shard_map`: `axis_names`
#
# Under `jax.shard_map` each device runs the optimizer on its own block of the
# gradients, so a local check only sees local overflows. `DynamicLossScale(...,
# axis_names=mesh axes)` `psum`s the local non-finite flag over those axes, so every
# block skips together. Below, one `inf` sits in the block of the device at
# `[data=1, model=0, pipe=1]`; without `axis_names` (the control) only that device skips
# and the scales drift apart.

# %%
SCALE = 2.0**10
block = P("data", "model", "pipe")  # one (1, 1, 1, 4) block per device
grid = tuple(mesh.shape[a] for a in parallel.AXES)
block_params = jax.device_put(jnp.ones((*grid, 4)), jax.sharding.NamedSharding(mesh, block))
grads = np.full((*grid, 4), 0.5 * SCALE, np.float32)
grads[1, 0, 1, 2] = np.inf
grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, block))


def shard_mapped_update(tx):
    """tx.update per block; also returns each device's scale and skip decision."""

    def local(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        skipped = 1.0 - opt_state.last_finite.astype(jnp.float32)
        view = jnp.stack([jamp.loss_scale(opt_state), skipped])
        return updates, view.reshape(1, 1, 1, 2)

    opt_state = tx.init(block_params)
    state_specs = jax.tree_util.tree_map(lambda _: P(), opt_state)  # replicated scalars
    update = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(block, state_specs, block),
                                   out_specs=(block, block)))
    updates, view = update(grads, opt_state, block_params)
    return np.asarray(updates), np.asarray(view)


views = {}
for label, axis_names in [("axis_names=('data', 'model', 'pipe')", parallel.AXES),
                          ("no axis_names (control)", ())]:
    tx_block = jamp.DynamicLossScale(optax.sgd(0.1), init_scale=SCALE, axis_names=axis_names)
    updates, views[label] = shard_mapped_update(tx_block)
    skipped = views[label][..., 1].astype(bool)
    print(f"{label}: {skipped.sum()} of {skipped.size} devices skipped; "
          f"scales {sorted(set(views[label][..., 0].ravel().tolist()))}")
    for index in np.ndindex(*grid):
        print(f"    [data={index[0]}, model={index[1]}, pipe={index[2]}]  "
              f"scale {views[label][index][0]:g}  {'skipped' if skipped[index] else 'stepped'}")

# %% [markdown]
# ## Checks
#
# The notebook fails here if anything above silently went wrong.

# %%
# Training on the 2 x 2 x 2 mesh learned the digits (chance is 10%).
assert summary["mesh"] == {"data": jax.device_count() // 4, "model": 2, "pipe": 2}
min_accuracy = 0.7 if SIZE == "small" else 0.95
assert summary["test_accuracy"] >= min_accuracy, summary["test_accuracy"]
assert summary["final_loss_scale"] >= 1.0
assert summary["steps_skipped"] < 0.05 * summary["steps"]

# Sharded equals unsharded: the step moved the parameters, and identically on the mesh.
assert bool(single_metrics["grad_finite"]) and bool(mesh_metrics["grad_finite"])
assert moved > 1e-3 and mismatch < 1e-4, (moved, mismatch)
np.testing.assert_allclose(float(mesh_metrics["loss"]), float(single_metrics["loss"]),
                           rtol=1e-5)
assert kernel.sharding.spec == P("pipe", None, "model")

# The injected overflow: every device skipped, kept its parameters, halved the same scale.
assert not bool(skipped_metrics["grad_finite"])
assert int(skipped_metrics["steps_skipped"]) == int(mesh_metrics["steps_skipped"]) + 1
assert len(per_device_scale) == jax.device_count()
assert set(per_device_scale.values()) == {scale_before / 2}
assert all(unchanged.values()) and len(unchanged) == jax.device_count()

# shard_map: with axis_names all 8 blocks skip together; without, only the block with inf.
together = views["axis_names=('data', 'model', 'pipe')"]
alone = views["no axis_names (control)"]
assert together[..., 1].all() and set(together[..., 0].ravel()) == {SCALE / 2}
assert alone[..., 1].sum() == 1 and alone[1, 0, 1, 1] == 1
print("all checks passed")
