"""Data layer: TFDS data sources read by grain, and the embedded offline digits dataset.

Example:
  >>> from jamp import data
  >>> info = data.get_dataset_info("digits")
  >>> it = iter(data.train_loader(info, image_size=8, global_batch_size=128, seed=0))
  >>> next(it)["image"].shape
  (128, 8, 8, 1)
"""

from jamp.data.digits import JampDigits, prepare_digits
from jamp.data.pipeline import eval_batches, per_process_batch_size, steps_per_epoch, train_loader
from jamp.data.sources import (
    DatasetInfo,
    DatasetNotFoundError,
    get_dataset_info,
    open_source,
    resolve_data_dir,
)

__all__ = [
    "DatasetInfo",
    "DatasetNotFoundError",
    "JampDigits",
    "eval_batches",
    "get_dataset_info",
    "open_source",
    "per_process_batch_size",
    "prepare_digits",
    "resolve_data_dir",
    "steps_per_epoch",
    "train_loader",
]
