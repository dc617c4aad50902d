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
