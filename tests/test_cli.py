"""The ``jamp.train`` command as a new user meets it: help, and every bad input.

Most cases call :func:`jamp.cli.main` in this process (a fresh flag parse per call);
one subprocess checks the process-level contract (exit status, no traceback,
nothing written). No case compiles anything: every bad input is refused before.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jamp import cli
from jamp.config import FIELD_HELP, vit_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "vit_fp16.py")


def _main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["jamp.train", *args])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def _keys() -> dict[str, object]:
    return dict(cli._flat(vit_config("fp16")))


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_jamp_flags_every_config_key_and_the_examples(capsys, flag):
    status, out, err = _main(capsys, flag)
    assert status == 0 and not err
    for name in ("--config", "--workdir", "--coordinator", "--num_processes", "--process_id"):
        assert f"\n  {name} " in out, name
    for key, default in _keys().items():  # every key, its default and one line of meaning
        line = next(line for line in out.splitlines()
                    if line.startswith(f"  --config.{key}={default!r} "))
        assert FIELD_HELP[key].split()[0] in line, line
    assert "jamp.train --config configs/vit_bf16.py:s16,cifar10" in out  # the examples
    assert "exit status" in out
    # absl's, grain's and orbax's own flags stay under --helpfull.
    assert "--logtostderr" not in out and "--grain_" not in out and "--jax_" not in out


def test_helpfull_adds_the_libraries_flags_and_exits_0(capsys):
    status, out, _ = _main(capsys, "--helpfull")
    assert status == 0 and "  --config.batch_size=64 " in out and "logtostderr" in out


@pytest.mark.parametrize("value, mesh", [("vit_fp16_3d:b16,imagenet2012", (-1, 2, 2)),
                                         ("configs/vit_fp16_pp.py", (-1, 1, 2)),
                                         ("vit_fp16", (-1, 1, 1))])
def test_a_recipe_by_name_from_any_directory(value, mesh, tmp_path, monkeypatch):
    """The recipes ship in the package (jamp/configs): a bare name, or the checkout's old
    ``configs/NAME.py`` path, works from a directory without them."""
    runs = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "train_and_evaluate", lambda c, w: runs.append((c, w)))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["jamp.train", "--config", value, "--config.seed=3"])
    (config, workdir), = runs
    assert exit_.value.code in (0, None)
    assert (config.mesh.data, config.mesh.model, config.mesh.pipe) == mesh
    assert config.seed == 3 and workdir == os.path.join("runs", value.split("/")[-1].replace(
        ".py", "").replace(":", "-").replace(",", "-"))
    assert config.dataset == ("imagenet2012" if ":" in value else "digits")
    assert not list(tmp_path.iterdir())


def test_an_unknown_recipe_lists_the_recipes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = _main(capsys, "--config=vit_fp17", f"--workdir={tmp_path / 'run'}")
    assert status == 2 and err.count("\n") == 1 and "vit_fp16_3d" in err, err
    # A misspelled recipe: one short line, "did you mean", the recipes; no loader text.
    for args in (["--config", "vit_fp61"], ["--config=vit_fp61:s16,cifar10"]):
        status, _, err = _main(capsys, *args, f"--workdir={tmp_path / 'run'}")
        guess = "vit_fp16:s16,cifar10" if ":" in args[-1] else "vit_fp16"
        assert status == 2 and err.count("\n") == 1, err
        assert err.startswith(f"jamp.train: error: --config {args[-1].split('=')[-1]} is "
                              f"neither a recipe nor a file; did you mean {guess}? jamp ships "
                              "vit_bf16, vit_bf16_pure, vit_fp16,"), err
        assert "Failed loading" not in err and len(err) < 300, err
    assert not list(tmp_path.iterdir())
    status, out, _ = _main(capsys, "--config=vit_fp16:s16,cifar10", "--help")
    assert status == 0 and "  --config.dataset='cifar10' " in out


def test_the_trainer_does_not_import_the_cli():
    """jamp.cli is the one entry point; ``python -m jamp.train`` reaches it through a lazy
    import under ``__main__`` (the subprocess tests below run it), not an import circle."""
    code = "import sys, jamp.train; print(sorted(m for m in sys.modules if m == 'jamp.cli'))"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def test_every_config_key_has_one_line_of_meaning():
    assert set(FIELD_HELP) == set(_keys())
    assert all(text and "\n" not in text for text in FIELD_HELP.values())


def test_help_shows_the_named_configs_defaults(capsys):
    status, out, _ = _main(capsys, f"--config={CONFIG}:s16,cifar10", "-h")
    assert status == 0
    assert "  --config.batch_size=128 " in out and "  --config.dataset='cifar10' " in out


# (arguments, words the one error line must hold). "W" is replaced by the workdir.
BAD_INPUTS = [
    (["--config.batch_size=-8"], ["--config.batch_size=-8", "out of range", ">= 1"]),
    (["--config.batch_size=0"], ["--config.batch_size=0", ">= 1", "e.g. --config.batch_size="]),
    (["--config.batch_size=abc"], ["--config.batch_size='abc'", "integer"]),
    (["--config.learning_rate=-1"], ["--config.learning_rate=-1.0", "> 0"]),
    (["--config.learning_rate=nan"], ["--config.learning_rate=nan", "> 0"]),
    (["--config.max_steps=-5"], ["--config.max_steps=-5", ">= 1"]),
    (["--config.max_steps=1.5"], ["--config.max_steps='1.5'", "integer"]),
    (["--config.label_smoothing=1.0"], ["label_smoothing", "[0, 1)"]),
    (["--config.dropout_rate=1.0"], ["dropout_rate", "[0, 1)"]),
    (["--config.seed=-1"], ["--config.seed=-1", "2**32"]),
    (["--config.patch_size=0"], ["--config.patch_size=0"]),
    (["--config.image_size=0"], ["--config.image_size=0"]),
    (["--config.log_every_steps=0"], ["--config.log_every_steps=0"]),
    (["--config.warmup_steps=-1"], ["--config.warmup_steps=-1"]),
    (["--config.optimizer=adam"], ["'adam'", "'adamw' or 'sgd'"]),
    (["--config.augment=maybe"], ["--config.augment='maybe'", "True or False"]),
    (["--config.learning_rat=0.1"], ["--config.learning_rat is not", "--config.learning_rate?"]),
    (["--config.loss_scale.init_scal=2"], ["--config.loss_scale.init_scale?"]),
    (["--config.loss_scale.growth_factor=0.5"], ["growth_factor", "> 1"]),
    (["--config.batch_size=60"], ["batch_size=60", "8 devices", "multiple of 8"]),
    (["--config.zero_stage=4"], ["--config.zero_stage=4", "0, 1, 2 or 3"]),
    (["--config.zero_stage=-1"], ["--config.zero_stage=-1", "0, 1, 2 or 3"]),
    (["--config.zero_stage=3", "--config.scan_layers=False", "--config.max_steps=1"],
     ["--config.zero_stage=3", "--config.scan_layers=True", "--config.zero_stage=2"]),
    (["--workdirr=x"], ["workdirr", "--workdir DIR"]),
    (["extra"], ["unexpected arguments ['extra']"]),
    (["--config.dataset=cifar10", "--config.data_dir=W"], ["cifar10", "tfds build"]),
]


def test_bad_inputs_one_error_line_exit_2_nothing_written(tmp_path, capsys):
    for i, (args, needles) in enumerate(BAD_INPUTS):
        workdir = tmp_path / f"run{i}"
        args = [a.replace("=W", f"={tmp_path}") for a in args]
        status, out, err = _main(capsys, f"--config={CONFIG}", *args, f"--workdir={workdir}")
        lines = [line for line in err.splitlines() if line.strip()]
        assert status == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("jamp.train: error: "), (args, err)
        for needle in needles:
            assert needle in lines[0], (args, needle, lines[0])
        assert not workdir.exists(), args


def test_missing_config_and_unusable_workdirs(tmp_path, capsys, monkeypatch):
    status, _, err = _main(capsys, f"--workdir={tmp_path / 'run'}")
    assert status == 2 and err.startswith("jamp.train: error: --config is required")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    small = ["--config.num_layers=1", "--config.hidden_size=16", "--config.num_heads=2",
             "--config.mlp_dim=32"]
    for workdir, needle in ((a_file, "it is a file"), (a_file / "run", "is a file")):
        status, _, err = _main(capsys, f"--config={CONFIG}", *small, f"--workdir={workdir}")
        assert status == 2 and err.count("\n") == 1 and needle in err, err
    assert a_file.read_text() == "not a directory"

    # A read-only directory (root writes anywhere: report what access() says).
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real_access(p, mode) and (
        os.path.abspath(p) != str(read_only)))
    status, _, err = _main(capsys, f"--config={CONFIG}", *small, f"--workdir={read_only}/run")
    assert status == 2 and "cannot be written" in err and "read-only" in err, err
    assert os.listdir(read_only) == []


def test_any_workdir_failure_is_one_error_line(tmp_path, capsys, monkeypatch):
    """What the run writes there of the wrong kind (orbax stalled, then printed 30 lines),
    and a failure only writing finds (here with the checks switched off): one line that
    names the path and the reason, exit 2."""
    from jamp import experiment

    small = ["--config.num_layers=1", "--config.hidden_size=16", "--config.num_heads=2",
             "--config.mlp_dim=32"]
    (tmp_path / "checkpoints").write_text("")
    status, _, err = _main(capsys, f"--config={CONFIG}", *small, f"--workdir={tmp_path}")
    assert status == 2 and err.count("\n") == 1, err
    assert f"{tmp_path / 'checkpoints'} is not a directory" in err, err
    monkeypatch.setattr(experiment, "check_workdir", lambda workdir: None)
    status, _, err = _main(capsys, f"--config={CONFIG}", *small, f"--workdir={tmp_path}")
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"jamp.train: error: --workdir={tmp_path} cannot hold the run: "
                          f"{tmp_path / 'checkpoints'}: File exists."), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_subprocess_exit_status_no_traceback_nothing_written(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    runs = [subprocess.run([sys.executable, "-m", "jamp.train", *args], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
            for args in ([f"--config={CONFIG}", "--config.batch_size=0",
                          f"--workdir={tmp_path / 'run'}"],
                         ["--config=configs/vit_fp16.py", f"--workdir={a_file}"])]
    for run in runs:
        assert run.returncode == 2, run.stderr[-2000:]
        assert "Traceback" not in run.stderr
        assert run.stderr.count("jamp.train: error: ") == 1, run.stderr
    assert "--config.batch_size=0 is out of range" in runs[0].stderr
    assert "it is a file" in runs[1].stderr
    assert os.listdir(tmp_path) == ["a_file"] and a_file.read_text() == ""


def test_fp16_pure_warns_at_start_and_fp16_does_not(tmp_path, capsys, monkeypatch):
    from jamp import train
    from jamp.experiment import ConfigError

    def stop(*args, **kwargs):  # the warning comes before anything is built for the run
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(train, "_start", stop)
    for mode, warned in (("fp16_pure", True), ("O3", True), ("fp16", False), ("bf16", False)):
        status, _, err = _main(capsys, f"--config={CONFIG}", f"--config.mode={mode}",
                               f"--workdir={tmp_path / mode}")
        lines = err.splitlines()
        assert status == 2 and lines[-1] == "jamp.train: error: stopped by the test", err
        assert (lines[0].startswith("jamp.train: warning: mode fp16_pure keeps parameters")
                if warned else len(lines) == 1), (mode, err)


def test_zero_on_one_data_device_idle_devices_and_a_short_run_warn_one_line_each(
        tmp_path, capsys, monkeypatch):
    from jamp import train
    from jamp.experiment import ConfigError

    def stop(*args, **kwargs):  # the warnings come before anything is built for the run
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(train, "_start", stop)
    status, _, err = _main(capsys, f"--config={CONFIG}", "--config.zero_stage=3",
                           "--config.mesh.data=1", "--config.mesh.model=2",
                           "--config.max_steps=20", f"--workdir={tmp_path / 'run'}")
    lines = err.splitlines()
    assert status == 2 and lines[-1] == "jamp.train: error: stopped by the test", err
    assert lines[:-1] == [
        "jamp.train: warning: The mesh data=1 x model=2 x pipe=1 uses 2 of the 8 devices, "
        "leaving 6 idle: use all 8 with --config.mesh.data=-1 (data=4).",
        "jamp.train: warning: zero_stage=3 on a mesh whose 'data' axis has 1 device splits "
        "nothing: every device holds the whole state. Use a 'data' axis over several devices "
        "(--config.mesh.data=-1 takes every device; on a CPU: "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts).",
        "jamp.train: warning: The run has 20 steps, fewer than --config.warmup_steps=50: the "
        "learning rate rises for the whole run and never decays. Lower --config.warmup_steps "
        "(e.g. 2) or train longer (--config.num_epochs or --config.max_steps)."], err


COLOSSALAI_CONFIG = """from jamp import AMP_TYPE

