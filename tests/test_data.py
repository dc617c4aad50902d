"""Tests for jamp.data: the embedded digits builder, grain pipelines, TFDS look-up errors."""

from __future__ import annotations

import collections
import importlib.resources
import importlib.resources.abc
import json
import os
import shutil

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds
from absl import flags
from sklearn.datasets import load_digits

from jamp import data
from jamp.data import digits, transforms


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    data.prepare_digits(data_dir)
    return str(data_dir)


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory):
    """A tiny "mnist" prepared by the real TFDS builder (PNG-encoded Image feature)."""
    from PIL import Image

    data_dir = str(tmp_path_factory.mktemp("tfds_mnist"))

    def examples(n, seed):
        rng = np.random.default_rng(seed)
        for i in range(n):
            image = rng.integers(0, 256, (28, 28), dtype=np.uint8)
            yield i, {"image": Image.fromarray(image), "label": i % 10}

    builder = tfds.builder("mnist", data_dir=data_dir, file_format="array_record")
    builder._split_generators = lambda dl_manager: {
        "train": examples(40, 0),
        "test": examples(13, 1),
    }
    with pytest.MonkeyPatch.context() as mp:
        # tfds only declares importlib_resources for Python < 3.9 but uses it to
        # locate the code of builders inside packages.
        mp.setattr(
            tfds.core.dataset_builder, "importlib_resources", importlib.resources, raising=False
        )
        tfds.disable_progress_bar()
        builder.download_and_prepare()
    return data_dir


@pytest.fixture
def absl_flags_parsed():
    """grain's worker processes read its absl flags: parse them, as ``absl.app.run`` would."""
    parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.mark_as_parsed()
    yield
    if not parsed:
        flags.FLAGS.unparse_flags()


MOCK_EXAMPLES = 21


@pytest.fixture(scope="module")
def tfds_mock_metadata(tmp_path_factory):
    """Metadata of "mnist" and "cifar10" prepared as array_record, 21 examples a split.

    ``tfds.testing.mock_data(policy=USE_FILES, data_dir=...)`` reads it (split names and
    sizes, file format) in place of any data_dir, and serves random examples.
    """
    metadata_dir = str(tmp_path_factory.mktemp("tfds_metadata"))
    for name in ("mnist", "cifar10"):
        builder = tfds.builder(name, data_dir=metadata_dir, file_format="array_record")
        template = tfds.core.ShardedFileTemplate(
            data_dir=builder.data_dir, dataset_name=builder.name, filetype_suffix="array_record")
        builder.info.set_splits(tfds.core.SplitDict([
            tfds.core.SplitInfo(name=split, shard_lengths=[MOCK_EXAMPLES], num_bytes=0,
                                filename_template=template.replace(split=split))
            for split in ("train", "test")]))
        os.makedirs(builder.data_dir)
        builder.info.write_to_directory(builder.data_dir)
    return metadata_dir


def _tfds_mocked() -> bool:
    init = tfds.core.DatasetBuilder.__init__
    return getattr(init, "__module__", None) == "tensorflow_datasets.testing.mocking"


def _examples(source):
    return [(source[i]["image"].tobytes(), int(source[i]["label"])) for i in range(len(source))]


def _keys(batches):
    """Multiset of (image bytes, label) of the real examples in `batches`."""
    out = collections.Counter()
    for b in batches:
        mask = b.get("mask", np.ones(len(b["label"]), bool))
        for image, label in zip(b["image"][mask], b["label"][mask], strict=True):
            out[(image.tobytes(), int(label))] += 1
    return out


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _assert_same(batches_a, batches_b):
    for a, b in zip(batches_a, batches_b, strict=True):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])


# --- The embedded digits builder -------------------------------------------------


def test_digits_builder_writes_all_examples_once(digits_dir):
    train = tfds.data_source("jamp_digits", split="train", data_dir=digits_dir, download=False)
    test = tfds.data_source("jamp_digits", split="test", data_dir=digits_dir, download=False)
    assert (len(train), len(test)) == (1437, 360)
    got = _examples(train) + _examples(test)
    for split in (train, test):
        image = split[0]["image"]
        assert image.shape == (8, 8, 1) and image.dtype == np.uint8
    labels = np.array([label for _, label in got])
    assert set(labels) == set(range(10))
    assert set(np.bincount(labels[len(train) :])) <= {35, 36, 37}  # Stratified test split.
    pixels = np.frombuffer(b"".join(image for image, _ in got), np.uint8)
    assert pixels.min() == 0 and pixels.max() == 255
    # Train + test is exactly sklearn's dataset (scaled), each example once.
    ref = load_digits()
    scaled = np.round(ref.images * 255 / 16).astype(np.uint8)[..., None]
    expected = collections.Counter(
        (im.tobytes(), int(y)) for im, y in zip(scaled, ref.target, strict=True)
    )
    assert collections.Counter(got) == expected
    split = digits.split_indices()
    assert not set(split["train"]) & set(split["test"])
    assert len(set(split["train"]) | set(split["test"])) == 1797


