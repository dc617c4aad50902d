"""Prepares cifar10, caltech101 and imagenet2012 for jamp, without TensorFlow.

``python -m jamp.data.prepare NAME [--data_dir DIR] [--manual_dir DIR]`` writes the TFDS
dataset NAME as array_record into the data_dir, where `jamp.train` (``--config.data_dir``)
and `jamp.data.get_dataset_info` find it. TFDS's own builders for these datasets (and the
``tfds build`` command) need TensorFlow for file access, archive extraction and image
encoding; here Python's tarfile / zipfile and Pillow read the same archives, and the TFDS
builder (same name, version, features and splits) only writes the records.

Archives: an archive already in the manual_dir (default ``<data_dir>/downloads/manual``)
is used as it is; cifar10 and caltech101 are otherwise downloaded once (checksums checked)
into ``<data_dir>/downloads``. imagenet2012 cannot be downloaded automatically: its two
archives must be placed in the manual_dir by hand (see `IMAGENET_ARCHIVES`).

Example:
  >>> prepare_command("cifar10", "/data/tfds")
  'python -m jamp.data.prepare cifar10 --data_dir /data/tfds'
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import io
import os
import socket
import sys
import tarfile
import urllib.parse
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from PIL import Image

from jamp.data.sources import get_dataset_info, resolve_data_dir

#: Datasets this module prepares.
DATASETS = ("cifar10", "caltech101", "imagenet2012")

#: The files to place in the manual_dir for imagenet2012 (from https://image-net.org).
IMAGENET_ARCHIVES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")

_URLS = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
    "caltech101": "https://data.caltech.edu/records/mzrjq-6wc02/files/caltech-101.zip?download=1",
}
_FILENAMES = {"cifar10": "cifar-10-binary.tar.gz", "caltech101": "caltech-101.zip"}
_CALTECH_TRAIN_PER_CLASS = 30  # As TFDS: 30 images a class train, the rest test.
_CALTECH_SEED = 1234

Examples = Iterator[tuple[Any, dict[str, Any]]]


class PrepareError(RuntimeError):
    """A dataset that cannot be prepared as asked (missing archive, no network, ...).

    Example:
      >>> try:
      ...     prepare_dataset("imagenet2012", "/tmp/tfds", manual_dir="/tmp/empty")
      ... except PrepareError as e:
      ...     print("ILSVRC2012_img_train.tar" in str(e), "image-net.org" in str(e))
      True True
    """


def prepare_command(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """Returns the shell command that prepares `name` in `data_dir` (None: the default).

    Example:
      >>> prepare_command("imagenet2012", "/data/tfds")
      'python -m jamp.data.prepare imagenet2012 --data_dir /data/tfds --manual_dir DIR'
    """
    command = f"python -m jamp.data.prepare {name}"
    if data_dir is not None:
        command += f" --data_dir {os.fspath(data_dir)}"
    if name == "imagenet2012":
        command += " --manual_dir DIR"
    return command


def imagenet_instructions(manual_dir: str | os.PathLike, data_dir: str | os.PathLike) -> str:
    """Says how to download ImageNet's archives by hand and where to put them.

    Example:
      >>> print(imagenet_instructions("/data/manual", "/data/tfds").splitlines()[0])
      imagenet2012 cannot be downloaded automatically (its terms require each user to \
sign up):
    """
    train, val = (os.path.join(os.fspath(manual_dir), f) for f in IMAGENET_ARCHIVES)
    return (
        "imagenet2012 cannot be downloaded automatically (its terms require each user to "
        "sign up):\n"
        "  1. Create an account and log in at https://image-net.org/download-images, accept "
        "the terms, open ILSVRC2012 and download\n"
        f"     'Training images (Task 1 & 2)', {IMAGENET_ARCHIVES[0]} (138 GB), and\n"
        f"     'Validation images (all tasks)', {IMAGENET_ARCHIVES[1]} (6.3 GB).\n"
        f"  2. Put them, as they are (no unpacking), at\n     {train}\n     {val}\n"
        "  3. Run "
        f"python -m jamp.data.prepare imagenet2012 --data_dir {os.fspath(data_dir)} "
        f"--manual_dir {os.fspath(manual_dir)}\n"
        "     (a few hours; about 150 GB more disk for the array_record copy)."
    )


def prepare_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    manual_dir: str | os.PathLike | None = None,
) -> str:
    """Prepares `name` as array_record in `data_dir` and returns its version directory.

    Does nothing when the dataset is already prepared there (its version directory holds
    ``dataset_info.json``). An empty version directory is prepared in place; one with
    other files but no ``dataset_info.json`` is refused (delete it first).

    Args:
      name: one of `DATASETS`.
      data_dir: TFDS data_dir; None means ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``.
      manual_dir: where archives downloaded by hand are; None means
        ``<data_dir>/downloads/manual``.

    Returns:
      The prepared dataset's directory, e.g. ``<data_dir>/cifar10/3.0.2``.

    Raises:
      PrepareError: unknown name, imagenet2012 archives missing, no network for a
        download, an archive in an unexpected layout, a copy in another file format, or
        an incomplete copy (no ``dataset_info.json``) in the version directory.

    Example:
      >>> try:
      ...     prepare_dataset("mnist", "/tmp/tfds")
      ... except PrepareError as e:
      ...     print(e)
      jamp.data.prepare prepares cifar10, caltech101, imagenet2012; for 'mnist' run \
