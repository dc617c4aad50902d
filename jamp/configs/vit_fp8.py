"""ViT training in the "fp8" precision mode (see jamp/config.py for every field).

bf16 mixed precision with fp8 (E4M3 forward, E5M2 gradient) matmuls in the Dense layers,
delayed scaling (amax history in the train state, checkpointed).

  jamp.train --config vit_fp8               # embedded digits, CPU-friendly
  jamp.train --config vit_fp8:b16,caltech101 --config.data_dir=/data/tfds
"""

from jamp.config import vit_config


def get_config(arg=None):
    return vit_config("fp8", arg)
