"""Tests for jamp.data.prepare: tiny archives in each dataset's format, prepared offline
without TensorFlow, then read back through jamp's data pipeline."""

from __future__ import annotations

import functools
import http.server
import io
import os
import socket
import subprocess
import sys
import tarfile
import threading
import zipfile

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from jamp import data
from jamp.data import prepare


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No connection leaves this process; tfds draws no progress bars."""

    def refuse(*args, **kwargs):
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    tfds.disable_progress_bar()


def _add(tar: tarfile.TarFile, name: str, content: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(content)
    tar.addfile(member, io.BytesIO(content))


def _encode(image: np.ndarray, fmt: str = "JPEG", mode: str | None = None) -> bytes:
    out = io.BytesIO()
    pil = Image.fromarray(image)
    (pil.convert(mode) if mode else pil).save(out, format=fmt, quality=95)
    return out.getvalue()


def _decoded(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def _pixels(rng, shape=(12, 10, 3)) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


# --- cifar10 ----------------------------------------------------------------------

CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck"]


def _cifar_archive(path, rng):
    """cifar-10-binary.tar.gz: 5 train batches of 2 records, a test batch of 3."""
    records = {}
    with tarfile.open(path, "w:gz") as tar:
        batches = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
        for b, batch in enumerate(batches):
            n = 3 if batch.startswith("test") else 2
            labels = rng.integers(0, 10, n, dtype=np.uint8)
            images = _pixels(rng, (n, 32, 32, 3))
            chw = images.transpose(0, 3, 1, 2).reshape(n, -1)
            _add(tar, f"cifar-10-batches-bin/{batch}",
                 np.concatenate([labels[:, None], chw], axis=1).tobytes())
            split = "test" if batch.startswith("test") else "train"
            for i in range(n):
                index = i if split == "test" else 2 * b + i
                records[f"{split}_{index:05d}"] = (images[i], int(labels[i]))
        _add(tar, "cifar-10-batches-bin/batches.meta.txt", "\n".join(CIFAR_NAMES).encode())
    return records


def test_prepare_cifar10_command(tmp_path):
    """`python -m jamp.data.prepare cifar10` end to end, then jamp's sources and loaders."""
    data_dir, manual_dir = tmp_path / "tfds", tmp_path / "manual"
    manual_dir.mkdir()
    records = _cifar_archive(manual_dir / "cifar-10-binary.tar.gz", np.random.default_rng(0))
    with pytest.raises(data.DatasetNotFoundError) as e:
        data.get_dataset_info("cifar10", data_dir)
    command = str(e.value).split("run `")[1].split("`")[0]  # The command the error prints.
    assert command == f"python -m jamp.data.prepare cifar10 --data_dir {data_dir}"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, *command.split()[1:], "--manual_dir", str(manual_dir)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "10 train, 3 test examples" in result.stdout
    assert f"--config.data_dir={data_dir}" in result.stdout

    info = data.get_dataset_info("cifar10", data_dir)
    assert info == data.DatasetInfo("cifar10", 10, (32, 32, 3), 10, 3, "train", "test")
    builder = tfds.builder("cifar10", data_dir=data_dir)
    assert builder.info.features["label"].names == CIFAR_NAMES
    for split, n in (("train", 10), ("test", 3)):
        source = data.open_source(info, split, data_dir)
        assert len(source) == n
        for i in range(n):
            image, label = records[source[i]["id"].decode()]
            np.testing.assert_array_equal(source[i]["image"], image)
            assert source[i]["label"] == label
    batch = next(iter(data.train_loader(info, data_dir=data_dir, image_size=32,
                                        global_batch_size=4, seed=0)))
    assert batch["image"].shape == (4, 32, 32, 3) and np.isfinite(batch["image"]).all()
    batches = list(data.eval_batches(info, data_dir=data_dir, image_size=32,
                                     global_batch_size=2))
    labels = sorted(int(x) for b in batches for x in b["label"][b["mask"]])
    assert labels == sorted(label for k, (_, label) in records.items() if k.startswith("test"))
    # Prepared: a rerun only returns the directory.
    os.remove(manual_dir / "cifar-10-binary.tar.gz")
    assert prepare.prepare_dataset("cifar10", data_dir) == str(data_dir / "cifar10" / "3.0.2")


