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
# # Training a ViT in fp32, fp16 and bf16 with `jamp.train`
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jamp-dev/jamp/blob/main/notebooks/02_vit_training.ipynb)
#
# `jamp.train` is a command-line trainer (`jamp.train --config configs/vit_fp16.py`); this
# notebook drives the Python API behind it, `jamp.train.train_and_evaluate(config,
# workdir)`, and trains the same Vision Transformer on the embedded digits dataset in
# three precision modes. The configs differ only in `config.mode`, so the runs compare
# cleanly: test accuracy, the memory a training step holds, throughput, and what the
# loss scale did.

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
# On a TPU, **bf16** is the mode to use; on a GPU, **fp16** (a T4 has no fast bfloat16)
# or, from Ampere on, **bf16**. On a CPU, half precision is not faster than float32 (XLA's
# CPU backend computes elementwise float16 in float32), so the throughput column means
# little there; the notebook then trains a smaller model for fewer epochs. Set
# `JAMP_NOTEBOOK_SIZE=small` or `full` to override.

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
import json
import shutil

import matplotlib.pyplot as plt
import numpy as np

import jamp
from jamp.config import vit_config
from jamp.train import train_and_evaluate

MODES = ["fp32", "fp16", "bf16"]
RUNS = os.path.abspath("runs/02_vit_training")
print("jamp", jamp.__version__, "| jax", jax.__version__, "| run directories in", RUNS)

# %% [markdown]
# ## The config
#
# `vit_config(mode)` is what `configs/vit_<mode>.py` returns: an `ml_collections` config,
# locked so that a misspelt key fails. With no dataset argument it trains a ViT-Ti with
# 2×2 patches on the 8×8 digits. The full size (the config's defaults, about 98% test
# accuracy) takes about a minute per mode on a 2-core CPU and much less on an
# accelerator; the small size trains 2 layers for 10 epochs and reaches about 90%.

# %%
def make_config(mode):
    config = vit_config(mode)
    if SIZE == "small":
        config.num_layers = 2
        config.num_epochs = 10
        config.learning_rate = 3e-3
        config.label_smoothing = 0.0
        # 8 fake CPU devices share the same cores: one device is fastest.
        config.mesh.data = 1
    config.checkpoint_every_steps = 10_000  # one checkpoint, at the end
    config.progress = SIZE == "full"        # a tqdm bar per run
    config.plot = False                     # this notebook draws its own plots
    return config


config = make_config("fp16")
print({k: config[k] for k in ("model", "patch_size", "num_layers", "hidden_size", "num_heads",
                              "mlp_dim", "batch_size", "num_epochs", "learning_rate")})
print("mesh", config.mesh.to_dict(), "| loss scale fields (None: the mode's default)",
      config.loss_scale.to_dict())

# %% [markdown]
# ## Three runs
#
# `train_and_evaluate` resumes from the checkpoints in `workdir` when there are any, so
# each run starts from an empty directory here. It prints a summary and returns it as a
# dict (also written to `workdir/summary.json`, next to `metrics.jsonl` and TensorBoard
# events).

# %%
summaries = {}
for mode in MODES:
    workdir = os.path.join(RUNS, mode)
    shutil.rmtree(workdir, ignore_errors=True)
    summaries[mode] = train_and_evaluate(make_config(mode), workdir)
    print()

# %% [markdown]
# ## Results
#
# Memory is counted by `jamp.memory_report` from shapes and dtypes (the same figures on
# CPU, GPU and TPU), per device-batch: parameters, gradients, optimizer state, and the
# residuals that the forward pass saves for the backward pass. Half-precision compute
# saves half-precision activations, so the residuals roughly halve; parameters,
# gradients and Adam's moments stay float32 in all three modes.

# %%
MIB = 2**20
base = summaries["fp32"]["memory"]
header = (f"{'mode':<6}{'test acc':>10}{'images/s':>10}{'skipped':>9}{'loss scale':>12}"
          f"{'residuals':>12}{'vs fp32':>9}{'total':>11}")
