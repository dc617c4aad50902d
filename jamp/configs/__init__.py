"""The recipes that ship with jamp: ``jamp.train --config vit_fp16[:model,dataset]``.

Each module here (``vit_fp16``, ``vit_bf16``, ``vit_fp16_3d``, ...) has
``get_config(arg=None)`` returning an ``ml_collections`` config:
:func:`jamp.config.vit_config` in one precision mode, some with a mesh. Being part
of the package, they are there in a wheel or git install too, so ``--config`` takes a
recipe's name from any directory (:func:`resolve`). A path to a config file works as
before; a ``configs/<name>.py`` path that does not exist (the checkout's layout before
the recipes moved here) names the packaged recipe, so older commands keep working.

Example:
  >>> from jamp import configs
  >>> configs.NAMES[:3]
  ('vit_bf16', 'vit_bf16_pure', 'vit_fp16')
  >>> configs.get_config("vit_fp16_tp", "s16,cifar10").mesh.model
  2
  >>> configs.resolve("vit_fp16:s16,cifar10").endswith("jamp/configs/vit_fp16.py:s16,cifar10")
  True
  >>> configs.not_found("vit_fp61:s16,cifar10").split("?")[0]
  '--config vit_fp61:s16,cifar10 is neither a recipe nor a file; did you mean vit_fp16:s16,cifar10'
"""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil

import ml_collections

NAMES: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))
"""The packaged recipes' names."""


def get_config(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """The packaged recipe ``name``'s config (``arg``: ``"<model>,<dataset>"`` or None).

    Example:
      >>> get_config("vit_bf16").mode
      'bf16'
    """
    if name not in NAMES:
        raise ValueError(f"No recipe named {name!r}; jamp ships {', '.join(NAMES)}.")
    module = importlib.import_module(f"{__name__}.{name}")
    return module.get_config(arg) if arg else module.get_config()


def resolve(value: str) -> str:
    """``--config``'s value with a recipe name made the path of the packaged recipe file.

    ``value`` is ``NAME[:arg]``, ``PATH[:arg]``, or a missing ``.../configs/NAME.py[:arg]``;
    an existing file, or anything else, is returned as it is.

    Example:
      >>> resolve("my_config.py:b16,caltech101")
      'my_config.py:b16,caltech101'
    """
    path, sep, arg = value.partition(":")
    if os.path.exists(path):
        return value
    name = os.path.basename(path).removesuffix(".py")
    old_layout = path.endswith(".py") and os.path.basename(os.path.dirname(path)) == "configs"
    if name in NAMES and (path == name or old_layout):
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py") + sep + arg
    return value


def not_found(value: str) -> str | None:
    """One line for a ``--config`` value that names neither a recipe nor an existing file:
    the value, the closest recipe's name (``difflib``, as for a misspelled config key) and
    the recipes; None when it names one.

    Example:
      >>> not_found("vit_fp16") is None
      True
      >>> not_found("my_config.py").split(";")[0]
      '--config my_config.py is neither a recipe nor a file'
    """
    path, sep, arg = resolve(value).partition(":")
    if os.path.exists(path):
        return None
    close = difflib.get_close_matches(os.path.basename(path).removesuffix(".py"), NAMES, n=1)
    guess = f"; did you mean {close[0]}{sep}{arg}?" if close else ";"
    return f"--config {value} is neither a recipe nor a file{guess} jamp ships {', '.join(NAMES)}."