def test_digits_build_is_deterministic_and_idempotent(digits_dir, tmp_path):
    path = data.prepare_digits(tmp_path)
    assert path == str(tmp_path / "jamp_digits" / "1.0.0")
    for split in ("train", "test"):
        a = tfds.data_source("jamp_digits", split=split, data_dir=digits_dir, download=False)
        b = tfds.data_source("jamp_digits", split=split, data_dir=tmp_path, download=False)
        assert _examples(a) == _examples(b)
    info_file = tmp_path / "jamp_digits" / "1.0.0" / "dataset_info.json"
    mtime = info_file.stat().st_mtime_ns
    assert data.prepare_digits(tmp_path) == path
    assert info_file.stat().st_mtime_ns == mtime


def test_digits_in_an_empty_version_folder_are_built_an_incomplete_one_named(tmp_path):
    """An empty jamp_digits/1.0.0 is not the prepared dataset: it is built there; a folder
    with files but no dataset_info.json is named in the error (never silently reused)."""
    version_dir = tmp_path / "jamp_digits" / "1.0.0"
    version_dir.mkdir(parents=True)
    assert data.get_dataset_info("digits", tmp_path).num_train == 1437
    assert (version_dir / "dataset_info.json").exists()
    (version_dir / "dataset_info.json").unlink()
    with pytest.raises(data.DatasetNotFoundError) as e:
        data.get_dataset_info("digits", tmp_path)
    assert f"{version_dir} holds no dataset_info.json" in str(e.value)
    assert "Delete that folder and rerun" in str(e.value) and "tfds build" not in str(e.value)


def test_digits_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("JAMP_DATA_DIR", str(tmp_path))
    assert data.resolve_data_dir("digits", None) == str(tmp_path)
    monkeypatch.delenv("JAMP_DATA_DIR")
    assert data.resolve_data_dir("digits", None).endswith(".cache/jamp/tensorflow_datasets")
    monkeypatch.setenv("TFDS_DATA_DIR", "/data/tfds")
    assert data.resolve_data_dir("cifar10", None) == "/data/tfds"


def test_dataset_info_digits(digits_dir):
    info = data.get_dataset_info("digits", digits_dir)
    assert info == data.DatasetInfo("jamp_digits", 10, (8, 8, 1), 1437, 360, "train", "test")
    assert data.steps_per_epoch(info, 128) == 11


# --- Training pipeline ------------------------------------------------------------


def _digits_loader(digits_dir, **kwargs):
    kwargs = {"image_size": 8, "global_batch_size": 64, "seed": 0, **kwargs}
    info = data.get_dataset_info("digits", digits_dir)
    return data.train_loader(info, data_dir=digits_dir, **kwargs)


def test_train_loader_batches(digits_dir):
    loader = _digits_loader(digits_dir)
    assert isinstance(loader, grain.DataLoader)
    batches = _take(iter(loader), 4)
    for b in batches:
        assert set(b) == {"image", "label"}
        assert b["image"].shape == (64, 8, 8, 1) and b["image"].dtype == np.float32
        assert b["label"].shape == (64,) and b["label"].dtype == np.int32
        assert b["label"].min() >= 0 and b["label"].max() <= 9
    images = np.stack([b["image"] for b in batches])
    assert abs(images.mean()) < 0.2 and 0.8 < images.std() < 1.2
    assert not np.array_equal(batches[0]["image"], batches[1]["image"])
    big = next(iter(_digits_loader(digits_dir, image_size=16)))
    assert big["image"].shape == (64, 16, 16, 1)


def test_train_loader_seeded(digits_dir):
    a = _take(iter(_digits_loader(digits_dir, seed=7)), 3)
    _assert_same(a, _take(iter(_digits_loader(digits_dir, seed=7)), 3))
    b = next(iter(_digits_loader(digits_dir, seed=8)))
    assert not np.array_equal(a[0]["label"], b["label"])


def test_train_loader_augments(digits_dir):
    plain = next(iter(_digits_loader(digits_dir, augment=False)))
    augmented = next(iter(_digits_loader(digits_dir)))
    np.testing.assert_array_equal(plain["label"], augmented["label"])  # Same order.
    assert not np.array_equal(plain["image"], augmented["image"])


