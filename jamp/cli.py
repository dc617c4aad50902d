"""``jamp.train``: train a Vision Transformer in any precision mode.

  jamp.train --config vit_fp16                             # embedded digits, offline
  jamp.train --config configs/vit_fp16.py                  # the same recipe, as a path
  jamp.train --config configs/vit_bf16.py:s16,cifar10 --config.data_dir=/data/tfds
  jamp.train --config configs/vit_fp16.py --config.batch_size=256 --workdir runs/big

Also ``python -m jamp.train``. The config is a recipe that ships with jamp, by name
from any directory (``jamp/configs``: vit_fp16, vit_bf16, vit_fp8, vit_fp16_3d, ...),
or an ``ml_collections`` file (``get_config(arg)``, see ``jamp/config.py``), or a
Colossal-AI-style file of module-level values (``BATCH_SIZE = 128``,
``fp16 = dict(mode=AMP_TYPE.TORCH)``, ``gradient_accumulation = 4``:
:func:`jamp.seed_keys.config_from_file`); a ``configs/<name>.py`` path names the
recipe too. ``--config.key=value`` overrides any
field and unknown keys are rejected; ``jamp.train --help`` lists every key with its
default and meaning. The run directory gets ``config.json`` (the resolved config),
``metrics.jsonl``, TensorBoard events, orbax checkpoints (resumed automatically),
``summary.json`` and ``training.png``; rerunning a finished run prints where its
summary is and exits 0.

The ``config.mesh`` axes (data, model, pipe) give data, tensor (Megatron) and
GPipe pipeline parallelism (``jamp/parallel``). Multi-host runs start one
process per host (or per GPU) under SLURM, Open MPI, torchrun-style variables
or ``--coordinator host:port --num_processes N --process_id i``; only process
0 writes metrics, plots and the summary. See docs/guides/parallel.md.

Exit status: 0 when the run finished (or had finished before); 2 for a config or
flag error, a missing dataset, an unusable workdir or checkpoint (one paragraph on
stderr that names the fix, nothing written); 3 when the loss scale diverged (the
summary and plot are still written); 130 (SIGINT, Ctrl-C) or 143 (SIGTERM, a scheduler's
preemption notice) when a signal stopped the run: the step in progress is finished and
checkpointed, one line names the step and the command that resumes there, and a second
signal exits at once (:mod:`jamp.preemption`). The Python API behind the command is
:func:`jamp.train.train_and_evaluate`.

Example:
  >>> import subprocess, sys
  >>> run = subprocess.run([sys.executable, "-m", "jamp.train"], capture_output=True, text=True)
  >>> print(run.returncode, run.stderr.splitlines()[-1].split(",")[0])
  2 jamp.train: error: --config is required
"""

from __future__ import annotations

import functools
import os
import re
import runpy
import shlex
import signal
import sys
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from jamp import configs, data, parallel, seed_keys
from jamp.checkpoint import CheckpointError
from jamp.config import FIELD_HELP, vit_config
from jamp.experiment import ConfigError, ConfigWarning
from jamp.loss_scale import LossScaleDivergedError
from jamp.preemption import Preempted
from jamp.train import train_and_evaluate

USER_ERRORS = (ConfigError, data.DatasetNotFoundError, CheckpointError, LossScaleDivergedError)
"""Errors reported as one paragraph (no traceback)."""

HELP_ARGS = ("-h", "--help", "-help", "-?")
"""Arguments that print :func:`help_text` and exit 0 (absl's ``--helpfull`` lists all flags)."""

_PARSE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError)
_JAMP_FLAGS = ("config", "workdir", "coordinator", "num_processes", "process_id")
_FLAGS_FIX = ("jamp.train's flags are --config RECIPE[:model,dataset], --config.KEY=VALUE, "
              "--workdir DIR and, for multi-process runs, --coordinator, --num_processes, "
              "--process_id; jamp.train --help lists them and every config key.")
