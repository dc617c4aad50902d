"""jamp.boost's step vs the trainer's step vs a hand-written loss-scaled step: time per step.

The same model (jamp's linen ViT with the digits recipe's size: 4 layers, width 64, 8x8
images, patch 2, 10 classes), the same optimizer (clip 1.0 + AdamW with warm-up and
cosine decay) and the same batch, fp16 with dynamic loss scaling, on one device:

- ``hand``: the README's lower-level loop: ``jamp.apply_policy``, ``jamp.make_optimizer``,
  ``jamp.scale_loss``, ``tx.update``, ``optax.apply_updates`` in one ``jax.jit`` with the
  parameters and optimizer state donated;
- ``trainer``: ``jamp.train.jit_train_step`` of the same config (what ``jamp.train`` runs);
- ``boost``: ``jamp.boost(module, optimizer, loss, "fp16")`` and ``boosted.step``.

The three are timed in turn, ``--steps`` rounds after ``--warmup``, and the medians are
compared in one run (``common.time_steps``). Writes
``benchmarks/results/boost_step-<platform>-<date>.md/.json``.

  python -m benchmarks.boost_step                # batch 64, 30 timed rounds
  python -m benchmarks.boost_step --quick        # a smoke run (tests/test_benchmarks.py)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import optax

import jamp
from benchmarks import common
from jamp import experiment, parallel, train
from jamp.config import vit_config
from jamp.step import cross_entropy


def _config(batch: int, quick: bool):
    c = vit_config("fp16")
    c.batch_size, c.mesh.data, c.max_steps = batch, 1, 1000
    if quick:
        c.num_layers, c.hidden_size, c.mlp_dim = 1, 16, 32
    return c


def _optimizer(c, total: int) -> optax.GradientTransformation:
    """The recipe's optimizer before the mode wraps it (experiment.build_optimizer's)."""
    warmup = min(c.warmup_steps, total - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, c.learning_rate, warmup, total)
    return optax.chain(optax.clip_by_global_norm(c.grad_clip_norm),
                       optax.adamw(schedule, weight_decay=c.weight_decay))


def build(batch: int, quick: bool) -> dict[str, Any]:
    """The three steps, each with its own state, ready to run on the same batch."""
    c = _config(batch, quick)
    exp = experiment.build_experiment(c)
    images = jax.random.normal(jax.random.key(1), (batch, c.image_size, c.image_size, 1))
    labels = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    batch_dict = {"image": images, "label": labels}
    module, mp = exp.model.inner, exp.precision
    runs: dict[str, Any] = {}

    # trainer
    with jax.set_mesh(exp.mesh):
        _, shardings = experiment.state_shardings(exp, jax.random.key(0))
        trainer_state = [experiment.init_state(exp, jax.random.key(0), shardings)]
        with nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
            trainer_step = train.jit_train_step(exp, shardings)
    placed = jax.device_put(batch_dict, parallel.batch_sharding(exp.mesh))

    def run_trainer():
        with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
            trainer_state[0], m = trainer_step(trainer_state[0], placed, jax.random.key(3))
        jax.block_until_ready(m)

    runs["trainer"] = run_trainer

    # boost
    loss = lambda logits, y: cross_entropy(logits, y, c.label_smoothing)
    boosted = jamp.boost(module, _optimizer(c, exp.total_steps), loss, mp, inputs="image",
                         targets="label")
    boost_state = [boosted.init(jax.random.key(0), batch_dict)]

    def run_boost():
        boost_state[0], m = boosted.step(boost_state[0], batch_dict, jax.random.key(3))
        jax.block_until_ready(m)

    runs["boost"] = run_boost

    # hand-written
    model = jamp.apply_policy(module, mp)
    tx = jamp.make_optimizer(mp, _optimizer(c, exp.total_steps))
    params = nn.unbox(model.init(jax.random.key(0), images[:1]))["params"]
    hand_state = [(params, tx.init(params))]

    @jax.jit
    def hand_step(params, opt_state, batch, rng):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["image"], train=True,
                                 rngs={"dropout": rng})
            value = cross_entropy(logits, batch["label"], c.label_smoothing)
            return jamp.scale_loss(value, opt_state), value

        (_, value), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    hand_step = jax.jit(hand_step, donate_argnums=(0, 1))

    def run_hand():
        p, o = hand_state[0]
        p, o, value = hand_step(p, o, batch_dict, jax.random.key(3))
        hand_state[0] = (p, o)
        jax.block_until_ready(value)

    runs["hand"] = run_hand
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    return dict(runs=runs, n_params=int(n_params), config=dict(
        layers=c.num_layers, width=c.hidden_size, mlp=c.mlp_dim, image=c.image_size,
        patch=c.patch_size, batch=batch))


def to_markdown(result: dict[str, Any]) -> str:
    """The results file: what ran, the medians and the ratios to the hand-written step."""
    rows = result["rows"]
    hand = rows["hand"]["step_ms"]
    lines = [f"# jamp.boost step vs trainer step vs hand-written ({result['platform']}, "
             f"{result['date']})", "",
             f"`{result['command']}`; jax {result['jax']}, device {result['device']}, "
             f"load before {result['load_before']}; model {result['model']}, "
             f"{result['n_params']} params, fp16 with dynamic loss scaling; "
             f"{result['steps']} timed rounds after {result['warmup']}, the three in turn.", ""]
    lines += common.table("step | median ms/step | p10 | p90 | images/s | vs hand-written", [
        (name, f"{r['step_ms']:.2f}", f"{r['step_ms_p10']:.2f}", f"{r['step_ms_p90']:.2f}",
         f"{r['images_per_sec']:.0f}", f"{r['step_ms'] / hand:.3f}")
        for name, r in rows.items()])
    lines += ["", "CPU: XLA:CPU upcasts float16, so this measures jamp's overhead around the "
              "same computation (grad norm, step assembly), not mixed-precision speed."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Times the three steps in turn and writes the results file."""
    ap = common.parser(__doc__, timing=(30, 5))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 rounds, no file")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.batch, args.no_write = 3, 1, 8, True
    load_before = common.machine()["load_avg_1m"]
    built = build(args.batch, args.quick)
    times = common.time_steps(built["runs"], warmup=args.warmup, steps=args.steps,
                              rotate=True)
    rows = {name: common.summarize_times(times[name], args.batch) for name in
            ("hand", "trainer", "boost")}
    cfg = built["config"]
    result = dict(**common.header("boost_step", argv), load_before=load_before,
                  model=f"ViT {cfg['layers']} layers, width {cfg['width']}, "
                        f"{cfg['image']}px/{cfg['patch']}, batch {cfg['batch']}",
                  n_params=built["n_params"], steps=args.steps, warmup=args.warmup, rows=rows)
    print(markdown := to_markdown(result))
    if not args.no_write:
        common.write_results(common.results_stem(args.out_dir, "boost_step",
                                                 result["platform"]), result, markdown)
    return result


if __name__ == "__main__":
    main()