`tfds build mnist --file_format=array_record` where TensorFlow is installed.
    """
    if name not in DATASETS:
        raise PrepareError(
            f"jamp.data.prepare prepares {', '.join(DATASETS)}; for {name!r} run "
            f"`tfds build {name} --file_format=array_record` where TensorFlow is installed."
        )
    data_dir = resolve_data_dir(name, data_dir)
    manual_dir = os.fspath(manual_dir or os.path.join(data_dir, "downloads", "manual"))
    with _tfds_code_path():
        builder = tfds.builder(name, data_dir=data_dir)
    version_dir = epath.Path(builder.data_dir)
    if (version_dir / "dataset_info.json").exists():
        formats = builder.info.available_file_formats()
        if tfds.core.FileFormat.ARRAY_RECORD not in formats:
            raise PrepareError(
                f"{version_dir} already holds {name} as "
                f"{', '.join(sorted(f.value for f in formats))}, not array_record: prepare it "
                f"in another data_dir ({prepare_command(name, 'NEW_DIR')}) or move that "
                "folder away."
            )
        return os.fspath(version_dir)
    if version_dir.exists():  # no dataset_info.json: tfds would reuse it and build nothing
        if any(version_dir.iterdir()):
            raise PrepareError(
                f"{version_dir} exists but holds no prepared {name} (no dataset_info.json: "
                "an interrupted preparation or copy). Delete it (or move it away) and rerun "
                f"{prepare_command(name, data_dir)}."
            )
        version_dir.rmdir()  # an empty leftover: prepared in its place below
    with _tfds_code_path():
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    if name == "imagenet2012":
        paths = [os.path.join(manual_dir, f) for f in IMAGENET_ARCHIVES]
        if not all(os.path.isfile(p) for p in paths):
            missing = ", ".join(p for p in paths if not os.path.isfile(p))
            raise PrepareError(f"Missing {missing}.\n{imagenet_instructions(manual_dir, data_dir)}")
        splits = _imagenet_splits(*paths)
    else:
        archive = _archive(name, builder, data_dir, manual_dir)
        splits = (_cifar10_splits if name == "cifar10" else _caltech101_splits)(builder, archive)
    # The TFDS builder keeps its name, version, features and file layout; its splits
    # come from the readers here instead of its TensorFlow-based `_split_generators`.
    builder._split_generators = lambda dl_manager: splits
    with _tfds_code_path():
        builder.download_and_prepare()
    return os.fspath(version_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m jamp.data.prepare``: prepares a dataset, prints where; exit 2 on errors.

    Example:
      >>> main(["imagenet2012", "--data_dir", "/tmp/tfds", "--manual_dir", "/tmp/empty"])
      2
    """
    parser = argparse.ArgumentParser(
        prog="python -m jamp.data.prepare",
        description=(
            "Prepare a TFDS dataset as array_record for jamp.train, without TensorFlow. "
            "cifar10 (162 MB) and caltech101 (131 MB) are downloaded (or taken from "
            "--manual_dir). imagenet2012 must be downloaded by hand from "
            "https://image-net.org/download-images (login required): put "
            f"{' and '.join(IMAGENET_ARCHIVES)} in --manual_dir."
        ),
    )
    parser.add_argument("name", choices=DATASETS, help="dataset to prepare")
    parser.add_argument(
        "--data_dir",
        help="TFDS data_dir to write to, passed to jamp.train as --config.data_dir "
        "(default: $TFDS_DATA_DIR or ~/tensorflow_datasets)",
    )
    parser.add_argument(
        "--manual_dir",
        help="directory with archives downloaded by hand (default: DATA_DIR/downloads/manual)",
    )
    args = parser.parse_args(argv)
    try:
        version_dir = prepare_dataset(args.name, args.data_dir, args.manual_dir)
    except PrepareError as e:
        print(f"jamp.data.prepare: error: {e}", file=sys.stderr)
        return 2
    data_dir = resolve_data_dir(args.name, args.data_dir)
    info = get_dataset_info(args.name, data_dir)
    model = "s16" if args.name == "cifar10" else "b16"
    print(
        f"{args.name} is prepared in {version_dir}: {info.num_train} train, "
        f"{info.num_test} {info.test_split} examples. Train on it with\n"
        f"  jamp.train --config configs/vit_fp16.py:{model},{args.name} "
        f"--config.data_dir={data_dir}"
    )
    return 0