def test_prepare_cifar10_downloads(tmp_path, monkeypatch):
    """Without the archive in the manual_dir, tfds' download manager fetches it (here from
    a local HTTP server) into <data_dir>/downloads."""
    served = tmp_path / "served"
    served.mkdir()
    records = _cifar_archive(served / "cifar-10-binary.tar.gz", np.random.default_rng(3))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.undo()  # Network back, for 127.0.0.1 only.
    monkeypatch.setattr(prepare, "_URLS", {
        **prepare._URLS,
        "cifar10": f"http://127.0.0.1:{server.server_port}/cifar-10-binary.tar.gz"})
    try:
        data_dir = tmp_path / "tfds"
        assert prepare.main(["cifar10", "--data_dir", str(data_dir)]) == 0
    finally:
        server.shutdown()
        server.server_close()
    downloaded = list((data_dir / "downloads").rglob("*cifar-10-binary*.tar.gz"))
    assert [p.read_bytes() for p in downloaded] == [
        (served / "cifar-10-binary.tar.gz").read_bytes()]
    info = data.get_dataset_info("cifar10", data_dir)
    source = data.open_source(info, "test", data_dir)
    image, label = records[source[0]["id"].decode()]
    np.testing.assert_array_equal(source[0]["image"], image)


def test_cifar10_without_network(tmp_path, capsys):
    assert prepare.main(["cifar10", "--data_dir", str(tmp_path)]) == 2
    message = capsys.readouterr().err
    assert "no network" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in message
    assert str(tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz") in message
    assert "Traceback" not in message and not list(tmp_path.iterdir())


def test_an_empty_or_incomplete_version_folder_is_not_a_prepared_dataset(tmp_path, capsys):
    """An empty <data_dir>/cifar10/3.0.2 (a leftover) is prepared in place, not taken for the
    dataset (tfds alone would reuse it, build nothing and the run would fail later); one with
    files but no dataset_info.json is refused with the folder to delete."""
    data_dir, manual_dir = tmp_path / "tfds", tmp_path / "manual"
    manual_dir.mkdir()
    _cifar_archive(manual_dir / "cifar-10-binary.tar.gz", np.random.default_rng(0))
    version_dir = data_dir / "cifar10" / "3.0.2"
    version_dir.mkdir(parents=True)
    with pytest.raises(data.DatasetNotFoundError) as e:
        data.get_dataset_info("cifar10", data_dir)
    assert f"{version_dir} is empty. Delete that folder" in str(e.value)
    assert f"python -m jamp.data.prepare cifar10 --data_dir {data_dir}" in str(e.value)
    assert prepare.main(["cifar10", "--data_dir", str(data_dir),
                         "--manual_dir", str(manual_dir)]) == 0
    assert "10 train, 3 test examples" in capsys.readouterr().out
    assert (version_dir / "dataset_info.json").exists()
    assert data.get_dataset_info("cifar10", data_dir).num_train == 10
    # Files but no dataset_info.json: neither prepared nor overwritten.
    (version_dir / "dataset_info.json").unlink()
    with pytest.raises(prepare.PrepareError, match="no dataset_info.json") as e:
        prepare.prepare_dataset("cifar10", data_dir, manual_dir)
    assert "Delete it (or move it away) and rerun python -m jamp.data.prepare cifar10" in str(
        e.value) and str(version_dir) in str(e.value)
    with pytest.raises(data.DatasetNotFoundError, match="holds no dataset_info.json"):
        data.get_dataset_info("cifar10", data_dir)


# --- caltech101 -------------------------------------------------------------------


def test_prepare_caltech101(tmp_path):
    """caltech-101.zip holding 101_ObjectCategories.tar.gz; 30 images a class train."""
    rng = np.random.default_rng(1)
    classes = {"accordion": 31, "Faces_easy": 33, "BACKGROUND_Google": 30}
    images = {}
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as tar:
        for cls, n in classes.items():
            for i in range(n):
                pixels = _pixels(rng)
                gray = cls == "accordion" and i == 0
                jpeg = _encode(pixels[..., 0] if gray else pixels)
                images[f"{cls}/image_{i:04d}.jpg"] = jpeg
                _add(tar, f"101_ObjectCategories/{cls}/image_{i:04d}.jpg", jpeg)
        _add(tar, "101_ObjectCategories/accordion/notes.txt", b"not an image")
    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    with zipfile.ZipFile(manual_dir / "caltech-101.zip", "w") as zf:
        zf.writestr("caltech-101/101_ObjectCategories.tar.gz", inner.getvalue())
        zf.writestr("caltech-101/Annotations.tar", b"")
    data_dir = tmp_path / "tfds"
    assert prepare.main(["caltech101", "--data_dir", str(data_dir),
                         "--manual_dir", str(manual_dir)]) == 0

    info = data.get_dataset_info("caltech101", data_dir)
    assert info == data.DatasetInfo("caltech101", 102, (None, None, 3), 90, 4, "train", "test")
    names = tfds.builder("caltech101", data_dir=data_dir).info.features["label"].names
    seen = {}
    for split in ("train", "test"):
        source = data.open_source(info, split, data_dir)
        for i in range(len(source)):
            example = source[i]
            fname = example["image/file_name"].decode()
            key = next(k for k in images if k.endswith("/" + fname) and
                       names[example["label"]] == k.split("/")[0].lower())
            seen[key] = split
            assert example["image"].shape == (12, 10, 3)
            np.testing.assert_array_equal(example["image"], _decoded(images[key]))
    assert sorted(seen) == sorted(images)
    for cls in classes:
        assert sum(s == "train" for k, s in seen.items() if k.startswith(cls + "/")) == 30
    batch = next(iter(data.train_loader(info, data_dir=data_dir, image_size=16,
                                        global_batch_size=8, seed=0)))
    assert batch["image"].shape == (8, 16, 16, 3)


# --- imagenet2012 -----------------------------------------------------------------


def test_prepare_imagenet2012(tmp_path):
    """The two ILSVRC2012 tars in the manual_dir, with a CMYK JPEG and a PNG among them."""
    rng = np.random.default_rng(2)
    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    train = {}
    with tarfile.open(manual_dir / "ILSVRC2012_img_train.tar", "w") as outer:
        for synset, kinds in (("n01440764", ["rgb", "cmyk"]), ("n01443537", ["png", "rgb"])):
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as inner:
                for i, kind in enumerate(kinds):
                    pixels = _pixels(rng)
                    encoded = {"rgb": lambda p: _encode(p),
                               "cmyk": lambda p: _encode(p, mode="CMYK"),
                               "png": lambda p: _encode(p, "PNG")}[kind](pixels)
                    fname = f"{synset}_{i}.JPEG"
                    train[fname] = (synset, _decoded(encoded), kind)
                    _add(inner, fname, encoded)
            _add(outer, f"{synset}.tar", buffer.getvalue())
    val = {}
    with tarfile.open(manual_dir / "ILSVRC2012_img_val.tar", "w") as tar:
        for i in (3, 1, 2):  # Labels follow the sorted names, not the tar order.
            jpeg = _encode(_pixels(rng))
            val[f"ILSVRC2012_val_{i:08d}.JPEG"] = _decoded(jpeg)
            _add(tar, f"ILSVRC2012_val_{i:08d}.JPEG", jpeg)
    data_dir = tmp_path / "tfds"
    assert prepare.main(["imagenet2012", "--data_dir", str(data_dir),
                         "--manual_dir", str(manual_dir)]) == 0

    info = data.get_dataset_info("imagenet2012", data_dir)
    assert info == data.DatasetInfo("imagenet2012", 1000, (None, None, 3), 4, 3, "train",
                                    "validation")
    names = tfds.builder("imagenet2012", data_dir=data_dir).info.features["label"].names
    source = data.open_source(info, "train", data_dir)
    assert sorted(source[i]["file_name"].decode() for i in range(4)) == sorted(train)
    for i in range(4):
        synset, pixels, kind = train[source[i]["file_name"].decode()]
        assert names[source[i]["label"]] == synset and source[i]["image"].shape == (12, 10, 3)
        if kind in ("cmyk", "png"):  # Re-encoded as RGB JPEG: close, not equal.
            np.testing.assert_allclose(source[i]["image"], pixels, atol=4)
        else:
            np.testing.assert_array_equal(source[i]["image"], pixels)
    labels_file = tfds.core.tfds_path("datasets/imagenet2012/validation_labels.txt")
    expected = labels_file.read_text().splitlines()[:3]
    source = data.open_source(info, "validation", data_dir)
    by_name = {source[i]["file_name"].decode(): source[i] for i in range(3)}
    for k, fname in enumerate(sorted(val)):
        assert names[by_name[fname]["label"]] == expected[k]
        np.testing.assert_array_equal(by_name[fname]["image"], val[fname])
    batches = list(data.eval_batches(info, data_dir=data_dir, image_size=8,
                                     global_batch_size=2))
    assert [int(b["mask"].sum()) for b in batches] == [2, 1]


def test_imagenet2012_without_archives(tmp_path, capsys):
    data_dir, manual_dir = tmp_path / "tfds", tmp_path / "manual"
    manual_dir.mkdir()
    (manual_dir / "ILSVRC2012_img_val.tar").write_bytes(b"")
    assert prepare.main(["imagenet2012", "--data_dir", str(data_dir),
                         "--manual_dir", str(manual_dir)]) == 2
    message = capsys.readouterr().err
    assert f"Missing {manual_dir / 'ILSVRC2012_img_train.tar'}." in message
    assert "https://image-net.org/download-images" in message and "log in" in message
    assert str(manual_dir / "ILSVRC2012_img_val.tar") in message
    assert (f"python -m jamp.data.prepare imagenet2012 --data_dir {data_dir} "
            f"--manual_dir {manual_dir}") in message
    assert "Traceback" not in message and not data_dir.exists()
    with pytest.raises(data.DatasetNotFoundError, match="image-net.org") as e:
        data.get_dataset_info("imagenet2012", data_dir)
    assert f"jamp.data.prepare imagenet2012 --data_dir {data_dir} --manual_dir DIR" in str(e.value)


def test_other_datasets_are_refused():
    with pytest.raises(prepare.PrepareError, match="tfds build mnist"):
        prepare.prepare_dataset("mnist", "/nonexistent")