print(header)
print("-" * len(header))
for mode, s in summaries.items():
    mem = s["memory"]
    ips = s["images_per_sec"] or float("nan")
    print(f"{mode:<6}{s['test_accuracy']:>10.1%}{ips:>10,.0f}{s['steps_skipped']:>9}"
          f"{s['final_loss_scale']:>12g}{mem['residual_bytes'] / MIB:>8.2f} MiB"
          f"{mem['residual_bytes'] / base['residual_bytes']:>9.2f}"
          f"{mem['total_bytes'] / MIB:>7.2f} MiB")
print(f"\n{summaries['fp16']['steps']} steps per run on {summaries['fp16']['devices']} "
      f"device(s), mesh {summaries['fp16']['mesh']}")

# %%
def read_metrics(mode):
    with open(os.path.join(RUNS, mode, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def series(records, key):
    points = [(r["step"], r[key]) for r in records if key in r]
    return np.array(points).T if points else np.zeros((2, 0))


metrics = {mode: read_metrics(mode) for mode in MODES}
fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
for mode, records in metrics.items():
    axes[0].plot(*series(records, "train/loss"), label=mode)
    axes[1].plot(*series(records, "eval/accuracy"), marker="o", ms=3, label=mode)
axes[0].set(title="training loss", xlabel="step", yscale="log")
axes[1].set(title="test accuracy", xlabel="step", ylim=(0, 1))
steps, scales = series(metrics["fp16"], "train/loss_scale")
axes[2].step(steps, scales, where="post", color="C1")
axes[2].set_yscale("log", base=2)
axes[2].set(title="fp16 loss scale (logged every 10 steps)", xlabel="step")
residual = [summaries[m]["memory"]["residual_bytes"] / MIB for m in MODES]
axes[3].bar(MODES, residual, color=["C0", "C1", "C2"])
axes[3].set(title="residuals saved for backward", ylabel="MiB per device-batch")
for ax in axes[:2]:
    ax.legend()
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %%
ips = [summaries[m]["images_per_sec"] or 0.0 for m in MODES]
fig, ax = plt.subplots(figsize=(5, 3))
ax.bar(MODES, ips, color=["C0", "C1", "C2"])
ax.set(title=f"throughput on {BACKEND} ({DEVICE.device_kind})", ylabel="images / s")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Checks
#
# The notebook fails here if a run silently went wrong.

# %%
min_accuracy = 0.88 if SIZE == "small" else 0.95
for mode, s in summaries.items():
    assert s["test_accuracy"] >= min_accuracy, f"{mode}: {s['test_accuracy']:.1%}"
    assert s["steps"] == summaries["fp32"]["steps"] > 0
    assert s["images_per_sec"] and s["images_per_sec"] > 0
# Half precision costs no accuracy here.
for mode in ("fp16", "bf16"):
    gap = summaries["fp32"]["test_accuracy"] - summaries[mode]["test_accuracy"]
    assert gap < 0.05, f"{mode} is {gap:.1%} below fp32"
# Only fp16 scales the loss; fp32 and bf16 never skip a step.
for mode in ("fp32", "bf16"):
    assert summaries[mode]["final_loss_scale"] == 1.0 and summaries[mode]["steps_skipped"] == 0
assert summaries["fp16"]["final_loss_scale"] > 1.0
assert summaries["fp16"]["steps_skipped"] < 0.05 * summaries["fp16"]["steps"]
# Half-precision activations: the residuals shrink to well under fp32's, and fp16 and
# bf16 (both 2 bytes) save the same; parameters stay float32 in every mode.
mem = {m: summaries[m]["memory"] for m in MODES}
assert mem["fp16"]["residual_bytes"] < 0.7 * mem["fp32"]["residual_bytes"]
assert mem["bf16"]["residual_bytes"] == mem["fp16"]["residual_bytes"]
assert mem["fp16"]["params_bytes"] == mem["bf16"]["params_bytes"] == mem["fp32"]["params_bytes"]
print("all checks passed")
