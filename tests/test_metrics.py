"""metrics.jsonl stays strict JSON when a run produces NaN/inf, and reads back exactly."""

import json
import math

import pytest

from jamp.metrics import MetricsWriter, read_metrics


def _strict(line: str):
    def refuse(token):
        raise ValueError(f"bare {token} in metrics.jsonl")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_metrics_are_strict_json_and_read_back(tmp_path, bad, caplog, capfd):
    writer = MetricsWriter(str(tmp_path))
    writer.write(5, {"train/loss": bad, "train/accuracy": 0.25, "train/steps_skipped": 3})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [_strict(line)["train/accuracy"] for line in lines] == [0.25]
    (record,) = read_metrics(str(tmp_path))
    assert record["step"] == 5 and record["train/steps_skipped"] == 3
    loss = record["train/loss"]
    assert (math.isnan(loss) and math.isnan(bad)) or loss == bad
    # TensorBoard gets finite values only (tensorboardX warns on every NaN/inf scalar).
    assert "NaN or Inf" not in caplog.text + "".join(capfd.readouterr())


def test_resume_drops_rows_after_the_checkpoint_and_a_cut_line_into_one_event_file(tmp_path):
    import os

    writer = MetricsWriter(str(tmp_path))
    for step in (5, 10, 15):
        writer.write(step, {"train/loss": 1.0 / step})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 20, "train/lo')  # killed while writing
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [5, 10, 15]
    writer = MetricsWriter(str(tmp_path), resume_step=10)
    writer.write(15, {"train/loss": 0.5})
    writer.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [5, 10, 15]
    assert len(os.listdir(tmp_path / "tensorboard")) == 1


def test_label_smoothing_floor_is_the_smoothed_targets_entropy():
    import numpy as np

    from jamp.metrics import label_smoothing_floor

    targets = np.full(10, 0.1 / 10)
    targets[3] += 0.9
    assert label_smoothing_floor(0.1, 10) == pytest.approx(-np.sum(targets * np.log(targets)))
