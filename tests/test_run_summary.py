"""The printed end-of-run summary (``jamp.run_summary.format_summary``).

The summaries the trainer writes are checked end to end in ``tests/test_train.py``.
"""

from __future__ import annotations

from jamp.memory import MemoryReport
from jamp.run_summary import format_summary

SUMMARY = {"outcome": "completed", "model": "ViT-ti/2", "framework": "linen",
           "dataset": "digits", "mode": "fp16", "test_accuracy": 0.98, "test_loss": 0.07,
           "steps": 1100, "steps_skipped": 3, "final_loss_scale": 32768.0,
           "loss_scale_kind": "dynamic", "images_per_sec": 900.0, "devices": 1,
           "mesh": {"data": 1, "model": 1, "pipe": 1}}


def _lines(**changes) -> list[str]:
    return format_summary({**SUMMARY, **changes}, MemoryReport(0, 0, 0, 0, 0)).splitlines()


def test_the_header_names_the_framework():
    assert _lines()[0] == "== jamp.train summary: ViT-ti/2 (linen) on digits, mode fp16 =="
    assert _lines(framework="nnx")[0].startswith("== jamp.train summary: ViT-ti/2 (nnx) on")


def test_a_mode_without_a_loss_scale_prints_none():
    steps = [line for line in _lines() if line.startswith("steps ")]
    assert steps == ["steps           1100 (skipped 3, final loss scale 32768)"]
    for mode in ("bf16", "fp32", "fp8"):
        steps = [line for line in _lines(mode=mode, loss_scale_kind="none", steps_skipped=0,
                                         final_loss_scale=1.0) if line.startswith("steps ")]
        assert steps == ["steps           1100 (no loss scale: none skipped)"], steps


def test_the_outcome_line_says_why_the_run_stopped():
    scale = [line for line in _lines(outcome="diverged", steps=70) if "DIVERGED" in line]
    assert scale == ["outcome         DIVERGED at step 70 (the loss scale sat at its minimum "
                     "and every step overflowed)"]
    nan = [line for line in _lines(outcome="diverged", steps=8, non_finite_at_step=6,
                                   loss_scale_kind="none") if "DIVERGED" in line]
    assert nan == ["outcome         DIVERGED at step 8 (the train loss became NaN/inf at step 6)"]


def test_the_throughput_line_names_the_backend_and_device_kind():
    gpu = dict(backend="gpu", device_kind="NVIDIA H100 80GB HBM3", device_count=1)
    assert [line for line in _lines(**gpu) if line.startswith("throughput ")] == [
        "throughput      900 images/s on gpu: NVIDIA H100 80GB HBM3 x1"]
    cpu = dict(backend="cpu", device_kind="cpu", device_count=8, devices=8)
    assert [line for line in _lines(**cpu) if line.startswith("throughput ")] == [
        "throughput      900 images/s on cpu x8"]
    # A summary.json written before the keys existed still prints.
    assert "throughput      900 images/s on 1 device(s)" in _lines()