# --- Archives ---------------------------------------------------------------------


def _archive(name: str, builder: Any, data_dir: str, manual_dir: str) -> str:
    """The archive of `name`: from the manual_dir if there, else downloaded (checked)."""
    filename, url = _FILENAMES[name], _URLS[name]
    manual = os.path.join(manual_dir, filename)
    if os.path.isfile(manual):
        return manual
    parsed = urllib.parse.urlparse(url)
    host = parsed.hostname
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        socket.create_connection((host, port), timeout=10).close()
    except OSError as e:
        raise PrepareError(
            f"Cannot download {name}: no network ({host}: {e}). On a machine with network "
            f"access download {url} and put it at {manual} (or pass --manual_dir), then rerun "
            f"{prepare_command(name, data_dir)}."
        ) from None
    try:
        with _tfds_code_path():
            url_infos = type(builder).url_infos
        manager = tfds.download.DownloadManager(
            download_dir=os.path.join(data_dir, "downloads"), url_infos=url_infos,
            dataset_name=name,
        )
        return os.fspath(manager.download(url))
    except Exception as e:  # requests' and tfds' download and checksum errors
        raise PrepareError(
            f"Downloading {url} failed ({type(e).__name__}: {e}). Download it by hand and "
            f"put it at {manual}, then rerun {prepare_command(name, data_dir)}."
        ) from None


def _cifar10_splits(builder: Any, archive: str) -> dict[str, Examples]:
    """cifar-10-binary.tar.gz: records of 1 label byte + 3072 CHW pixel bytes."""
    prefix = "cifar-10-batches-bin/"
    files = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin", "batches.meta.txt"]
    with tarfile.open(archive, "r:gz") as tar:
        try:
            content = {f: tar.extractfile(prefix + f).read() for f in files}
        except KeyError as e:
            raise PrepareError(f"{archive} is not CIFAR-10's binary archive: no {e}.") from None
    names = [n for n in content["batches.meta.txt"].decode().split("\n") if n]
    builder.info.features["label"].names = names

    def examples(split: str, batches: list[str]) -> Examples:
        index = 0
        for batch in batches:
            records = np.frombuffer(content[batch], np.uint8).reshape(-1, 3073)
            images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            for label, image in zip(records[:, 0], images, strict=True):
                record = {"id": f"{split}_{index:05d}", "image": Image.fromarray(image)}
                yield index, {**record, "label": int(label)}
                index += 1

    return {"train": examples("train", files[:5]), "test": examples("test", files[5:6])}