BATCH_SIZE = 64
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.1
NUM_EPOCHS = 2
HIDDEN_SIZE = 16
DEPTH = 1
NUM_HEADS = 2
MLP_RATIO = 2
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16, hysteresis=3)
gradient_accumulation = 2
clip_grad_norm = 0.5
parallel = dict(pipeline=1, tensor=dict(size=1, mode='1d'))
progress = False
plot = False
"""


def test_a_colossalai_style_config_file_trains(tmp_path, capsys):
    """Module-level values, no get_config: jamp.train translates them (config.json)."""
    import json

    path = tmp_path / "config_naive.py"
    path.write_text(COLOSSALAI_CONFIG)
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["jamp.train", f"--config={path}", "--config.max_steps=2",
                  f"--workdir={workdir}"])
    assert exit_.value.code in (0, None), capsys.readouterr().err
    config = json.loads((workdir / "config.json").read_text())
    assert (config["mode"], config["batch_size"], config["learning_rate"], config["num_layers"],
            config["mlp_dim"], config["grad_accum_steps"], config["grad_clip_norm"]) == (
        "fp16_naive", 64, 3e-3, 1, 32, 2, 0.5)
    assert (config["loss_scale"]["init_scale"], config["loss_scale"]["hysteresis"],
            config["loss_scale"]["growth_interval"], config["loss_scale"]["max_scale"]) == (
        2.0**16, 3, 1000, 2.0**32)
    assert (config["mesh"]["pipe"], config["mesh"]["model"]) == (1, 1)
    assert (workdir / "summary.json").exists()


def test_colossalai_style_files_name_the_default_workdir_and_take_aliases(tmp_path, monkeypatch):
    runs = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "train_and_evaluate", lambda c, w: runs.append((c, w)))
    (tmp_path / "config_torch.py").write_text(
        "from jamp import AMP_TYPE\nfp16 = dict(mode=AMP_TYPE.TORCH, init_scale=2.**10)\n")
    for args in (["--config", "config_torch.py"],
                 ["--config=vit_fp16", "--config.gradient_accumulation=4",
                  "--config.clip_grad_norm=0.25"]):
        with pytest.raises(SystemExit):
            cli.main(["jamp.train", *args])
    (torch, workdir), (alias, _) = runs
    assert workdir == os.path.join("runs", "config_torch")
    assert torch.mode == "fp16" and torch.loss_scale.init_scale == 2.0**10
    assert torch.grad_clip_norm == 0.0  # Colossal-AI: no clip_grad_norm, no clipping
    assert (alias.grad_accum_steps, alias.grad_clip_norm) == (4, 0.25)


COLOSSALAI_BAD = [
    ("NUM_CLASSES = 10\n", ["jamp cannot map NUM_CLASSES", "BATCH_SIZE"]),
    ("from jamp import AMP_TYPE\nfp16 = dict(mode=AMP_TYPE.APEX, opt_level='O4')\n",
     ["opt_level='O4'", "'O0', 'O1', 'O2' or 'O3'"]),
    ("from jamp import AMP_TYPE\nfp16 = dict(mode=AMP_TYPE.APEX, num_losses=0)\n",
     ["num_losses=0", ">= 1"]),
    ("from jamp import AMP_TYPE\nfp16 = dict(mode=AMP_TYPE.APEX, num_losses=2)\n",
     ["num_losses"]),
    ("from jamp import AMP_TYPE\nfp16 = dict(mode=AMP_TYPE.APEX, patch_torch_functions=True)\n",
     ["jamp.autocast", "jamp.apply_policy"]),
    ("fp16 = dict(mode='torc')\n", ["AMP_TYPE.TORCH"]),
    ("parallel = dict(tensor=dict(size=2, mode='3d'))\n", ["'1d'"]),
]


def test_colossalai_style_bad_files_one_paragraph_exit_2_nothing_written(tmp_path, capsys):
    for i, (text, needles) in enumerate(COLOSSALAI_BAD):
        path = tmp_path / f"bad{i}.py"
        path.write_text(text)
        workdir = tmp_path / f"run{i}"
        status, _, err = _main(capsys, f"--config={path}", f"--workdir={workdir}")
        lines = [line for line in err.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1, (text, err)
        assert lines[0].startswith(f"jamp.train: error: bad{i}.py: "), err
        for needle in needles:
            assert needle in lines[0], (needle, lines[0])
        assert not workdir.exists()
