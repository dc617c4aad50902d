"""ZeRO-3 (FSDP) in your own training loop: one ``jamp.boost`` call does the set-up.

The model is any Flax module (the fp16 policy is applied for you), the optimizer any
optax one (the loss scale wraps it). ``jamp.boost`` finds the dtype each parameter is
read in, plans the split, places parameters and optimizer state over 'data', and jits
the step with the state donated. Run with several devices (e.g.
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jamp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.LayerNorm()(nn.Dense(64)(x)))
        return nn.Dense(8)(x)


def main(steps: int = 5, stage: int = 3) -> dict:
    x = jax.random.normal(jax.random.key(0), (32, 16))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 8)
    loss_fn = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    boosted = jamp.boost(MLP(), optax.adamw(1e-2), loss_fn, "fp16", mesh={"data": -1},
                         zero_stage=stage)
    state = boosted.init(jax.random.key(2), (x, y))

    losses, skipped = [], []
    for i in range(steps):
        xs = x.at[0, 0].set(jnp.nan) if i == 1 else x  # one poisoned batch: skipped
        state, metrics = boosted.step(state, (xs, y))
        losses.append(float(metrics["loss"]))
        skipped.append(int(metrics["steps_skipped"]))
    kernel = state.params["Dense_0"]["kernel"]
    return {"losses": losses, "skipped": skipped, "param_spec": kernel.sharding.spec,
            "master_or_mu_spec": [a.sharding.spec for a in jax.tree_util.tree_leaves(
                state.opt_state) if a.shape == kernel.shape][0],
            "loss_scale": float(jamp.loss_scale(state.opt_state))}


if __name__ == "__main__":
    print(main())