def _caltech101_splits(builder: Any, archive: str) -> dict[str, Examples]:
    """caltech-101.zip holding 101_ObjectCategories.tar.gz of <class>/<image>.jpg."""
    del builder  # The label names ship with TFDS.
    inner = "caltech-101/101_ObjectCategories.tar.gz"

    def images() -> Iterator[tuple[str, str, bytes]]:
        with zipfile.ZipFile(archive) as zf:
            try:
                fileobj = zf.open(inner)
            except KeyError:
                raise PrepareError(f"{archive} is not Caltech-101's zip: no {inner}.") from None
            with fileobj, tarfile.open(fileobj=fileobj, mode="r|gz") as tar:
                for member in tar:
                    parts = member.name.split("/")
                    if member.isfile() and len(parts) == 3 and parts[2].endswith(".jpg"):
                        yield parts[1], parts[2], tar.extractfile(member).read()

    by_class: dict[str, list[str]] = {}
    for cls, fname, _ in images():
        by_class.setdefault(cls, []).append(fname)
    rng = np.random.RandomState(_CALTECH_SEED)
    train = set()
    for cls in sorted(by_class):
        fnames = sorted(by_class[cls])
        if len(fnames) < _CALTECH_TRAIN_PER_CLASS:
            raise PrepareError(
                f"{archive}: class {cls} has {len(fnames)} images, fewer than the "
                f"{_CALTECH_TRAIN_PER_CLASS} of the train split."
            )
        chosen = rng.choice(fnames, _CALTECH_TRAIN_PER_CLASS, replace=False)
        train.update(f"{cls}/{f}" for f in chosen)

    def examples(in_train: bool) -> Examples:
        for cls, fname, data in images():
            key = f"{cls}/{fname}"
            if (key in train) == in_train:
                image = _jpeg_rgb_or_gray(data)
                yield key, {"image": image, "label": cls.lower(), "image/file_name": fname}

    return {"train": examples(True), "test": examples(False)}


def _imagenet_splits(train_tar: str, val_tar: str) -> dict[str, Examples]:
    """ILSVRC2012_img_train.tar (one <synset>.tar of JPEGs a class) and _val.tar (JPEGs)."""

    def train() -> Examples:
        with tarfile.open(train_tar, "r|") as outer:
            for member in outer:
                if not (member.isfile() and member.name.endswith(".tar")):
                    continue
                synset = os.path.basename(member.name)[:-4]
                data = io.BytesIO(outer.extractfile(member).read())
                with tarfile.open(fileobj=data, mode="r:") as inner:
                    for image in inner:
                        if image.isfile():
                            fname = os.path.basename(image.name)
                            jpeg = _jpeg_rgb_or_gray(inner.extractfile(image).read())
                            yield fname, {"file_name": fname, "image": jpeg, "label": synset}

    def validation() -> Examples:
        # TFDS's labels are in the order of the sorted image names.
        path = tfds.core.tfds_path("datasets/imagenet2012/validation_labels.txt")
        labels = path.read_text().strip().splitlines()
        with tarfile.open(val_tar, "r:") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
            for member, label in zip(members, labels, strict=False):
                fname = os.path.basename(member.name)
                jpeg = _jpeg_rgb_or_gray(tar.extractfile(member).read())
                yield fname, {"file_name": fname, "image": jpeg, "label": label}

    return {"train": train(), "validation": validation()}


def _jpeg_rgb_or_gray(data: bytes) -> bytes:
    """JPEG bytes as they are, or re-encoded as RGB JPEG (CMYK JPEGs, PNGs named .jpg)."""
    with Image.open(io.BytesIO(data)) as image:
        if image.format == "JPEG" and image.mode in ("RGB", "L"):
            return data
        out = io.BytesIO()
        image.convert("RGB").save(out, format="JPEG", quality=100, subsampling=0)
        return out.getvalue()


@contextlib.contextmanager
def _tfds_code_path() -> Iterator[None]:
    """tfds locates builders' code with `importlib_resources`, which it declares only for
    Python < 3.9; the standard library's `importlib.resources` serves the same."""
    module = tfds.core.dataset_builder
    missing = object()
    saved = module.__dict__.get("importlib_resources", missing)
    module.importlib_resources = importlib.resources
    try:
        yield
    finally:
        if saved is missing:
            del module.importlib_resources
        else:
            module.importlib_resources = saved

if __name__ == "__main__":
    sys.exit(main())
