"""grain input pipelines over TFDS data sources: shuffled training batches, exact eval.

Both take the `DatasetInfo` of `get_dataset_info` (look the dataset up once, pass it
to both). Training: `train_loader` returns a `grain.DataLoader` (global shuffle with a seed,
per-process sharding, random crop / flip, batch, normalise). Its iterator yields
``{"image": float32 [B, H, W, C], "label": int32 [B]}`` numpy batches and carries
the data position: grain's orbax handler saves it next to the train state::

    import grain, orbax.checkpoint as ocp
    it = iter(train_loader(info, image_size=8, global_batch_size=128, seed=0))
    mngr = ocp.CheckpointManager(workdir)
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(it)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(it)))   # `it` now resumes in place

Without orbax: ``blob = it.get_state()`` (bytes) and ``it.set_state(blob)``. Restore
into a loader built with the same arguments: grain checks that the sampler (seed,
shards, epochs), the source and `worker_count` match the saved state.

Evaluation: `eval_batches` yields every example of the test split exactly once,
in order, in fixed-size batches; the padding of the last batch has ``mask`` False.

Example:
  >>> from jamp.data import get_dataset_info
  >>> info = get_dataset_info("digits")
  >>> loader = train_loader(info, image_size=8, global_batch_size=128, seed=0)
  >>> batch = next(iter(loader))
  >>> batch["image"].shape, batch["image"].dtype, batch["label"].dtype
  ((128, 8, 8, 1), dtype('float32'), dtype('int32'))
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import grain
import numpy as np

from jamp.data import sources, transforms
from jamp.data.sources import DatasetInfo

Batch = dict[str, np.ndarray]


def steps_per_epoch(info: DatasetInfo, global_batch_size: int) -> int:
    """Returns the number of full global batches in one pass over the train split.

    Example:
      >>> from jamp.data import get_dataset_info
      >>> info = get_dataset_info("digits")
      >>> steps_per_epoch(info, 128)
      11
    """
    return info.num_train // global_batch_size


def per_process_batch_size(global_batch_size: int, process_count: int) -> int:
    """Returns ``global_batch_size // process_count``, raising if it does not divide.

    Example:
      >>> per_process_batch_size(128, 4)
      32
    """
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"process count ({process_count}): each process loads "
            "global_batch_size // process_count examples per step."
        )
    return global_batch_size // process_count


def train_loader(
    info: DatasetInfo,
    *,
    data_dir: str | os.PathLike | None = None,
    image_size: int,
    global_batch_size: int,
    seed: int = 0,
    augment: bool = True,
    flip: bool | None = None,
    process_index: int = 0,
    process_count: int = 1,
    num_epochs: int | None = None,
    worker_count: int = 0,
    read_options: grain.ReadOptions | None = None,
) -> grain.DataLoader:
    """Returns a grain DataLoader of shuffled, augmented, normalised training batches.

    Each process reads its own disjoint shard of the train split (equal sizes; a
    remainder of fewer than `process_count` examples is dropped), shuffled anew
    every epoch; batches of ``global_batch_size // process_count`` examples are
    formed across epoch boundaries (full batches only). Augmentation is seeded by
    (`seed`, position), so a given seed always yields the same batches.

    Args:
      info: the dataset, from `get_dataset_info` (with the same `data_dir`).
      data_dir: TFDS data_dir; None picks the default (see `resolve_data_dir`).
      image_size: side of the square images produced.
      global_batch_size: examples per step over all processes.
      seed: shuffle and augmentation seed (non-negative, 32 bits).
      augment: random crop (and flip); False only resizes.
      flip: random horizontal flips; None means on unless the dataset is of digits
        or characters (`NO_FLIP_DATASETS`).
      process_index: this process's index (``jax.process_index()``).
      process_count: number of processes (``jax.process_count()``).
      num_epochs: passes over the data; None repeats forever.
      worker_count: grain worker processes for the transforms (0: in-process, the
        fastest on small hosts; on many-core hosts a few workers add throughput).
        Workers read grain's absl flags, so these must be parsed first: ``absl.app.run``
        does it (the ``jamp.train`` command); elsewhere call
        ``absl.flags.FLAGS.mark_as_parsed()``.
      read_options: grain's reader threads / prefetch buffer; None means no reader
        threads when `worker_count` is 0 (on 2 cores they only add GIL contention)
        and grain's defaults inside workers otherwise.

    Returns:
      A `grain.DataLoader`; ``iter()`` on it gives a checkpointable iterator of
      ``{"image": float32 [B, S, S, C], "label": int32 [B]}`` batches.

    Raises:
      ValueError: `global_batch_size` is not a multiple of `process_count`.

    Example:
      >>> from jamp.data import get_dataset_info
      >>> info = get_dataset_info("digits")
      >>> it = iter(train_loader(info, image_size=8, global_batch_size=64, seed=1))
      >>> next(it)["image"].shape
      (64, 8, 8, 1)
    """
    batch_size = per_process_batch_size(global_batch_size, process_count)
    source = sources.open_source(info, info.train_split, data_dir)
    mean, std = sources.channel_stats(info, sources.resolve_data_dir(info.name, data_dir))
    small = transforms.is_small(info.image_shape)
    if flip is None:
        flip = info.name not in sources.NO_FLIP_DATASETS
    batch = grain.transforms.Batch(batch_size=batch_size, drop_remainder=True)
    if not augment:
        operations = [transforms.Preprocess(size=image_size, small=small), batch]
    elif small:
        operations = [
            transforms.Preprocess(size=image_size, small=True),
            batch,
            transforms.PadCropFlip(flip=flip),
        ]
    else:
        operations = [
            transforms.Preprocess(size=image_size, small=False, keep_native=True),
            transforms.RandomResizedCrop(size=image_size, flip=flip),
            batch,
        ]
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        shard_options=grain.sharding.ShardOptions(
            shard_index=process_index, shard_count=process_count, drop_remainder=True
        ),
        shuffle=True,
        num_epochs=num_epochs,
        seed=seed,
    )
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[*operations, transforms.Normalize(mean=mean, std=std)],
        worker_count=worker_count,
        read_options=read_options or _default_read_options(worker_count),
    )


def eval_batches(
    info: DatasetInfo,
    *,
    data_dir: str | os.PathLike | None = None,
    image_size: int,
    global_batch_size: int,
    split: str | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Batch]:
    """Iterates over every example of a split exactly once, deterministically, unaugmented.

    Global batch ``b`` holds examples ``b * G ... (b + 1) * G - 1`` (G the global
    batch size) and process ``p`` gets its ``p``-th slice of G // process_count,
    so all processes yield the same number of batches, ceil(num / G). Positions
    past the end are padding: a blank image, label 0, ``mask`` False. Arguments are
    checked (and the split opened) when called, not on the first ``next``.

    Args:
      info: the dataset, from `get_dataset_info` (with the same `data_dir`).
      data_dir: TFDS data_dir; None picks the default (see `resolve_data_dir`).
      image_size: side of the square images produced.
      global_batch_size: examples per step over all processes.
      split: split to read; None means the dataset's test split.
      process_index: this process's index (``jax.process_index()``).
      process_count: number of processes (``jax.process_count()``).

    Returns:
      An iterator of batches ``{"image": [B, S, S, C] float32, "label": [B] int32,``
      ``"mask": [B] bool}``, B = global_batch_size // process_count.

    Raises:
      ValueError: `global_batch_size` is not a multiple of `process_count`.

    Example:
      >>> from jamp.data import get_dataset_info
      >>> info = get_dataset_info("digits")
      >>> batches = list(eval_batches(info, image_size=8, global_batch_size=128))
      >>> len(batches), int(sum(b["mask"].sum() for b in batches))
      (3, 360)
    """
    batch_size = per_process_batch_size(global_batch_size, process_count)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count}).")
    source = sources.open_source(info, split or info.test_split, data_dir)
    mean, std = sources.channel_stats(info, sources.resolve_data_dir(info.name, data_dir))
    preprocess = transforms.Preprocess(size=image_size, small=transforms.is_small(info.image_shape))
    num_batches = math.ceil(len(source) / global_batch_size)
    positions = (
        np.arange(num_batches * global_batch_size)
        .reshape(num_batches, process_count, batch_size)[:, process_index]
        .ravel()
    )
    padding = {
        "image": np.zeros((image_size, image_size, info.image_shape[-1]), np.float32),
        "label": np.int32(0),
        "mask": False,
    }

    def load(position: int) -> dict[str, np.ndarray]:
        if position >= len(source):
            return padding
        example = preprocess.map(source[int(position)])
        image = np.asarray(example["image"], np.float32)
        return {"image": image, "label": example["label"], "mask": True}

    dataset = (
        grain.MapDataset.source(positions)
        .map(load)
        .batch(batch_size)
        .map(transforms.Normalize(mean=mean, std=std).map)
    )
    return iter(dataset.to_iter_dataset(_default_read_options(0)))


def _default_read_options(worker_count: int) -> grain.ReadOptions:
    if worker_count > 0:
        return grain.ReadOptions()
    return grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
