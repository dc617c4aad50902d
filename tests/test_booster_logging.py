"""jamp.boost(..., log_dir=...) + Boosted.log: the trainer's metrics.jsonl, TensorBoard scalars,
text and histograms, and tensor_stats.jsonl, read back from the files; nothing written when
disabled or off process 0; only what is written fetched; bad values one clear error.

One tiny linen model, compiled once for the module: four fp16 steps at ZeRO-3 over 2 devices
with statistics every 2 steps (state.step 0 and 2 collect), the second batch NaN (skipped:
the reason names the device holding the first NaN element).
"""

import math
import re
import struct

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import boost_log
from jamp.metrics import MetricsWriter, json_safe, read_metrics


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(nn.relu(nn.Dense(8, name="enc")(x)))


def _loss(y, t):
    return jnp.mean((y - t) ** 2), {"mae": jnp.mean(jnp.abs(y - t))}


_SCALARS = ["train/grad_norm", "train/loss", "train/loss_scale", "train/mae",
            "train/steps_skipped"]


def _read_events(log_dir):
    """[(step, tag, kind, value)] of every TensorBoard event file (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted((log_dir / "tensorboard").iterdir()):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("histo"):
                    out.append((event.step, v.tag, "histogram", v.histo))
                elif v.metadata.plugin_data.plugin_name == "text":
                    out.append((event.step, v.tag, "text", v.tensor.string_val[0].decode()))
                else:
                    out.append((event.step, v.tag, "scalar", v.simple_value))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Four logged steps; the fetches of each log call, and each step's fetched metrics."""
    log_dir = tmp_path_factory.mktemp("boost_log") / "run"  # created by jamp.boost
    b = jamp.boost(_Net(), optax.adam(1e-3), _loss, "fp16", tensor_stats=2, log_dir=log_dir,
                   mesh={"data": 2}, zero_stage=3)
    assert log_dir.is_dir()
    batch = (jnp.ones((4, 3)), jnp.zeros((4, 2)))
    nan = (batch[0].at[0, 0].set(jnp.nan), batch[1])
    state = b.init(jax.random.key(0), batch)
    fetches, steps = [], []
    real = boost_log.jax.device_get

    def spy(tree):
        fetches[-1].append(len(jax.tree_util.tree_leaves(tree)))
        return real(tree)

    boost_log.jax.device_get = spy
    try:
        for i, x in enumerate([batch, nan, batch, batch]):
            state, metrics = b.step(state, x)
            fetches.append([])
            b.log(i + 1, metrics)
            steps.append(real(metrics))
        fetches.append([])
        b.close()  # writes the step the last log call held back
    finally:
        boost_log.jax.device_get = real
    return b, log_dir, fetches, steps


def test_scalars_and_the_skip_reason_reach_metrics_jsonl_and_tensorboard(run):
    b, log_dir, _, steps = run
    rows = read_metrics(str(log_dir))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [sorted(set(r) - {"step"}) for r in rows] == [
        _SCALARS, sorted([*_SCALARS, "train/skip_reasons"]), _SCALARS, _SCALARS]
    reason = f"step 2 skipped: {b.explain(steps[1])}"
    assert reason == ("step 2 skipped: NaN in the gradient of enc/kernel (element (0, 0), "
                      "on device 0; 2 more non-finite); forward: NaN in the output of enc "
                      "(first in data shard 0 of 2)")
    assert rows[1]["train/skip_reasons"] == [reason]
    for row, m in zip(rows, steps, strict=True):
        for name in _SCALARS:
            want = float(m[name.removeprefix("train/")])
            assert row[name] == want or (math.isnan(row[name]) and math.isnan(want)), name
    assert [r["train/steps_skipped"] for r in rows] == [0, 1, 1, 1]

    events = [e for e in _read_events(log_dir) if not e[1].startswith("tensor_stats/")]
    scalars = {(s, tag): v for s, tag, kind, v in events if kind == "scalar"}
    finite = {(r["step"], k): r[k] for r in rows for k in _SCALARS if math.isfinite(r[k])}
    assert scalars.keys() == finite.keys()  # the NaN loss and norm of step 2: jsonl only
    assert all(scalars[k] == pytest.approx(v, rel=1e-6) for k, v in finite.items())
    texts = [(s, tag, v) for s, tag, kind, v in events if kind == "text"]
    assert texts == [(2, "train/skip_reasons/text_summary", reason)]


