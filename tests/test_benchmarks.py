"""Smoke tests for benchmarks/: each script runs one step at a tiny size; nothing is timed.

Also checks the analytic FLOPs, the batch search, that the PyTorch baseline is the
same model as jamp's ViT, and that the README's generated tables are what
``python -m benchmarks.update_readme`` renders from the committed results.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common, run_all, update_readme
from jamp.models import sizes

REPO = Path(__file__).resolve().parents[1]

TINY = ["--variant", "ti4", "--image-size", "16", "--batch", "2", "--num-layers", "1",
        "--steps", "1", "--warmup", "1"]


def test_vit_sizes_and_flops():
    from jamp.models import vit

    assert vit.VARIANTS is sizes.VIT_SIZES  # one table for the model and the benchmarks
    assert sizes.vit_macs("b16", image_size=224) == pytest.approx(17.56e9, rel=1e-3)
    assert sizes.train_flops_per_image("b16", image_size=224) == pytest.approx(105.4e9, rel=1e-3)
    assert common.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert common.peak_tflops("NVIDIA H200") == 989.0
    assert common.peak_tflops("TFRT_CPU_0") is None


@pytest.mark.parametrize("threshold", [7, 8, 9, 100, 128, 129, 1000, 5000])
@pytest.mark.parametrize("start", [8, 128, 4096])
def test_largest_batch_finds_the_boundary(threshold, start):
    calls = []

    def fits(batch):
        calls.append(batch)
        return batch <= threshold

    expected = threshold // 8 * 8 or None
    assert common.largest_batch(fits, start, granularity=8) == expected
    assert len(calls) < 30


def test_torch_baseline_is_the_same_model_as_jamp():
    torch = pytest.importorskip("torch")
    from benchmarks import torch_amp
    from jamp.models import vit

    args = torch_amp.parse_args(["--variant", "b16", "--impl", "local"])
    with torch.device("meta"):
        model, impl = torch_amp.build_model(args)
    torch_params = sum(p.numel() for p in model.parameters())
    module = vit.create("b16", num_classes=1000)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
    jamp_params = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
    assert "timm not used" in impl
    assert torch_params == jamp_params == 86_567_656


def test_run_all_one_step_each(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from benchmarks import throughput, torch_amp

    scripts = {"throughput": throughput, "torch_amp": torch_amp}

    def in_process(script, flags, json_path, timeout):  # same flags, no new interpreter
        scripts[script].main([*flags, "--json", str(json_path)])
        return json.loads(Path(json_path).read_text())

    monkeypatch.setattr(run_all, "_run", in_process)
    out, keep = tmp_path / "out", tmp_path / "keep"
    argv = [*TINY, "--modes", "fp16", "--torch-modes", "fp16", "--torch-compile", "eager",
            "--torch-threads", "1", "--out-dir", str(out), "--keep-dir", str(keep)]
    threads = torch.get_num_threads()
    try:
        result = run_all.main(argv)
    finally:
        torch.set_num_threads(threads)
    stem = f"throughput-cpu-{common.today()}"
    assert {p.name for p in out.iterdir()} == {f"{stem}.{e}" for e in ("md", "json", "png")}
    assert len(list(keep.iterdir())) == 2

    def must_not_run(*args):
        raise AssertionError("the kept results should have been reused")

    monkeypatch.setattr(run_all, "_run", must_not_run)
    assert run_all.main(argv)["rows"] == result["rows"]
    (row,) = result["rows"]
    assert row["mode"] == "fp16" and row["torch_mode"] == "fp16"
    assert row["jamp_images_per_sec"] > 0 and row["torch_eager_images_per_sec"] > 0
    assert row["jamp_loss_finite"] and row["jamp_jax_level_bytes"] > 0
    assert row["jamp_max_batch"] is None and row["jamp_peak_bytes"] is None  # CPU
    assert {t["verdict"] for t in result["targets"]} == {"n/a on CPU"}
    assert "CPU run" in (out / f"{stem}.md").read_text()


def test_memory_every_mode(tmp_path):
    from benchmarks import memory

    result = memory.main(["--models", "ti4", "--image-size", "16", "--batch", "2",
                          "--num-layers", "1", "--modes", "fp32,bf16,O2,fp8", "--remat", "",
                          "--out-dir", str(tmp_path)])
    rows = {r["mode"]: r for r in result["results"]}
    assert set(rows) == {"fp32", "bf16", "fp16_naive", "fp8"}
    # Delayed fp8 keeps 6 float32 entries per Dense (two histories of 1024) beside the params.
    assert rows["fp8"]["model_state_bytes"] >= 2 * 2 * 2 * 1024 * 4
    assert rows["fp8"]["total_bytes"] > rows["bf16"]["total_bytes"]
    assert rows["fp32"]["residual_ratio"] == 1.0
    assert rows["bf16"]["residual_ratio"] < 0.75
    # Half-precision params, norms kept in float32; fp32 master copies in the optimizer.
    assert rows["fp16_naive"]["params_bytes"] < 0.51 * rows["fp32"]["params_bytes"]
    assert rows["fp16_naive"]["opt_state_bytes"] > rows["fp32"]["opt_state_bytes"]
    assert (tmp_path / f"memory-cpu-{common.today()}.md").exists()


def test_throughput_nnx_trains_like_linen():
    from benchmarks import throughput

    result = throughput.main([*TINY, "--steps", "2", "--modes", "fp16",
                              "--frameworks", "linen,nnx"])
    linen, nnx = result["results"]
    assert (linen["flax"], nnx["flax"]) == ("linen", "nnx")  # the same weights and batch
    assert nnx["final_loss"] == pytest.approx(linen["final_loss"], rel=1e-6)
    assert nnx["jax_memory"]["params_bytes"] == linen["jax_memory"]["params_bytes"]
    assert nnx["steps_skipped"] == linen["steps_skipped"] and nnx["images_per_sec"] > 0


def test_accuracy_one_step(tmp_path):
    from benchmarks import accuracy

    result = accuracy.main(["--modes", "fp8", "--frameworks", "linen",
                            "--set", "max_steps=1", "--set", "num_layers=1",
                            "--set", "hidden_size=16", "--set", "num_heads=2",
                            "--set", "mlp_dim=32", "--set", "mesh.data=1",
                            "--plot-mode", "fp8", "--out-dir", str(tmp_path)])
    (row,) = result["results"]
    assert (row["mode"], row["framework"], row["steps"]) == ("fp8", "linen", 1)
    assert 0.0 <= row["test_accuracy"] <= 1.0
    stem = f"accuracy-cpu-{common.today()}"
    text = (tmp_path / f"{stem}.md").read_text()
    assert "| fp8 | linen |" in text
    # Each row can be reproduced exactly: the command, the commit and the seed are recorded.
    assert row["seed"] == 0 and row["commit"] and f"`{row['commit']}` (seed 0)" in text
    assert (tmp_path / f"{stem}-fp8-training.png").exists()


def test_readme_tables_are_generated_from_committed_results(tmp_path):
    readme = (REPO / "README.md").read_text()
    assert update_readme.render(readme) == readme, "run python -m benchmarks.update_readme"
    copy = tmp_path / "README.md"
    copy.write_text(readme)
    assert update_readme.main(["--readme", str(copy), "--check"]) == 0
    stale = update_readme.replace_block(readme, "perf-table", "typed by hand\n")
    copy.write_text(stale)
    assert update_readme.main(["--readme", str(copy), "--check"]) == 1
    assert update_readme.main(["--readme", str(copy)]) == 0
    assert copy.read_text() == readme


def test_accuracy_records_a_diverged_run(tmp_path):
    from benchmarks import accuracy

    records = [{"step": 10, "train/loss": 2.0, "train/loss_scale": 1.0,
                "train/steps_skipped": 3, "train/images_per_sec": 500.0},
               {"step": 20, "eval/accuracy": 0.25, "eval/loss": 2.1},
               {"step": 30, "train/loss": float("nan"), "train/loss_scale": 1.0,
                "train/steps_skipped": 13, "train/images_per_sec": 700.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "summary.json").write_text(json.dumps({"seed": 3, "commit": "abc1234"}))
    row = accuracy.diverged_row("O3", tmp_path, "Training stopped at step 30: ...", 1.0)
    assert row["mode"] == "fp16_pure" and row["status"] == "diverged: Training stopped at step 30"
    assert (row["seed"], row["commit"]) == (3, "abc1234")  # reproducible like the others
    assert (row["steps"], row["steps_skipped"], row["test_accuracy"]) == (30, 13, 0.25)
    assert common.accuracy_cells(row, [row]) == ("25.00%", "—")


def test_largest_batch_from_a_good_guess_takes_two_calls():
    calls = []
    fits = lambda b: calls.append(b) or b <= 300
    assert common.largest_batch(fits, 296, granularity=8, step=8) == 296
    assert calls == [296, 304]


def test_boost_step_times_the_three_steps():
    from benchmarks import boost_step

    result = boost_step.main(["--quick"])
    assert set(result["rows"]) == {"hand", "trainer", "boost"}
    assert all(row["step_ms"] > 0 for row in result["rows"].values())
    assert "vs hand-written" in boost_step.to_markdown(result)


GPU_ROUND = (Path(__file__).resolve().parents[1]
             / "benchmarks/results/gpu_round-nvidia-h200-2026-11-26")


def test_gpu_log_rebuilds_the_committed_gpu_results(tmp_path):
    """The GPU round's log gives back the committed per-process files (max batch folded in),
    and run_all --from-dir renders them with the targets measured."""
    from benchmarks import gpu_log

    text = (GPU_ROUND / "log.txt").read_text()
    written = gpu_log.write(gpu_log.parse(text), tmp_path, 15, 3, "1.0.29")
    names = sorted(str(p.relative_to(tmp_path)) for p in written)
    assert names == sorted(str(p.relative_to(GPU_ROUND)) for p in GPU_ROUND.glob("*/*.json"))
    for path in written:
        assert json.loads(path.read_text()) == json.loads(
            (GPU_ROUND / path.relative_to(tmp_path)).read_text())
    bf16 = json.loads((tmp_path / "b16/jamp-bf16.json").read_text())["results"]
    assert [(r["mode"], r["images_per_sec"], r["max_batch"]) for r in bf16] == [
        ("bf16", 1834.2, 896)]
    torch_bf16 = json.loads((tmp_path / "b16/torch-bf16.json").read_text())["results"]
    assert [r["compiled"] for r in torch_bf16] == [False, True]
    assert gpu_log.trainer_rates(text)["window_images_per_sec"][-1] == 1730
    result = run_all.main(["--from-dir", str(tmp_path / "b16"), "--modes",
                           "fp32,bf16,fp16,fp16_naive", "--out-dir", str(tmp_path / "out")])
    verdicts = {t["target"]: t["verdict"] for t in result["targets"]}
    assert verdicts["bf16 largest batch vs fp32's"] == "met"
    assert verdicts["bf16 img/s vs PyTorch AMP bf16 eager"] == "not met"
    assert result["device"]["device_kind"] == "NVIDIA H200"


def test_autocast_depth_measures_every_variant():
    """benchmarks.autocast_depth: one depth of the MLP, every variant timed and counted."""
    pytest.importorskip("equinox")
    from benchmarks import autocast_depth

    rows = autocast_depth.measure("mlp", 1, 4, steps=1, warmup=0)
    assert {"fp32", "jamp", "hand"} <= set(rows)
    for row in rows.values():
        assert row["step_ms"] > 0 and row["grad_ms"] > 0 and row["grad_hlo_instructions"] > 0
    result = dict(date="d", command="c", machine={"cpus": 2, "load_avg_1m": 0}, platform="cpu",
                  jax="j", equinox="e", mpx="m", batch=4, steps=1, warmup=0,
                  models={"mlp": {1: rows}})
    assert "| 1 |" in autocast_depth.to_markdown(result)


def test_compile_overhead_times_every_stage_of_every_variant():
    from benchmarks import compile_overhead

    result = compile_overhead.main(["--variant", "ti16", "--image-size", "16", "--num-layers",
                                    "1", "--repeats", "1", "--layers", "scanned", "--no-write"])
    rows = result["results"]["scanned"]
    assert set(rows) == set(compile_overhead.VARIANTS)
    assert all(t["compile"] > 0 and t["total"] >= t["trace"] for t in rows.values())
    # The counts come from the optimized HLO: float32 has no float16 converts to make.
    assert rows["fp32"]["converts"] < rows["hand_mixed"]["converts"] <= rows["autocast"]["converts"]
    assert all(t["instructions"] >= t["fusions"] > 0 for t in rows.values())
    assert "| scanned | autocast |" in compile_overhead.to_markdown(result)


def test_accuracy_over_seeds_keeps_runs_and_names_the_first_commands_cell(tmp_path):
    """--seeds aggregates per mode and framework; --keep trains nothing it already holds; the
    README block names the fp16/linen seed-0 cell as what the first command prints."""
    from benchmarks import accuracy

    values = {("fp32", 0): (0.975, 0.16), ("fp32", 1): (0.97, 0.17),
              ("fp16", 0): (0.96, 0.18), ("fp16", 1): (0.98, 0.15)}
    runs = [dict(mode=m, framework="linen", seed=s, status="ok", model="ViT-Ti/2",
                 test_accuracy=a, test_loss=loss, images_per_sec=1.0, steps=1100,
                 steps_skipped=int(m == "fp16"), final_loss_scale=1.0, wall_s=1.0,
                 commit="abc1234") for (m, s), (a, loss) in values.items()]
    runs += [dict(runs[0], mode="fp16_pure", seed=s, test_accuracy=0.0, test_loss=float("nan"),
                  status="diverged: Training stopped at step 90") for s in (0, 1)]
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"results": runs}))
    out = tmp_path / "out"
    tiny = ["--set", "max_steps=1", "--set", "num_layers=1", "--set", "hidden_size=16",
            "--set", "num_heads=2", "--set", "mlp_dim=32"]  # only if --keep were ignored
    result = accuracy.main(["--modes", "fp32,fp16", "--frameworks", "linen", "--seeds", "0,1",
                            "--keep", str(keep), "--out-dir", str(out), *tiny])
    assert [r["kept_from"] for r in result["results"]] == ["keep.json"] * 6  # none trained
    pure = next(a for a in result["aggregate"] if a["mode"] == "fp16_pure")
    assert pure["loss_mean"] is None and pure["accuracy_mean"] == 0.0  # NaN losses left out
    fp16 = next(a for a in result["aggregate"] if a["mode"] == "fp16")
    assert (fp16["seeds"], fp16["accuracy"], fp16["steps_skipped"]) == ([0, 1], [0.96, 0.98],
                                                                         [1, 1])
    assert fp16["accuracy_mean"] == pytest.approx(0.97)
    assert fp16["accuracy_std"] == pytest.approx(0.0141421, rel=1e-4)  # sample std (n - 1)
    block = update_readme._accuracy_block(out)
    assert "| fp16 | linen | 96.00 | 98.00 | 97.00 ± 1.41 | -0.25 pt |" in block
    assert "seed 0: at commit `abc1234` on this CPU its summary prints `test accuracy   " \
           "96.00%  (loss 0.1800)`" in block
