"""ViT training in the "bf16" precision mode (see jamp/config.py for every field).

  jamp.train --config vit_bf16               # embedded digits, CPU-friendly
  jamp.train --config vit_bf16:b16,caltech101 --config.data_dir=/data/tfds
"""

from jamp.config import vit_config


def get_config(arg=None):
    return vit_config("bf16", arg)
