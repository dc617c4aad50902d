"""ViT training in the "fp8_current" precision mode (see jamp/config.py for every field).

bf16 mixed precision with fp8 (E4M3 forward, E5M2 gradient) matmuls in the Dense layers,
current scaling (no state; works with pipeline parallelism).

  jamp.train --config vit_fp8_current               # embedded digits, CPU-friendly
  jamp.train --config vit_fp8_current:b16,caltech101 --config.data_dir=/data/tfds
"""

from jamp.config import vit_config


def get_config(arg=None):
    return vit_config("fp8_current", arg)