def test_train_loader_shards_processes(digits_dir):
    def epoch(**kwargs):
        loader = _digits_loader(digits_dir, augment=False, num_epochs=1, **kwargs)
        return _keys(loader)

    full = epoch(global_batch_size=1)
    shards = [epoch(global_batch_size=2, process_index=i, process_count=2) for i in range(2)]
    assert full.total() == 1437
    assert shards[0].total() == shards[1].total() == 718  # Equal shards, 1 dropped.
    # Disjoint, and together the whole split but the one dropped example (as
    # multisets: the digits may hold duplicate images).
    assert shards[0] + shards[1] <= full
    assert (full - shards[0] - shards[1]).total() == 1


def test_train_loader_worker_processes(digits_dir, absl_flags_parsed):
    in_process = _take(iter(_digits_loader(digits_dir, seed=5)), 2)
    it = iter(_digits_loader(digits_dir, seed=5, worker_count=1))
    _assert_same(in_process, _take(it, 2))
    state = it.get_state()
    expected = _take(it, 2)
    resumed = iter(_digits_loader(digits_dir, seed=5, worker_count=1))
    resumed.set_state(state)
    _assert_same(expected, _take(resumed, 2))


def test_train_loader_state_restore(digits_dir):
    it = iter(_digits_loader(digits_dir))
    _take(it, 25)  # Past the end of the first epoch (22 batches).
    state = it.get_state()
    expected = _take(it, 3)
    resumed = iter(_digits_loader(digits_dir))
    resumed.set_state(state)
    _assert_same(expected, _take(resumed, 3))


def test_train_loader_state_through_orbax(digits_dir, tmp_path):
    it = iter(_digits_loader(digits_dir, seed=3))
    _take(it, 5)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    state = {"w": np.arange(3.0)}
    mngr.save(
        5,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(it)
        ),
    )
    mngr.wait_until_finished()
    expected = _take(it, 3)
    resumed = iter(_digits_loader(digits_dir, seed=3))
    restored = mngr.restore(
        5,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(jax.tree.map(np.zeros_like, state)),
            data=grain.checkpoint.CheckpointRestore(resumed),
        ),
    )
    mngr.close()
    assert restored["data"] is resumed
    np.testing.assert_array_equal(restored["state"]["w"], state["w"])
    _assert_same(expected, _take(resumed, 3))


def test_batch_size_must_divide_process_count(digits_dir):
    with pytest.raises(ValueError, match="multiple of the process count"):
        _digits_loader(digits_dir, global_batch_size=10, process_count=4)
    with pytest.raises(ValueError, match="multiple of the process count"):
        data.eval_batches(
            data.get_dataset_info("digits", digits_dir),
            data_dir=digits_dir, image_size=8, global_batch_size=6, process_count=4,
        )


# --- Evaluation pipeline ----------------------------------------------------------


def _eval(digits_dir, **kwargs):
    kwargs = {"image_size": 8, "global_batch_size": 128, **kwargs}
    info = data.get_dataset_info("digits", digits_dir)
    return list(data.eval_batches(info, data_dir=digits_dir, **kwargs))


def test_eval_batches_cover_test_split_once(digits_dir):
    batches = _eval(digits_dir)
    assert len(batches) == 3
    for b in batches:
        assert b["image"].shape == (128, 8, 8, 1) and b["image"].dtype == np.float32
        assert b["label"].dtype == np.int32 and b["mask"].dtype == bool
    mask = np.concatenate([b["mask"] for b in batches])
    assert mask.sum() == 360 and mask[:360].all()  # Padding only at the end.
    test = tfds.data_source("jamp_digits", split="test", data_dir=digits_dir, download=False)
    labels = np.concatenate([b["label"] for b in batches])[:360]
    np.testing.assert_array_equal(labels, [test[i]["label"] for i in range(360)])
    _assert_same(batches, _eval(digits_dir))  # Deterministic.


def test_eval_batches_per_process(digits_dir):
    whole = _keys(_eval(digits_dir, global_batch_size=100))
    parts = [
        _eval(digits_dir, global_batch_size=100, process_index=i, process_count=2) for i in (0, 1)
    ]
    assert len(parts[0]) == len(parts[1]) == 4
    assert parts[0][0]["label"].shape == (50,)
    assert _keys(parts[0]) + _keys(parts[1]) == whole
    assert whole.total() == 360


# --- Named TFDS datasets ------------------------------------------------------------