_CONFIG_FIX = ("Pass a recipe such as --config vit_fp16 (jamp ships "
               f"{', '.join(configs.NAMES)}) or a config file, optionally with :model,dataset "
               "(e.g. vit_fp16:s16,cifar10).")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ``jamp.train --config vit_fp16``.

    ``--help``/``-h`` print :func:`help_text` and exit 0 (``--helpfull`` adds every
    absl flag of the libraries); see the module docstring for the exit statuses.

    Example:
      >>> try:
      ...     main(["jamp.train", "--help"])
      ... except SystemExit as e:
      ...     print("exit status", e.code)  # doctest: +ELLIPSIS
      usage: jamp.train --config RECIPE[:model,dataset] [--config.KEY=VALUE ...] [--workdir DIR]
      ...
      exit status 0
    """
    argv = list(sys.argv if argv is None else argv)
    command = resume_command(argv)  # as given (a recipe's name, not its file), to resume
    if any(arg in HELP_ARGS for arg in argv[1:]):
        _print_help(help_text(*_help_config(argv[1:])))
    _define_flags()
    if any(arg in ("--helpfull", "-helpfull") for arg in argv[1:]):
        _print_help(f"{help_text(*_help_config(argv[1:]))}\n\nEvery flag, absl's, grain's, "
                    f"orbax's and tfds's included:\n{flags.FLAGS.get_help()}")
    argv = _resolve_config(argv)  # a recipe's name -> its file, which absl loads
    # ml_collections reads the config overrides from sys.argv; a fresh parse per call.
    saved, sys.argv = sys.argv, argv
    try:
        flags.FLAGS.unparse_flags()
        for name in [n for n in flags.FLAGS if n.startswith("config.")]:
            delattr(flags.FLAGS, name)
        app.run(functools.partial(_run, command=command), argv=argv, flags_parser=_parse_flags)
    finally:
        sys.argv = saved


def help_text(config: ConfigDict | None = None, source: str = "vit_fp16") -> str:
    """``jamp.train --help``: usage, examples, jamp's flags and every config key.

    Args:
      config: the config whose keys and defaults are listed (default: ``source``'s).
      source: where ``config`` came from, for the heading.

    Example:
      >>> print("\\n".join(line for line in help_text().splitlines()
      ...                  if line.startswith("  --config.batch_size=")))  # doctest: +ELLIPSIS
        --config.batch_size=64                     global batch size, split over processes, ...
    """
    config = vit_config("fp16") if config is None else config
    doc = (__doc__ or "").split("\n\n")
    examples = "\n".join(line for line in doc[1].splitlines() if line.strip())
    lines = [
        "usage: jamp.train --config RECIPE[:model,dataset] [--config.KEY=VALUE ...] "
        "[--workdir DIR]",
        "",
        doc[0].strip("`").replace("``", ""),
        "",
        "examples:",
        examples,
        "",
        "flags:",
    ]
    for name in _JAMP_FLAGS:
        lines += _item(f"--{name}", _define_flags()[name].help)
    lines += _item("-h, --help", "this help; --helpfull adds absl's, grain's and orbax's flags")
    lines += ["", f"config keys (--config.KEY=VALUE; the defaults of {source}):"]
    for key, value in _flat(config):
        lines += _item(f"--config.{key}={value!r}", FIELD_HELP.get(key, ""))
    lines += ["", "exit status: 0 finished (or had finished before); 2 config, flag, data, "
              "workdir or checkpoint error (nothing written); 3 diverged (the loss scale, or a "
              "NaN/inf loss in a mode without one)."]
    return "\n".join(lines)


def _print_help(text: str) -> NoReturn:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # jamp.train --help | head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(0)


def _item(name: str, meaning: str, width: int = 42) -> list[str]:
    wrapped = textwrap.wrap(meaning, 100 - width - 3) or [""]
    if len(name) >= width:
        return [f"  {name}", *(" " * (width + 3) + w for w in wrapped)]
    return [f"  {name:<{width}} {wrapped[0]}", *(" " * (width + 3) + w for w in wrapped[1:])]


def _flat(config: ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _help_config(args: list[str]) -> tuple[ConfigDict | None, str]:
    """The config named by ``--config`` in ``args`` and its name, if it loads."""
    for i, arg in enumerate(args):
        value = (arg.split("=", 1)[1] if re.match(r"^--?config=", arg) else
                 args[i + 1] if arg in ("--config", "-config") and i + 1 < len(args) else None)
        if value:
            path, _, config_arg = configs.resolve(value).partition(":")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    get_config = runpy.run_path(path)["get_config"]
                    return get_config(config_arg) if config_arg else get_config(), value
            except Exception:  # the help never fails; the run will report the problem
                break
    return None, "vit_fp16"


def _resolve_config(argv: list[str]) -> list[str]:
    """``argv`` with ``--config``'s recipe name (or old ``configs/NAME.py`` path) made the
    packaged recipe's file (:func:`jamp.configs.resolve`)."""
    out = [seed_keys.cli_alias(arg) for arg in argv]  # --config.gradient_accumulation=4
    for i, arg in enumerate(out):
        given = re.match(r"^(--?config=)(.*)$", arg)
        if given:
            out[i] = given.group(1) + _config_file(given.group(2))
        elif arg in ("--config", "-config") and i + 1 < len(out):
            out[i + 1] = _config_file(out[i + 1])
    return out


def _config_file(value: str) -> str:
    """A recipe's file, or a Colossal-AI-style file (no ``get_config``) behind
    :func:`jamp.seed_keys.get_config`."""
    missing = configs.not_found(value)
    if missing:  # e.g. a misspelled recipe: one line, not absl's loading error
        _fail(missing, 2)
    value = configs.resolve(value)
    if seed_keys.is_colossalai_file(value):
        return f"{seed_keys.__file__}:{os.path.abspath(value)}"
    return value


def _define_flags() -> flags.FlagValues:
    if "config" not in flags.FLAGS:
        config_flags.DEFINE_config_file(
            "config", None, "A recipe's name or a config file, e.g. vit_fp16, "
            "vit_fp16:b16,caltech101 or my_config.py. Override fields with --config.KEY=VALUE.",
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
        _fail(_usage_message(e), 2)


def resume_command(argv: list[str]) -> str:
    """The command line ``argv`` ran, to print: ``jamp.train ...`` or ``python -m jamp.train ...``.

    Example:
      >>> resume_command(["/venv/bin/jamp.train", "--config", "vit_fp16", "--workdir=runs/a b"])
      "jamp.train --config vit_fp16 '--workdir=runs/a b'"
    """
    program = os.path.basename(argv[0]) if argv else "jamp.train"
    if program.endswith(".py"):  # python -m jamp.train (or -m jamp.cli)
        program = f"{shlex.quote(sys.executable)} -m jamp.train"
    return " ".join([program, *map(shlex.quote, argv[1:])])


def _run(argv: list[str], command: str = "jamp.train") -> None:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it renames at INFO
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}: {_FLAGS_FIX}", 2)
    try:
        config = flags.FLAGS.config
        if config is not None:
            config.mode  # noqa: B018  (absl loads config files lazily: fail here, clearly)
    except _PARSE_ERRORS as e:
        _fail(_usage_message(e), 2)
    if config is None:
        _fail("--config is required, e.g. jamp.train --config vit_fp16 "
              "(jamp.train --help lists the flags and every config key).", 2)
    workdir = flags.FLAGS.workdir or _default_workdir(flags.FLAGS["config"].config_filename)
    try:
        parallel.launch.initialize(flags.FLAGS.coordinator, flags.FLAGS.num_processes,
                                   flags.FLAGS.process_id)
    except ValueError as e:
        _fail(e, 2)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            train_and_evaluate(config, workdir)
    except USER_ERRORS as e:
        _fail(e, 3 if isinstance(e, LossScaleDivergedError) else 2)
    except Preempted as e:  # the checkpoint at e.step is on disk
        print(f"jamp.train: {e}; resume with: {command}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_status) from None
    except KeyboardInterrupt:  # Ctrl-C before or after the loop (it handles its own)
        _fail("interrupted by SIGINT outside the training loop; the checkpoints on disk are "
              f"intact: {command} resumes from the newest.", 128 + signal.SIGINT)


def _fail(error: BaseException | str, status: int) -> NoReturn:
    print(f"jamp.train: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(status) from None


_SHOW_WARNING = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """jamp's own warnings (:class:`~jamp.experiment.ConfigWarning`: an unsafe mode, idle
    devices, a ZeRO stage that splits nothing, a run shorter than its warm-up) as one
    ``jamp.train: warning:`` line; others as usual."""
    if issubclass(category, ConfigWarning):
        print(f"jamp.train: warning: {message}", file=sys.stderr, flush=True)
    else:
        _SHOW_WARNING(message, category, filename, lineno, file, line)


def _usage_message(error: BaseException) -> str:
    """A flag or config-file error as one paragraph that names the fix."""
    text = str(error)
    if "Traceback" in text:  # absl wraps the config file's own exception with its traceback
        text = [line for line in text.splitlines() if line.strip()][-1]
    text = " ".join(text.replace("\\n", " ").split()).removeprefix("ValueError: ")
    if f"{seed_keys.__file__}:" in str(error):  # a Colossal-AI-style file: its own message
        return text
    override = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", text)
    if override:  # a value that does not parse as the field's type
        key, value, why = override.groups()
        kind, example = _field_kind(key)
        why = "not True or False" if kind == "True or False" else why
        return (f"--config.{key}={value!r} is not valid ({why}): {key} takes {kind}, e.g. "
                f"--config.{key}={example} ({FIELD_HELP.get(key, 'see jamp.train --help')}).")
    typo = re.search(r'Did you mean "([\w.]+)" instead of "([\w.]+)"', text)
    if typo:  # an override key that does not exist
        good, bad = typo.groups()
        for arg in sys.argv:  # the full path of a nested key, e.g. loss_scale.init_scal
            given = re.match(rf"--?config\.((?:\w+\.)*){re.escape(bad)}(=|$)", arg)
            if given:
                good, bad = given.group(1) + good, given.group(1) + bad
        return (f"--config.{bad} is not a config key; did you mean --config.{good}? "
                "(jamp.train --help lists every key.)")
    if "config file" in text or str(error).startswith("flag --config="):
        return f"{text} -- {_CONFIG_FIX}"
    return f"{text} -- {_FLAGS_FIX}"


def _field_kind(key: str) -> tuple[str, str]:
    """What a config field takes, in words, and an example value."""
    config, *parents, leaf = vit_config("fp16"), *key.split(".")
    try:
        for parent in parents:
            config = config[parent]
        kind, default = config.get_type(leaf), config[leaf]
    except (KeyError, AttributeError):
        return "a value of the field's type", "..."
    words = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
    examples = {bool: "True", int: "1", float: "1.0", str: "'...'"}
    return (words.get(kind, f"a {kind.__name__}"),
            repr(default) if default is not None else examples.get(kind, "..."))


def _default_workdir(config_path: str) -> str:
    """``runs/<config name>[-<arg>]``, e.g. ``runs/vit_fp16-s16-cifar10``."""
    path, _, arg = config_path.partition(":")
    if arg and os.path.abspath(path) == os.path.abspath(seed_keys.__file__):
        path, arg = arg, ""  # a Colossal-AI-style file: named after itself
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join("runs", name + (f"-{arg.replace(',', '-')}" if arg else ""))


if __name__ == "__main__":
    main()
