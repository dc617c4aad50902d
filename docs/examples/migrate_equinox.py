"""Moving an Equinox loop (or an mpx loop) to jamp (docs/guides/migrate.md).

An Equinox model has no ``dtype=`` hook: mpx asks you to cast the model and the
batch to half precision, to wrap ``eqx.filter_value_and_grad`` and to call
``mpx.optimizer_update``, and leaves sums and softmax in half precision unless you
decorate them by hand (``mpx.force_full_precision``). jamp does it at the level
of the loss function: ``jamp.autocast(loss, "fp16")`` runs every matmul in float16
and softmax/log-softmax/sums in float32 by rule, and the loss scale is an optax
transformation, so the optimizer step and the exact skip are the ones any optax
loop already has.

Run it: ``python docs/examples/migrate_equinox.py``; the tests run it too (Equinox
is a test dependency).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jamp


def cross_entropy(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --- before: a float32 Equinox step ------------------------------------------------------
tx32 = optax.adam(1e-3)


@eqx.filter_jit
def before_step(model, opt_state, x, y, tx):
    loss, grads = eqx.filter_value_and_grad(cross_entropy)(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


# --- after: the same step in fp16 with jamp (the 6 changed lines are marked) --------------
half_loss = jamp.autocast(cross_entropy, "fp16")                        # changed
tx16 = jamp.make_optimizer("fp16", optax.adam(1e-3))                    # changed


@eqx.filter_jit
def after_step(model, opt_state, x, y, tx):
    def scaled(model):                                                  # changed
        loss = half_loss(model, x, y)                                   # changed
        return jamp.scale_loss(loss, opt_state), loss                   # changed

    grads, loss = eqx.filter_grad(scaled, has_aux=True)(model)          # changed
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def main(steps: int = 5) -> dict:
    x = jax.random.normal(jax.random.key(0), (32, 16))
    y = jnp.arange(32) % 10
    model = eqx.nn.MLP(16, 10, 64, depth=2, key=jax.random.key(1))
    params = eqx.filter(model, eqx.is_array)

    m32, s32 = model, tx32.init(params)
    m16, s16 = model, tx16.init(params)
    losses = {"before": [], "after": []}
    for step in range(steps):
        bad = x.at[0, 0].set(jnp.nan) if step == 1 else x  # a NaN batch: fp16 skips it exactly
        m32, s32, l32 = before_step(m32, s32, x, y, tx32)
        m16, s16, l16 = after_step(m16, s16, bad, y, tx16)
        losses["before"].append(float(l32))
        losses["after"].append(float(l16))
    return dict(losses=losses, skipped=int(jamp.overflow_stats(s16).steps_skipped),
                scale=float(jamp.loss_scale(s16)))


if __name__ == "__main__":
    print(main())
