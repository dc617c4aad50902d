"""Finding prepared TFDS datasets and opening them as random-access data sources.

Nothing here downloads or waits on the network: a dataset is either prepared in
the local data_dir in a random-access format (array_record) or the call raises
`DatasetNotFoundError` saying where it looked and how to prepare it. The name
"digits" is the embedded offline dataset (`jamp.data.digits`), built on first use.

Example:
  >>> info = get_dataset_info("digits", "/tmp/tfds")
  >>> info.num_classes, info.image_shape, info.num_train, info.num_test
  (10, (8, 8, 1), 1437, 360)
  >>> source = open_source(info, info.test_split, "/tmp/tfds")
  >>> len(source)
  360
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from jamp.data import digits

#: TFDS datasets of digits or characters, where a mirror image is another symbol.
NO_FLIP_DATASETS = frozenset({"jamp_digits", "mnist", "emnist", "kmnist", "svhn_cropped"})


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the trainer needs to know about a prepared image-classification dataset.

    Attributes:
      name: canonical TFDS name (``"jamp_digits"`` for the "digits" alias).
      num_classes: classes of the "label" ClassLabel feature.
      image_shape: native (H, W, C) of "image"; H and W are None when they vary.
      num_train: examples in `train_split`.
      num_test: examples in `test_split`.
      train_split: split trained on ("train").
      test_split: split evaluated on ("test", else "validation").

    Example:
      >>> DatasetInfo("jamp_digits", 10, (8, 8, 1), 1437, 360, "train", "test").num_classes
      10
    """

    name: str
    num_classes: int
    image_shape: tuple[int, int, int]
    num_train: int
    num_test: int
    train_split: str
    test_split: str


class DatasetNotFoundError(FileNotFoundError):
    """A dataset that is unknown, or not prepared (as array_record) in the data_dir.

    Example:
      >>> try:
      ...     get_dataset_info("cifar10", "/tmp/empty")
      ... except DatasetNotFoundError as e:
      ...     print("python -m jamp.data.prepare cifar10" in str(e))  # names the fix
      True
    """


def resolve_data_dir(name: str, data_dir: str | os.PathLike | None) -> str:
    """Returns the data_dir to use for `name` when `data_dir` is None.

    "digits": ``$JAMP_DATA_DIR`` or ``~/.cache/jamp/tensorflow_datasets``; other
    names: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``.

    Example:
      >>> resolve_data_dir("cifar10", "/data/tfds")
      '/data/tfds'
    """
    if data_dir:
        return os.fspath(data_dir)
    if name in digits.ALIASES:
        return digits.default_data_dir()
    return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


def canonical_name(name: str) -> str:
    """Maps the "digits" alias to "jamp_digits"; other names are returned unchanged.

    Example:
      >>> canonical_name("digits"), canonical_name("cifar10")
      ('jamp_digits', 'cifar10')
    """
    return digits.NAME if name in digits.ALIASES else name


def get_dataset_info(name: str, data_dir: str | os.PathLike | None = None) -> DatasetInfo:
    """Describes a prepared TFDS image-classification dataset (preparing "digits").

    Args:
      name: "digits" (embedded, prepared on first use) or a TFDS name, optionally
        with config/version ("cifar10", "mnist:3.0.1").
      data_dir: TFDS data_dir; None picks the default (see `resolve_data_dir`).

    Returns:
      The dataset's `DatasetInfo`.

    Raises:
      DatasetNotFoundError: unknown name, not prepared in `data_dir`, or prepared
        only in a format without random access (tfrecord).
      ValueError: no "image"/"label" features, or no train / test split.

    Example:
      >>> get_dataset_info("digits", "/tmp/tfds").num_train
      1437
    """
    data_dir = resolve_data_dir(name, data_dir)
    builder = _prepared_builder(name, data_dir)
    features = builder.info.features
    if not {"image", "label"} <= set(features.keys()):
        raise ValueError(
            f"Dataset {name!r} has features {sorted(features.keys())}; jamp needs an "
            '"image" and a ClassLabel "label" feature.'
        )
    label = features["label"]
    if not isinstance(label, tfds.features.ClassLabel):
        raise ValueError(f'Dataset {name!r}: "label" is {label!r}, not a ClassLabel.')
    splits = list(builder.info.splits)
    if "train" not in splits:
        raise ValueError(f'Dataset {name!r} has no "train" split (splits: {list(splits)}).')
    test_split = next((s for s in ("test", "validation") if s in splits), None)
    if test_split is None:
        raise ValueError(
            f'Dataset {name!r} has neither a "test" nor a "validation" split '
            f"(splits: {list(splits)})."
        )
    shape = tuple(features["image"].shape)
    if len(shape) == 2:
        shape = (*shape, 1)
    return DatasetInfo(
        name=canonical_name(name),
        num_classes=int(label.num_classes),
        image_shape=shape,
        num_train=int(builder.info.splits["train"].num_examples),
        num_test=int(builder.info.splits[test_split].num_examples),
        train_split="train",
        test_split=test_split,
    )


def open_source(
    info: DatasetInfo, split: str, data_dir: str | os.PathLike | None = None
) -> Sequence[dict[str, Any]]:
    """Opens one split as a random-access source (``len`` and ``[i]``) for grain.

    Example:
      >>> info = get_dataset_info("digits", "/tmp/tfds")
      >>> open_source(info, "train", "/tmp/tfds")[0]["image"].shape
      (8, 8, 1)
    """
    return tfds.data_source(
        info.name, split=split, data_dir=resolve_data_dir(info.name, data_dir), download=False
    )


