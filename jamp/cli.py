"""``jamp.train``: train a Vision Transformer in any precision mode.

  jamp.train --config configs/vit_fp16.py                  # embedded digits, offline
  jamp.train --config configs/vit_bf16.py:s16,cifar10 --config.data_dir=/data/tfds
  jamp.train --config configs/vit_fp16.py --config.batch_size=256 --workdir runs/big

Also ``python -m jamp.train``. The config is an ``ml_collections`` file
(``get_config(arg)``, see ``jamp/config.py``); ``--config.key=value`` overrides any
field and unknown keys are rejected. The run directory gets ``metrics.jsonl``,
TensorBoard events, orbax checkpoints (resumed automatically), ``summary.json``
and ``training.png``.

The ``config.mesh`` axes (data, model, pipe) give data, tensor (Megatron) and
GPipe pipeline parallelism (``jamp/parallel``). Multi-host runs start one
process per host (or per GPU) under SLURM, Open MPI, torchrun-style variables
or ``--coordinator host:port --num_processes N --process_id i``; only process
0 writes metrics, plots and the summary. See the README, "Scaling out".

A config or flag error, a missing dataset or an unusable checkpoint ends the run
with one paragraph on stderr that names the fix and exit status 2; a diverged loss
scale with status 3. The Python API behind the command is
:func:`jamp.train.train_and_evaluate`.

Example:
  >>> import subprocess, sys
  >>> run = subprocess.run([sys.executable, "-m", "jamp.train"], capture_output=True, text=True)
  >>> print(run.returncode, run.stderr.splitlines()[-1].split(",")[0])
  1 jamp.train: --config is required
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

from jamp import data, parallel
from jamp.checkpoint import CheckpointError
from jamp.experiment import ConfigError
from jamp.loss_scale import LossScaleDivergedError
from jamp.train import train_and_evaluate

USER_ERRORS = (ConfigError, data.DatasetNotFoundError, CheckpointError, LossScaleDivergedError)
"""Errors reported as one paragraph (no traceback)."""

_PARSE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ``jamp.train --config configs/vit_fp16.py``.

    Example: ``main(["jamp.train", "--config", "configs/vit_fp16.py"])`` trains the
    embedded digits into ``runs/vit_fp16`` (see the module docstring).
    """
    _define_flags()
    app.run(_run, argv=sys.argv if argv is None else argv, flags_parser=_parse_flags)


def _define_flags() -> flags.FlagValues:
    if "config" not in flags.FLAGS:
        config_flags.DEFINE_config_file(
            "config", None, "Config file, e.g. configs/vit_fp16.py or "
            "configs/vit_fp16.py:b16,caltech101. Override fields with --config.key=value.",
            lock_config=True)
        flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>). "
                            "An existing run there is resumed.")
        flags.DEFINE_string("coordinator", None, "Multi-process runs: host:port of process 0's "
                            "jax.distributed coordinator (with --num_processes, --process_id). "
                            "Not needed under SLURM, Open MPI or torchrun-style variables.")
        flags.DEFINE_integer("num_processes", None, "Multi-process runs: number of processes.")
        flags.DEFINE_integer("process_id", None, "Multi-process runs: this process's index.")
    return flags.FLAGS


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with config-file and override errors as one paragraph."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, *_PARSE_ERRORS) as e:
        raise _usage_error(e) from None


def _run(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it renames at INFO
    if len(argv) > 1:
        raise SystemExit(f"jamp.train: unexpected arguments {argv[1:]}; see jamp.train --help.")
    try:
        config = flags.FLAGS.config
        if config is not None:
            config.mode  # noqa: B018  (absl loads config files lazily: fail here, clearly)
    except _PARSE_ERRORS as e:
        raise _usage_error(e) from None
    if config is None:
        raise SystemExit("jamp.train: --config is required, e.g. "
                         "jamp.train --config configs/vit_fp16.py (see --help).")
    workdir = flags.FLAGS.workdir or _default_workdir(flags.FLAGS["config"].config_filename)
    try:
        parallel.launch.initialize(flags.FLAGS.coordinator, flags.FLAGS.num_processes,
                                   flags.FLAGS.process_id)
    except ValueError as e:
        _fail(e, 2)
    try:
        train_and_evaluate(config, workdir)
    except USER_ERRORS as e:
        _fail(e, 3 if isinstance(e, LossScaleDivergedError) else 2)


def _fail(error: BaseException, status: int) -> NoReturn:
    print(f"jamp.train: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(status) from None


def _usage_error(error: BaseException) -> SystemExit:
    """Prints a config/flag error as one paragraph and returns the exit to raise."""
    text = str(error)
    if "Traceback" in text:  # absl wraps the config file's own exception with its traceback
        text = [line for line in text.splitlines() if line.strip()][-1]
    text = " ".join(text.strip("'\"").replace("\\n", " ").replace("\\'", "'").split())
    print(f"jamp.train: error: {text} -- Check --config (a file such as configs/vit_fp16.py, "
          "optionally with :model,dataset, e.g. :s16,cifar10) and the --config.key=value "
          "overrides: keys must exist in the config (see jamp/config.py) and values must "
          "have the field's type.", file=sys.stderr, flush=True)
    return SystemExit(2)


def _default_workdir(config_path: str) -> str:
    """``runs/<config name>[-<arg>]``, e.g. ``runs/vit_fp16-s16-cifar10``."""
    path, _, arg = config_path.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join("runs", name + (f"-{arg.replace(',', '-')}" if arg else ""))


if __name__ == "__main__":
    main()