def test_collected_steps_write_the_trainers_tensor_stats(run):
    b, log_dir, _, steps = run
    import json

    stats = [json.loads(line) for line in (log_dir / "tensor_stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [1, 3]  # state.step 0 and 2 collected
    tables = [b.stats_table(steps[0]), b.stats_table(steps[2])]
    assert [s["loss_scale"] for s in stats] == [65536.0, 32768.0]
    assert [{g: s[g] for g in ("activations", "grads", "params")} for s in stats] == \
        json_safe(tables)  # inf (min_nonzero of a zero bias) written as "Infinity"

    events = [e for e in _read_events(log_dir) if e[1].startswith("tensor_stats/")]
    assert {s for s, *_ in events} == {1, 3}
    for step, table in zip((1, 3), tables, strict=True):
        got = {(tag, kind): v for s, tag, kind, v in events if s == step}
        want = {}
        for group, layers in table.items():
            want[(f"tensor_stats/{group}/non_finite", "scalar")] = 0
            want[(f"tensor_stats/{group}/min_headroom_bits", "scalar")] = min(
                v["headroom_bits"] for v in layers.values())
            for name, v in layers.items():
                for stat in ("amax", "underflow_fraction"):
                    # tensorboardX writes "(output)#1" as "_output__1" (its tag rule)
                    tag = re.sub(r"[^-/\w.]", "_", f"tensor_stats/{group}/{stat}/{name}")
                    want[(tag, "scalar")] = v[stat]
            want[(f"tensor_stats/{group}/log2_amax", "histogram")] = np.log2(
                [v["amax"] for v in layers.values() if v["amax"]])
        assert got.keys() == want.keys()
        assert "tensor_stats/grads/amax/enc/kernel" in {tag for tag, _ in got}
        for key, v in want.items():
            if key[1] == "histogram":
                h = got[key]
                assert (h.num, h.min, h.max) == pytest.approx((len(v), v.min(), v.max())), key
            else:
                assert got[key] == pytest.approx(v, rel=1e-6), key


def test_a_log_fetches_only_what_it_writes_one_call_late(run):
    """Each call writes the previous call's step (ready by then: no wait on the running
    step), close() the last; the leaves fetched for each step are those written."""
    _, _, fetches, _ = run
    scalars = len(_SCALARS) + 2  # + the skipped and collected flags
    assert fetches == [
        [],  # log(1): held
        [scalars, 3 * 8],  # log(2) writes step 1, collected: + 3 groups x 8 statistics
        [scalars, 5 + 6],  # step 2, skipped: + the gradient and activation search results
        [scalars, 3 * 8],  # step 3, collected
        [scalars],  # close() writes step 4, finite, not collected: the scalars only
    ]


def test_a_non_finite_loss_without_a_loss_scale_names_where(run, tmp_path):
    """bf16/fp32 (no loss scale) never skip: a NaN loss gets the same search's sentence."""
    b, _, _, steps = run
    writer = MetricsWriter(str(tmp_path))
    boost_log.write_step(writer, 2, {**steps[1], "skipped": np.bool_(False)},
                         collector=b.tensor_stats)
    writer.close()
    (row,) = read_metrics(str(tmp_path))
    assert row["train/non_finite_reason"] == (  # no shardings given: no device named
        "step 2: loss nan: NaN in the gradient of enc/kernel (element (0, 0); 2 more "
        "non-finite); forward: NaN in the output of enc (first in data shard 0 of 2)")
    assert "train/skip_reasons" not in row


class _Unfetchable:
    shape, ndim = (), 0

    def __array__(self, *args, **kwargs):
        raise AssertionError("fetched")


def test_nothing_is_written_without_log_dir_or_off_process_0(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics = {"loss": _Unfetchable()}
    jamp.boost(_Net(), optax.sgd(0.1), _loss).log(1, metrics)  # no log_dir: a no-op
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    b = jamp.boost(_Net(), optax.sgd(0.1), _loss, log_dir=tmp_path / "run")
    b.log(1, metrics)
    b.close()
    assert list(tmp_path.iterdir()) == []


def test_no_statistics_and_finite_steps_write_no_tensor_stats_nor_reasons(tmp_path):
    b = jamp.boost(nn.Dense(1), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2),
                   jamp.mixed_precision("fp16", init_scale=1024.0), log_dir=tmp_path)
    batch = (jnp.ones((2, 2)), jnp.ones((2, 1)))
    state, metrics = b.step(b.init(jax.random.key(0), batch), batch)
    b.log(1, metrics)
    b.log(1, b.eval_step(state, batch), prefix="eval/")
    b.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tensorboard"]
    assert [sorted(r) for r in read_metrics(str(tmp_path))] == [
        ["step", "train/grad_norm", "train/loss", "train/loss_scale", "train/steps_skipped"],
        ["eval/loss", "step"]]
    assert {kind for *_, kind, _ in _read_events(tmp_path)} == {"scalar"}


def test_bad_values_get_one_error_naming_the_fix(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"is a file, not a directory: pass a directory"):
        jamp.boost(_Net(), optax.sgd(0.1), _loss, log_dir=a_file)
    with pytest.raises(ValueError, match=r"cannot hold the logs: .*a_file"):
        jamp.boost(_Net(), optax.sgd(0.1), _loss, log_dir=a_file / "run")
    with pytest.raises(TypeError, match=r"log_dir=3: pass a directory path"):
        jamp.boost(_Net(), optax.sgd(0.1), _loss, log_dir=3)
    b = jamp.boost(_Net(), optax.sgd(0.1), _loss, log_dir=tmp_path / "run")
    good = {"loss": jnp.float32(1.0)}
    with pytest.raises(ValueError, match=r"step=-1: pass the number of steps done \(>= 0\)"):
        b.log(-1, good)
    with pytest.raises(TypeError, match=r"step=1.5: pass the step number as an int"):
        b.log(1.5, good)
    with pytest.raises(ValueError, match=r"metrics\['logits'\] has shape \(4, 2\): "
                                         r"Boosted.log writes scalars"):
        b.log(1, {**good, "logits": jnp.zeros((4, 2))})
    with pytest.raises(TypeError, match=r"metrics must be the dict a step returned"):
        b.log(1, [1.0])
    b.close()
    assert read_metrics(str(tmp_path / "run")) == []  # nothing written by a refused call
