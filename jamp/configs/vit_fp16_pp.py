"""ViT in "fp16" with GPipe pipeline parallelism: the encoder split into 2 stages.

The mesh is data x pipe = (devices / 2) x 2: each stage holds half of the
encoder blocks; every data shard's batch runs through the stages as 4
microbatches (bubble (2-1)/(4+2-1) = 20%, reported as summary "pipeline_bubble").
Needs num_layers divisible by 2 and batch_size by data x 4.

  jamp.train --config vit_fp16_pp                 # 8 GPUs: 4 x 2
  jamp.train --config vit_fp16_pp --config.pipeline_microbatches=8
"""

from jamp.config import vit_config


def get_config(arg=None):
    config = vit_config("fp16", arg)
    config.mesh.data, config.mesh.model, config.mesh.pipe = -1, 1, 2
    config.pipeline_microbatches = 4
    return config
