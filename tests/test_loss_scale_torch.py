"""Differential test: jamp.DynamicLossScale(hysteresis=1) against torch.amp.GradScaler.

Both sides train the same one-parameter-vector model ``loss = sum(p * w)`` with
SGD, where ``w`` is finite or holds an inf/NaN on the steps of a random overflow
pattern. Per step we compare the loss scale after ``update`` and whether the
optimizer stepped (torch: did the parameter change; jamp: were the updates
non-zero), and at the end the parameters themselves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jamp.loss_scale import DynamicLossScale, loss_scale, overflow_stats, scale_loss

torch = pytest.importorskip("torch")

STEPS = 300
LR = 0.01


def overflow_pattern(seed, p_overflow, steps=STEPS):
    """Random weights with inf/-inf/NaN on overflow steps, including bursts."""
    rng = np.random.default_rng(seed)
    bad = rng.random(steps) < p_overflow
    start = rng.integers(0, steps - 12)
    bad[start : start + 12] = True  # a burst: several back-offs in a row
    w = rng.normal(size=(steps, 3)).astype(np.float32)
    poison = rng.choice(np.asarray([np.inf, -np.inf, np.nan], np.float32), size=steps)
    w[bad, rng.integers(0, 3, size=bad.sum())] = poison[bad]
    return w, ~bad


def run_torch(ws, *, init_scale, growth_factor, backoff_factor, growth_interval):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=LR)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    scales, stepped = [], []
    for w in ws:
        opt.zero_grad()
        before = p.detach().clone()
        loss = (p * torch.from_numpy(w)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(not torch.equal(before, p.detach()))
    return np.asarray(scales, np.float32), np.asarray(stepped), p.detach().numpy()


def make_jamp_run(*, init_scale, growth_factor, backoff_factor, growth_interval):
    # torch does not clamp (it only refuses a growth that overflows to inf): put jamp's
    # bounds out of reach of these trajectories (asserted below).
    tx = DynamicLossScale(
        optax.sgd(LR),
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=2.0**-100,
        max_scale=2.0**126,
    )

    def body(carry, w):
        params, state = carry
        grads = jax.grad(lambda p: scale_loss(jnp.sum(p * w), state))(params)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), (
            loss_scale(state),
            jnp.any(updates != 0),
        )

    @jax.jit
    def run(ws):
        params = jnp.zeros((3,), jnp.float32)
        (params, _), (scales, stepped) = jax.lax.scan(body, (params, tx.init(params)), ws)
        return scales, stepped, params

    return run


@pytest.mark.parametrize("growth_interval", [3, 5, 7])
def test_matches_torch_grad_scaler(growth_interval):
    hp = dict(
        init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=growth_interval
    )
    run_jamp = make_jamp_run(**hp)
    for seed, p_overflow in [(growth_interval, 0.05), (growth_interval + 100, 0.3)]:
        ws, finite = overflow_pattern(seed, p_overflow)
        t_scales, t_stepped, t_params = run_torch(ws, **hp)
        j_scales, j_stepped, j_params = (np.asarray(a) for a in run_jamp(jnp.asarray(ws)))
        np.testing.assert_array_equal(j_scales, t_scales)
        np.testing.assert_array_equal(j_stepped, t_stepped)
        np.testing.assert_array_equal(t_stepped, finite)  # sanity: torch skipped exactly these
        np.testing.assert_allclose(j_params, t_params, rtol=1e-5, atol=1e-7)
        assert len(set(t_scales.tolist())) > 3  # the scale really moved both ways
        assert t_scales.min() > 2.0**-100 and t_scales.max() < 2.0**126


def test_matches_torch_with_non_power_of_two_factors():
    # torch's CPU kernel multiplies the float32 scale by the double factor and rounds
    # once; jamp multiplies in float32 by float32(factor). Compare with a tolerance.
    hp = dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=4)
    ws, _ = overflow_pattern(11, 0.08)
    t_scales, t_stepped, _ = run_torch(ws, **hp)
    assert t_scales.min() > 2.0**-100 and t_scales.max() < 2.0**126  # jamp's bounds unhit
    j_scales, j_stepped, _ = (np.asarray(a) for a in make_jamp_run(**hp)(jnp.asarray(ws)))
    np.testing.assert_array_equal(j_stepped, t_stepped)
    np.testing.assert_allclose(j_scales, t_scales, rtol=1e-4)
    assert len(set(t_scales.tolist())) > 3


# --------------------------------------------------------------------------- two losses
#
# apex's num_losses=2 driven with two torch GradScalers by hand: scaler i scales loss i
# and unscales (and checks) the gradients of loss i only; the optimizer steps on the sum
# of the unscaled gradients unless either scaler found an inf; each scaler is then
# update()d with its own found_inf (apex: loss_scalers[loss_id].update_scale()).


def two_loss_pattern(seed, steps=60, growth_interval=3):
    """Per-step weights of the two losses, poisoned (inf, -inf, NaN) on planted steps.

    Covers every case: no overflow, loss 0 only, loss 1 only, both; with finite runs
    longer than ``growth_interval`` so both scales grow.
    """
    rng = np.random.default_rng(seed)
    cases = rng.choice(4, size=steps, p=[0.55, 0.15, 0.15, 0.15])  # bit 0: loss 0, bit 1: 1
    cases[:growth_interval + 1] = 0
    cases[10:14] = [1, 1, 0, 0]  # loss 0 only, twice, then finite
    cases[20:24] = [2, 0, 2, 2]
    cases[30:33] = [3, 0, 0]
    w = rng.normal(size=(2, steps, 3)).astype(np.float32)
    poison = np.asarray([np.inf, -np.inf, np.nan], np.float32)
    for i in range(2):
        bad = (cases >> i) & 1 == 1
        w[i, bad, rng.integers(0, 3, size=bad.sum())] = rng.choice(poison, size=bad.sum())
    return w, cases


def run_torch_two_losses(w, *, init_scale, growth_interval):
    p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 3))
    opt = torch.optim.SGD([p], lr=LR)
    scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0,
                                    backoff_factor=0.5, growth_interval=growth_interval)
               for _ in range(2)]
    scales, trackers, stepped, params = [], [], [], []
    for w0, w1 in zip(w[0], w[1], strict=True):
        losses = [(p * torch.from_numpy(w0)).sum(),
                  0.5 * ((p - torch.from_numpy(w1)) ** 2).sum()]
        unscaled, found = [], []
        for scaler, loss in zip(scalers, losses, strict=True):
            (grad,) = torch.autograd.grad(scaler.scale(loss), p)
            p.grad = grad
            scaler.unscale_(opt)  # this scaler's check of this loss's gradients only
            found.append(any(bool(v.item()) for v in scaler._found_inf_per_device(opt).values()))
            unscaled.append(p.grad.detach().clone())
        step = not any(found)
        if step:
            p.grad = unscaled[0] + unscaled[1]
            opt.step()
        for scaler in scalers:
            scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append([s.get_scale() for s in scalers])
        trackers.append([s._get_growth_tracker() for s in scalers])
        stepped.append(step)
        params.append(p.detach().numpy().copy())
    return (np.asarray(scales, np.float32), np.asarray(trackers), np.asarray(stepped),
            np.asarray(params))


def make_jamp_two_losses(*, init_scale, growth_interval):
    tx = DynamicLossScale(optax.sgd(LR), init_scale=init_scale, growth_interval=growth_interval,
                          min_scale=2.0**-100, max_scale=2.0**126, num_losses=2)

    def body(carry, ws):
        params, state = carry
        w0, w1 = ws
        g0 = jax.grad(lambda p: scale_loss(jnp.sum(p * w0), state, loss_id=0))(params)
        g1 = jax.grad(lambda p: scale_loss(0.5 * jnp.sum((p - w1) ** 2), state, loss_id=1))(
            params)
        updates, state = tx.update((g0, g1), state, params)
        params = optax.apply_updates(params, updates)
        stats = overflow_stats(state)
        return (params, state), (loss_scale(state), state.growth_tracker, stats.last_finite,
                                 jnp.any(updates != 0), params)

    @jax.jit
    def run(w):
        params = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
        _, out = jax.lax.scan(body, (params, tx.init(params)), (w[0], w[1]))
        return out

    return run


@pytest.mark.parametrize("seed", [0, 1])
def test_two_losses_match_two_torch_grad_scalers(seed):
    hp = dict(init_scale=2.0**10, growth_interval=3)
    w, cases = two_loss_pattern(seed)
    assert set(cases.tolist()) == {0, 1, 2, 3}
    t_scales, t_trackers, t_stepped, t_params = run_torch_two_losses(w, **hp)
    j_scales, j_trackers, j_finite, j_nonzero, j_params = (
        np.asarray(a) for a in make_jamp_two_losses(**hp)(jnp.asarray(w)))
    np.testing.assert_array_equal(t_stepped, cases == 0)  # sanity: torch skipped exactly these
    np.testing.assert_array_equal(j_scales, t_scales)
    np.testing.assert_array_equal(j_trackers, t_trackers)
    np.testing.assert_array_equal(j_finite, t_stepped)
    np.testing.assert_array_equal(j_nonzero, t_stepped)
    np.testing.assert_allclose(j_params, t_params, rtol=1e-6, atol=1e-6)
    # the trajectories exercise the rule: both scales grew and backed off, and differed
    for i in range(2):
        assert len(set(t_scales[:, i].tolist())) > 2
    assert np.any(t_scales[:, 0] != t_scales[:, 1])
