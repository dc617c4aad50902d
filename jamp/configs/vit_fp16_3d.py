"""ViT in "fp16" with data x tensor x pipeline parallelism (3D).

The mesh is data x model x pipe = (devices / 4) x 2 x 2: heads and MLP units
split over 'model', the encoder into 2 pipeline stages of 4 microbatches, the
batch over 'data'. On 8 devices: 2 x 2 x 2.

  jamp.train --config vit_fp16_3d                 # 8 GPUs (or 8 fake CPUs)
  srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 \\
    python -m jamp.train --config vit_fp16_3d:b16,imagenet2012 \\
    --config.mesh.model=4 --config.data_dir=/data/tfds
"""

from jamp.config import vit_config


def get_config(arg=None):
    config = vit_config("fp16", arg)
    config.mesh.data, config.mesh.model, config.mesh.pipe = -1, 2, 2
    config.pipeline_microbatches = 4
    return config
