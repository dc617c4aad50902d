"""ViT training in the "fp16_naive" precision mode (see jamp/config.py for every field).

  jamp.train --config vit_fp16_naive               # embedded digits, CPU-friendly
  jamp.train --config vit_fp16_naive:b16,caltech101 --config.data_dir=/data/tfds
"""

from jamp.config import vit_config


def get_config(arg=None):
    return vit_config("fp16_naive", arg)
