"""The embedded offline dataset: UCI handwritten digits as a local TFDS dataset.

scikit-learn ships the 1,797 8x8 digit images of the UCI ML repository, so the
trainer always has a real image-classification dataset without any network.
`JampDigits` writes them as an ``array_record`` TFDS dataset ("jamp_digits")
that `tfds.data_source` and grain read like any other prepared dataset.

Example:
  >>> path = prepare_digits("/tmp/tfds")           # builds once, quietly
  >>> import tensorflow_datasets as tfds
  >>> ds = tfds.data_source("jamp_digits", split="train", data_dir="/tmp/tfds")
  >>> len(ds), ds[0]["image"].shape
  (1437, (8, 8, 1))
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds
from absl import logging as absl_logging
from etils import epath

NAME = "jamp_digits"
ALIASES = ("digits", NAME)
_SEED = 0
_TEST_FRACTION = 0.2


def default_data_dir() -> str:
    """Returns the data_dir of the embedded dataset.

    ``$JAMP_DATA_DIR`` if set, else ``~/.cache/jamp/tensorflow_datasets``.

    Example:
      >>> os.environ["JAMP_DATA_DIR"] = "/tmp/tfds"
      >>> default_data_dir()
      '/tmp/tfds'
    """
    return os.environ.get("JAMP_DATA_DIR") or os.path.expanduser(
        "~/.cache/jamp/tensorflow_datasets"
    )


def split_indices() -> dict[str, np.ndarray]:
    """Returns the fixed stratified 80/20 split of sklearn's digits, as indices.

    Example:
      >>> {k: len(v) for k, v in split_indices().items()}
      {'train': 1437, 'test': 360}
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    labels = load_digits().target
    train, test = train_test_split(
        np.arange(len(labels)), test_size=_TEST_FRACTION, random_state=_SEED, stratify=labels
    )
    return {"train": np.sort(train), "test": np.sort(test)}


class JampDigits(tfds.core.GeneratorBasedBuilder):
    """TFDS builder for scikit-learn's 8x8 handwritten digits (values scaled to 0..255).

    Example:
      >>> builder = JampDigits(data_dir="/tmp/tfds", file_format="array_record")
      >>> builder.download_and_prepare()
      >>> builder.info.splits["test"].num_examples
      360
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "UCI digits from scikit-learn, stratified 80/20, seed 0."}

    # tfds derives `code_path` through `importlib_resources`, which it only
    # declares as a dependency for Python < 3.9; give the path directly.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:  # noqa: D102 (tfds hook)
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "UCI ML handwritten digits (1,797 8x8 grayscale images, 10 classes), "
                "as shipped by scikit-learn; pixel values 0..16 scaled to 0..255."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        return {
            split: self._generate_examples(indices) for split, indices in split_indices().items()
        }

    def _generate_examples(self, indices: np.ndarray):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
        for i in indices:
            yield int(i), {"image": images[i], "label": int(digits.target[i])}


def prepare_digits(data_dir: str | os.PathLike | None = None) -> str:
    """Builds the "jamp_digits" dataset in `data_dir` once and returns its directory.

    Cheap when already prepared. Safe when several processes race: each builds
    into its own tfds "incomplete" directory, the first rename wins and the
    others find the finished dataset. No progress bars, no network. An empty
    version folder (no ``dataset_info.json``) is not a prepared dataset: it is
    removed and the dataset built; a folder with other files but no
    ``dataset_info.json`` is left alone (tfds would reuse it; `jamp.data.get_dataset_info`
    then says to delete it).

    Args:
      data_dir: TFDS data_dir; None means `default_data_dir()`.

    Returns:
      The prepared dataset's directory, ``<data_dir>/jamp_digits/1.0.0``.

    Example:
      >>> prepare_digits("/tmp/tfds")
      '/tmp/tfds/jamp_digits/1.0.0'
    """
    data_dir = os.fspath(data_dir or default_data_dir())
    path = epath.Path(data_dir) / NAME / str(JampDigits.VERSION)
    if (path / "dataset_info.json").exists():
        return os.fspath(path)
    if path.exists():  # tfds would take the folder for the dataset and build nothing
        if any(path.iterdir()):
            return os.fspath(path)  # incomplete: get_dataset_info names it
        with contextlib.suppress(OSError):  # another process may remove it first
            path.rmdir()
    tfds.disable_progress_bar()
    with _quiet():
        try:
            JampDigits(data_dir=data_dir, file_format="array_record").download_and_prepare()
        except (OSError, ValueError):
            # Another process finished first (our rename onto its copy failed, or
            # tfds refused to overwrite it).
            if not (path / "dataset_info.json").exists():
                raise
    return os.fspath(path)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silences tfds' stdout banner and absl info/warnings while building."""
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        absl_logging.set_verbosity(verbosity)
