"""ViT in "fp16" with Megatron-style tensor parallelism: heads and MLP split over 2 devices.

The mesh is data x model = (devices / 2) x 2: attention heads and MLP hidden
units are sharded over 'model' by the logical axis rules (jamp/parallel/mesh.py),
the rest is data-parallel. Needs num_heads and mlp_dim divisible by 2.

  jamp.train --config vit_fp16_tp                 # 8 GPUs: 4 x 2
  jamp.train --config vit_fp16_tp:b16,imagenet2012 --config.data_dir=/data/tfds
"""

from jamp.config import vit_config


def get_config(arg=None):
    config = vit_config("fp16", arg)
    config.mesh.data, config.mesh.model, config.mesh.pipe = -1, 2, 1
    return config
