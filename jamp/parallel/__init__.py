"""Device meshes, logical axis rules, data/tensor/pipeline parallel training, multi-host launch.

- :mod:`~jamp.parallel.mesh`: the ('data', 'model', 'pipe') mesh and logical axis rules;
- :mod:`~jamp.parallel.data_parallel`: gradients all-reduced in float32;
- :mod:`~jamp.parallel.pipeline`: the GPipe schedule over 'pipe' (``jax.shard_map``);
- :mod:`~jamp.parallel.zero`: ZeRO-1/2/3 (FSDP): state split over 'data';
- :mod:`~jamp.parallel.step`: the train step's gradient function that combines them;
- :mod:`~jamp.parallel.launch`: ``jax.distributed`` from flags, SLURM, Open MPI or torchrun.

Example:
  >>> from jamp import parallel
  >>> parallel.mesh_shape({"data": -1, "model": 2, "pipe": 2}, num_devices=8)
  (2, 2, 2)
"""

from jamp.parallel import data_parallel, launch, pipeline, step, zero
from jamp.parallel.mesh import (
    AXES,
    CPU_DEVICES_FLAG,
    LOGICAL_AXIS_RULES,
    Hardware,
    batch_sharding,
    hardware,
    make_mesh,
    mesh_shape,
    zero_splits_nothing,
)

__all__ = ["AXES", "CPU_DEVICES_FLAG", "LOGICAL_AXIS_RULES", "Hardware", "batch_sharding",
           "data_parallel", "hardware", "launch", "make_mesh", "mesh_shape", "pipeline", "step",
           "zero", "zero_splits_nothing"]