def test_named_dataset(mnist_dir):
    info = data.get_dataset_info("mnist", mnist_dir)
    assert info == data.DatasetInfo("mnist", 10, (28, 28, 1), 40, 13, "train", "test")
    loader = data.train_loader(
        info, data_dir=mnist_dir, image_size=16, global_batch_size=8, seed=0
    )
    batch = next(iter(loader))
    assert batch["image"].shape == (8, 16, 16, 1) and batch["image"].dtype == np.float32
    batches = list(
        data.eval_batches(info, data_dir=mnist_dir, image_size=28, global_batch_size=8)
    )
    assert [int(b["mask"].sum()) for b in batches] == [8, 5]
    labels = np.concatenate([b["label"][b["mask"]] for b in batches])
    assert sorted(labels) == sorted(np.arange(13) % 10)  # tfds stores examples by key hash.


@pytest.mark.parametrize(
    "name,image_shape,image_size", [("mnist", (28, 28, 1), 16), ("cifar10", (32, 32, 3), 32)]
)
def test_named_dataset_with_tfds_mock_data(name, image_shape, image_size, tmp_path,
                                           tfds_mock_metadata):
    """The real TFDS path (builder, tfds.data_source, grain) on mock_data's random examples."""
    assert not _tfds_mocked()
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES, data_dir=tfds_mock_metadata,
                                policy=tfds.testing.MockPolicy.USE_FILES):
        assert _tfds_mocked()
        info = data.get_dataset_info(name, tmp_path)
        assert info == data.DatasetInfo(name, 10, image_shape, 21, 21, "train", "test")
        loader = data.train_loader(
            info, data_dir=tmp_path, image_size=image_size, global_batch_size=8, seed=0
        )
        batches = _take(iter(loader), 3)  # Across the end of the first epoch.
        for b in batches:
            assert b["image"].shape == (8, image_size, image_size, image_shape[-1])
            assert b["image"].dtype == np.float32 and np.isfinite(b["image"]).all()
            assert b["label"].shape == (8,) and b["label"].dtype == np.int32
            assert b["label"].min() >= 0 and b["label"].max() < info.num_classes
        batches = list(
            data.eval_batches(info, data_dir=tmp_path, image_size=image_size, global_batch_size=8)
        )
        assert [int(b["mask"].sum()) for b in batches] == [8, 8, 5]
        test = data.open_source(info, "test", tmp_path)
        labels = np.concatenate([b["label"][b["mask"]] for b in batches])
        np.testing.assert_array_equal(labels, [test[i]["label"] for i in range(21)])
    assert not list(tmp_path.iterdir())  # Nothing written, nothing downloaded.
    with pytest.raises(data.DatasetNotFoundError, match=f"tfds build {name}"):
        data.get_dataset_info(name, tmp_path)  # Real behaviour is back.


def test_tfrecord_only_dataset_is_refused(mnist_dir, tmp_path):
    version_dir = tmp_path / "mnist" / "3.0.1"
    shutil.copytree(f"{mnist_dir}/mnist/3.0.1", version_dir)
    info_file = version_dir / "dataset_info.json"
    info = json.loads(info_file.read_text())
    info["fileFormat"] = "tfrecord"
    info.pop("alternativeFileFormats", None)
    info_file.write_text(json.dumps(info))
    with pytest.raises(data.DatasetNotFoundError, match="array_record") as e:
        data.get_dataset_info("mnist", tmp_path)
    assert "convert_format" in str(e.value) and str(version_dir) in str(e.value)


def test_tfrecord_only_preparable_dataset_names_jamp_prepare(tmp_path):
    version_dir = tmp_path / "cifar10" / "3.0.2"
    version_dir.mkdir(parents=True)
    builder = tfds.builder("cifar10", data_dir=tmp_path, file_format="tfrecord")
    builder.info.write_to_directory(version_dir)
    with pytest.raises(data.DatasetNotFoundError, match="array_record") as e:
        data.get_dataset_info("cifar10", tmp_path)
    assert "`python -m jamp.data.prepare cifar10 --data_dir NEW_DIR`" in str(e.value)
    assert "convert_format" in str(e.value)
    from jamp.data import prepare

    with pytest.raises(prepare.PrepareError, match="holds cifar10 as tfrecord"):
        prepare.prepare_dataset("cifar10", tmp_path)


def test_unknown_dataset(tmp_path):
    with pytest.raises(data.DatasetNotFoundError, match="Unknown dataset 'mnsit'") as e:
        data.get_dataset_info("mnsit", tmp_path)
    assert "'mnist'" in str(e.value) and str(tmp_path) in str(e.value)
    assert isinstance(e.value, FileNotFoundError)