def channel_stats(
    info: DatasetInfo, data_dir: str | None = None, max_examples: int = 512
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel pixel mean and std of the train split, from evenly spaced examples.

    Used to normalise images to roughly zero mean and unit variance. Cached.

    Example:
      >>> mean, std = channel_stats(get_dataset_info("digits", "/tmp/tfds"), "/tmp/tfds")
      >>> len(mean), len(std)
      (1, 1)
    """
    return _channel_stats(info, data_dir, max_examples)


@functools.lru_cache(maxsize=32)
def _channel_stats(
    info: DatasetInfo, data_dir: str | None, max_examples: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    source = open_source(info, info.train_split, data_dir)
    indices = np.linspace(0, len(source) - 1, num=min(max_examples, len(source))).astype(int)
    total = np.zeros(info.image_shape[-1])
    total_sq = np.zeros_like(total)
    count = 0
    for i in np.unique(indices):
        image = np.asarray(source[int(i)]["image"], np.float64)
        image = image.reshape(-1, image.shape[-1] if image.ndim == 3 else 1)
        total += image.sum(axis=0)
        total_sq += np.square(image).sum(axis=0)
        count += image.shape[0]
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - np.square(mean), 0.0))
    return tuple(float(m) for m in mean), tuple(float(max(s, 1e-3)) for s in std)


def _prepared_builder(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
    """Returns the builder of a dataset prepared in `data_dir`, or raises why not."""
    if name in digits.ALIASES:
        digits.prepare_digits(data_dir)
    try:
        builder = tfds.builder(canonical_name(name), data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise DatasetNotFoundError(_unknown_message(name, data_dir)) from None
    version_dir = epath.Path(builder.data_dir)
    if not (version_dir / "dataset_info.json").exists():
        raise DatasetNotFoundError(_not_prepared_message(name, data_dir, version_dir))
    formats = builder.info.available_file_formats()
    if not formats & set(tfds.core.FileFormat.with_random_access()):
        raise DatasetNotFoundError(_no_random_access_message(name, version_dir, formats))
    return builder


def _prepare_hint(name: str, data_dir: str) -> str:
    from jamp.data import prepare  # prepare imports this module.

    base = name.split(":")[0].split("/")[0]
    manual = " --manual_dir DIR" if base == "imagenet2012" else ""
    tfds_build = f"tfds build {name} --data_dir {data_dir}{manual} --file_format=array_record"
    if base in prepare.DATASETS:
        how = (
            f"To prepare it, run `{prepare.prepare_command(base, data_dir)}`"
            + (
                f" with DIR holding {' and '.join(prepare.IMAGENET_ARCHIVES)}, downloaded by "
                "hand from https://image-net.org/download-images (login required)"
                if base == "imagenet2012"
                else " (it downloads the archive)"
            )
            + f"; where TensorFlow is installed, `{tfds_build}` does the same."
        )
    else:
        how = (
            f"To prepare it, run `{tfds_build}` (the tfds command needs TensorFlow: "
            "`pip install tensorflow-cpu`), or on another machine with a --data_dir of your "
            f"choice, then copy its {base}/ folder into {data_dir}."
        )
    return (
        f"{how} Or point jamp at an existing TFDS data_dir with --config.data_dir (or "
        "$TFDS_DATA_DIR). jamp never downloads at run time."
    )


def _unknown_message(name: str, data_dir: str) -> str:
    base = name.split(":")[0].split("/")[0]
    known = tfds.list_builders(with_community_datasets=False)
    close = difflib.get_close_matches(base, [*known, "digits"], n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"Unknown dataset {name!r}: it is not a registered TFDS dataset and no prepared "
        f"copy was found in {os.path.join(data_dir, base)}.{hint} Use 'digits' for the "
        "embedded offline dataset, or the name of a TFDS image-classification dataset "
        f"prepared in the data_dir. {_prepare_hint(name, data_dir)}"
    )


def _not_prepared_message(name: str, data_dir: str, version_dir: epath.Path) -> str:
    if version_dir.exists():  # a folder without dataset_info.json: not a prepared dataset
        state = "is empty" if not any(version_dir.iterdir()) else (
            "holds no dataset_info.json (an interrupted preparation or copy)")
        if name in digits.ALIASES:
            fix = "Delete that folder and rerun: jamp builds the embedded digits on first use."
        else:
            fix = ("Delete that folder, then prepare the dataset again. "
                   + _prepare_hint(name, data_dir))
        return f"Dataset {name!r} is not prepared in {data_dir}: {version_dir} {state}. {fix}"
    dataset_dir = version_dir.parent
    found = sorted(p.name for p in dataset_dir.glob("*") if p.is_dir())
    other = f" (found only: {', '.join(found)})" if found else ""
    return (
        f"Dataset {name!r} is not prepared in {data_dir}: looked for {version_dir}{other}. "
        f"{_prepare_hint(name, data_dir)}"
    )


def _no_random_access_message(name: str, version_dir: epath.Path, formats: set[Any]) -> str:
    from jamp.data import prepare  # prepare imports this module.

    kinds = ", ".join(sorted(f.value for f in formats)) or "unknown"
    base = name.split(":")[0].split("/")[0]
    fresh = (
        f"prepare a fresh copy in another data_dir with "
        f"`{prepare.prepare_command(base, 'NEW_DIR')}`"
        if base in prepare.DATASETS
        else f"rebuild it with `tfds build {name} --file_format=array_record`"
    )
    return (
        f"Dataset {name!r} in {version_dir} is prepared as {kinds}, but jamp reads it with "
        "grain, which needs random access: it must be array_record. Either "
        f"{fresh}, or convert it in place where TensorFlow is installed (`pip install "
        f"tensorflow-cpu`) with `tfds convert_format --dataset_version_dir={version_dir} "
        "--out_file_format=array_record`."
    )
