"""ZeRO-3 (FSDP) in your own training loop: jamp's loss scale on parameters split over 'data'.

The model is any Flax module under a jamp policy; the optimizer any optax one wrapped
by ``jamp.make_optimizer``. ZeRO adds three lines: the plan, and the shardings of the
parameters and of the optimizer state. Run with several devices (e.g.
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp.parallel import data_parallel, make_mesh, zero
from jamp.parallel.read_dtypes import read_dtypes


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.LayerNorm()(nn.Dense(64)(x)))
        return nn.Dense(8)(x)


def main(steps: int = 5, stage: int = 3) -> dict:
    mesh = make_mesh({"data": -1})
    model = jamp.apply_policy(MLP(), "fp16")
    x = jax.random.normal(jax.random.key(0), (32, 16))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 8)
    params = model.init(jax.random.key(2), x)["params"]
    tx = jamp.make_optimizer("fp16", optax.adamw(1e-2))

    # ZeRO: what to split, and in which dtype each parameter is gathered (float16
    # kernels, float32 LayerNorm: what the policied model reads).
    dtypes = read_dtypes(lambda p, x: model.apply({"params": p}, x), params, x)
    plan = zero.make_plan(stage, params, mesh, read_dtypes=dtypes)
    whole = lambda tree: jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree)
    param_shardings = zero.shardings(params, mesh) if stage == 3 else whole(params)
    opt_state_shape = jax.eval_shape(tx.init, params)
    opt_shardings = zero.shardings(opt_state_shape, mesh) if stage else whole(opt_state_shape)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, param_shardings)
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

        @functools.partial(jax.jit, out_shardings=(param_shardings, opt_shardings, None, None))
        def train_step(params, opt_state, batch):
            def loss_fn(p, batch):
                logits = model.apply({"params": p}, batch["x"])
                loss = optax.softmax_cross_entropy_with_integer_labels(
                    logits.astype(jnp.float32), batch["y"]).mean()
                return jamp.scale_loss(loss, opt_state), loss

            (_, loss), grads = data_parallel.value_and_grad(loss_fn, plan=plan)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, grads

        losses, skipped = [], []
        for i in range(steps):
            xs = x.at[0, 0].set(jnp.nan) if i == 1 else x  # one poisoned batch: skipped
            params, opt_state, loss, grads = train_step(params, opt_state, {"x": xs, "y": y})
            losses.append(float(loss))
            skipped.append(int(jamp.overflow_stats(opt_state).steps_skipped))
    kernel = "Dense_0"
    return {"losses": losses, "skipped": skipped,
            "grad_spec": grads[kernel]["kernel"].sharding.spec,
            "param_spec": params[kernel]["kernel"].sharding.spec,
            "master_or_mu_spec": [x.sharding.spec for x in jax.tree_util.tree_leaves(opt_state)
                                  if x.shape == params[kernel]["kernel"].shape][0],
            "loss_scale": float(jamp.loss_scale(opt_state))}


if __name__ == "__main__":
    print(main())