def test_not_prepared_dataset(tmp_path):
    with pytest.raises(data.DatasetNotFoundError) as e:
        data.get_dataset_info("cifar10", tmp_path)
    message = str(e.value)
    assert str(tmp_path) in message and "tfds build cifar10" in message
    assert f"`python -m jamp.data.prepare cifar10 --data_dir {tmp_path}`" in message
    assert "array_record" in message and not list(tmp_path.iterdir())  # Nothing written.


# --- Transforms -------------------------------------------------------------------


@pytest.mark.parametrize("shape,size", [((8, 8, 1), (20, 20)), ((37, 29, 3), (16, 12))])
def test_resize_matches_jax(shape, size):
    image = np.random.default_rng(0).uniform(0, 255, shape).astype(np.float32)
    expected = jax.image.resize(image, (*size, shape[-1]), "linear")
    np.testing.assert_allclose(transforms.resize(image, size), expected, rtol=1e-4, atol=1e-3)


def test_large_image_transforms():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (120, 90, 3), dtype=np.uint8)
    assert not transforms.is_small((120, 90, 3)) and not transforms.is_small((None, None, 3))
    out = transforms.RandomResizedCrop(size=32, flip=True).random_map(
        {"image": image, "label": np.int32(1)}, rng
    )
    assert out["image"].shape == (32, 32, 3)
    out = transforms.Preprocess(size=32, small=False).map({"image": image, "label": 1})
    assert out["image"].shape == (32, 32, 3)


def _raw_pixels(batches, info, data_dir):
    """Undoes the loader's normalisation: the uint8 pixels of each image, and the labels."""
    mean, std = data.sources.channel_stats(info, data_dir)
    images = np.concatenate([b["image"] for b in batches]) * np.float32(std) + np.float32(mean)
    raw = np.rint(images)
    np.testing.assert_allclose(images, raw, atol=1e-3)
    return raw.astype(np.uint8), np.concatenate([b["label"] for b in batches])


def _shifted_copies(images, labels, pad):
    """{(label, bytes)} of every crop of the reflect-padded images (all offsets)."""
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    return {
        (int(label), np.ascontiguousarray(crop).tobytes())
        for dy in range(2 * pad + 1)
        for dx in range(2 * pad + 1)
        for crop, label in zip(padded[:, dy : dy + h, dx : dx + w], labels, strict=True)
    }


@pytest.mark.parametrize("augment", [False, True], ids=["plain", "augmented"])
def test_digits_train_loader_never_mirrors_an_image(digits_dir, augment):
    """A mirrored digit is another symbol (or none): the digits loader must never flip.

    Checks the images themselves, as the trainer's loader yields them (flip left at its
    default): `test_flip_defaults_off_for_digits` only reads the dataset-name set.
    """
    info = data.get_dataset_info("digits", digits_dir)
    train = tfds.data_source("jamp_digits", split="train", data_dir=digits_dir, download=False)
    source = np.stack([train[i]["image"] for i in range(len(train))])
    labels = np.array([int(train[i]["label"]) for i in range(len(train))])
    pad = 1 if augment else 0  # the 8x8 digits' random crop: reflect-pad 1, crop back to 8
    upright = _shifted_copies(source, labels, pad)
    mirrored = _shifted_copies(source[:, :, ::-1], labels, pad) - upright

    def mirror_only(**kwargs):
        loader = _digits_loader(digits_dir, global_batch_size=479, augment=augment, **kwargs)
        images, got_labels = _raw_pixels(_take(iter(loader), 2), info, digits_dir)
        keys = [(int(y), x.tobytes()) for x, y in zip(images, got_labels, strict=True)]
        assert all(k in upright or k in mirrored for k in keys)  # a (flipped) source image
        return sum(k not in upright for k in keys)

    assert mirror_only() == 0
    if not augment:
        # Exactly the source examples, each once per epoch.
        loader = _digits_loader(digits_dir, global_batch_size=479, augment=False, num_epochs=1)
        images, got_labels = _raw_pixels(list(loader), info, digits_dir)

        def counts(images, labels):
            return collections.Counter(
                (x.tobytes(), int(y)) for x, y in zip(images, labels, strict=True))

        assert counts(images, got_labels) == counts(source, labels)
    else:
        assert mirror_only(flip=True) > 200  # the check does see flips: about half of 958


def test_flip_defaults_off_for_digits():
    assert "jamp_digits" in data.sources.NO_FLIP_DATASETS
    assert "mnist" in data.sources.NO_FLIP_DATASETS
    assert "cifar10" not in data.sources.NO_FLIP_DATASETS
